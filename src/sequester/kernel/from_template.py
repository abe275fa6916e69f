"""A kernel, or one command, started from its policy's view template (:mod:`.template`).

Both go the same way: the policy's view (bwrap's spec, which is the template's key), the
template (started if this is the view's first use), a plan from the bootstrap
configuration (:func:`~sequester.guard.native_plan.plan_stage0`: the kernel's own
``/proc``, workspace, user namespace, limits, privilege drop, write lock and filter), and
the keeper's child running it. A kernel's plan ends in the cell runner; a command's in
the command, under exactly the confinement a kernel's cells get.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sequester.errors import SandboxError
from sequester.guard.native_plan import NativePlanError, encode_plan, plan_stage0
from sequester.guard.privileges import NOBODY
from sequester.kernel.boot import encode_stage_two, server_command, stage_two
from sequester.kernel.bootstrap import bootstrap_config
from sequester.kernel.protocol import loads
from sequester.kernel.spawn import KernelNetwork, KernelView, kernel_network, kernel_view
from sequester.kernel.stage0 import stage0_program
from sequester.kernel.template import (
    StaleView,
    TemplateKernel,
    TemplateSandbox,
    ViewTemplate,
    forget,
    template_for,
    templates_enabled,
)
from sequester.net.plan import plan_network
from sequester.policy import Isolation, Policy
from sequester.sandbox.bwrap import close_fd
from sequester.sandbox.host import HostFacts, gather_host_facts

__all__ = ["kernel_from_template", "run_confined"]

ConfigFor = Callable[[tuple[int, int], "dict[str, Any] | None", "tuple[Path, ...]"], "dict[str, Any]"]


def _template(
    policy: Policy, facts: HostFacts, stage0: Path, network: KernelNetwork, fork_module: Path | None = None
) -> tuple[ViewTemplate, KernelView]:
    view = kernel_view(policy, facts, (), network, stage0=stage0, allow_userns=True, fork_module=fork_module)
    # The template is the view: whatever would change bwrap's argv or files changes the key.
    key = repr((view.spec, sorted(view.data_files.items()), str(stage0)))
    return template_for(key, lambda: ViewTemplate.start(view)), view


def _spawn(
    policy: Policy,
    facts: HostFacts,
    stage0: Path,
    network: KernelNetwork,
    plan_for: Callable[[KernelView], tuple[bytes, dict[str, Any]]],
    fds: list[tuple[int, int]],
    out_target: int,
    fork_module: Path | None = None,
    **spawn_options: bool,
) -> tuple[TemplateKernel, KernelView, dict[str, Any]]:
    """The keeper's child running the plan of ``plan_for(view)`` (the plan, and the
    configuration it came from), from the view's live template. A
    view found stale (a file it covers was replaced on the host) or retired meanwhile is
    dropped and the start goes once more, from a new view that covers it again."""
    for attempt in (1, 2):
        template, view = _template(policy, facts, stage0, network, fork_module)
        plan, config = plan_for(view)
        try:
            return template.spawn(plan, fds, out_target, **spawn_options), view, config
        except StaleView:
            forget(template)
            if attempt == 2:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def _ids(facts: HostFacts) -> tuple[int, int]:
    # A root caller's kernel is nobody (KERNEL_HOST_ID on the host); an ordinary caller's
    # is the caller, as in a sandbox bwrap made for it alone.
    return (NOBODY, NOBODY) if facts.is_root else (facts.uid, facts.gid)


def _plan(config: dict[str, Any], command: list[str], *, timing: bool = True) -> bytes:
    try:
        return encode_plan(plan_stage0(config, command, timing=timing))[4:]  # the keeper takes the length apart
    except NativePlanError as exc:
        raise SandboxError(f"cannot plan the kernel's native first stage: {exc}") from None


def kernel_from_template(
    policy: Policy,
    facts: HostFacts,
    stage0: Path,
    config_for: ConfigFor,
    to_kernel_r: int,
    from_kernel_w: int,
    out_w: int,
    err_w: int,
    timing: dict[str, int],
    warm: tuple[Path, int] | None = None,
) -> tuple[TemplateSandbox, dict[str, Any]]:
    """A kernel of ``policy`` as a child of its view's keeper, running the plan of
    ``config_for(ids, bridge, below_tmp)``; the kernel's pipes are placed at the numbers
    its cell runner's command names (stdout and stderr at 1 and 2). ``warm``: a warm
    kernel's (the fork module on the host, the kernel's end of its fork channel), in a
    view with the module bound (:data:`~.spawn.FORK_MODULE_IN_VIEW`)."""
    network = kernel_network(policy)
    try:
        fds = [(to_kernel_r, to_kernel_r), (from_kernel_w, from_kernel_w), (out_w, 1), (err_w, 2)]
        if network.control_fd is not None:
            fds.append((network.control_fd, network.control_fd))
        if warm is not None:
            fds.append((warm[1], warm[1]))

        def plan_for(view: KernelView) -> tuple[bytes, dict[str, Any]]:
            timing["t:view"] = time.monotonic_ns()
            config = config_for(_ids(facts), network.bridge, view.below_tmp)
            runner = server_command(
                str(facts.python_executable), to_kernel_r, from_kernel_w, encode_stage_two(stage_two(config, {}))
            )
            plan = _plan(config, runner)
            timing["t:planned"] = time.monotonic_ns()
            return plan, config

        kernel, view, config = _spawn(
            policy, facts, stage0, network, plan_for, fds, from_kernel_w, warm[0] if warm is not None else None
        )
    except BaseException:
        network.close()
        raise
    finally:
        if network.control_fd is not None:
            close_fd(network.control_fd)
    return TemplateSandbox(kernel, network, view.below_tmp), config


def run_confined(
    policy: Policy, command: list[str], *, timeout: float | None = None, facts: HostFacts | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` (its program an absolute path in the view) under a kernel's whole
    confinement in the view of ``policy``: what a kernel's cells get, from the policy's
    view template (no network: the allowed services need the kernel's bridge). Its
    status, stdout and stderr (each up to 16 MiB) come back; a start that fails is a
    :class:`SandboxError` naming the step. The filter forbids starting processes, so
    ``command`` is one program (``true``, a compiled test binary), not a shell pipeline.
    Like a kernel, it is its PID namespace's init: a signal it sends itself with no
    handler (``raise(SIGTERM)``) is ignored, and ``abort()`` ends it with SIGSEGV, not
    SIGABRT; read a status accordingly."""
    if not command or not os.path.isabs(command[0]):
        raise SandboxError(f"the command's program must be an absolute path, not {command[:1]!r}")
    stage0 = stage0_program()
    if stage0 is None or not templates_enabled():
        raise SandboxError("run_confined needs the native first stage and view templates")
    facts = facts or gather_host_facts(scan_ffi=True, extra_roots=tuple(policy.readonly))
    network = KernelNetwork(plan_network(policy.allow) if policy.allow else None, None, None, None)
    pipes = [os.pipe2(os.O_CLOEXEC) for _ in range(3)]  # stdout, stderr, the stage's report
    try:

        def plan_for(view: KernelView) -> tuple[bytes, dict[str, Any]]:
            config = bootstrap_config(
                policy,
                Isolation.SANDBOX,
                root_flow=facts.is_root,
                keep_below_tmp=view.below_tmp,
                template_ids=_ids(facts),
            )
            return _plan(config, list(command), timing=False), config

        kernel, _, _ = _spawn(
            policy,
            facts,
            stage0,
            network,
            plan_for,
            [(pipes[0][1], 1), (pipes[1][1], 2), (pipes[2][1], pipes[2][1])],
            pipes[2][1],
            close_report_on_exec=True,
        )
    except BaseException:
        for r, w in pipes:
            close_fd(r)
            close_fd(w)
        raise
    for _, w in pipes:
        close_fd(w)
    return _collect(kernel, command, [r for r, _ in pipes], timeout)


_OUTPUT_LIMIT = 16 << 20


def _collect(
    kernel: TemplateKernel, command: list[str], readers: list[int], timeout: float | None
) -> subprocess.CompletedProcess[str]:
    import select

    deadline = None if timeout is None else time.monotonic() + timeout

    def left() -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def expired() -> subprocess.TimeoutExpired:
        kernel.kill()
        kernel.wait()
        return subprocess.TimeoutExpired(command, timeout or 0.0)

    chunks: list[list[bytes]] = [[], [], []]
    sizes = [0, 0, 0]
    poller = select.poll()  # not select: a host with over 1024 descriptors open
    for fd in readers:
        poller.register(fd, select.POLLIN)
    open_fds = set(readers)
    try:
        while open_fds:
            wait = left()
            ready = poller.poll(None if wait is None else int(wait * 1000))
            if not ready:
                raise expired()
            for fd, _ in ready:
                data = os.read(fd, 65536)
                i = readers.index(fd)
                if not data:
                    open_fds.discard(fd)
                    poller.unregister(fd)
                elif sizes[i] < _OUTPUT_LIMIT:  # beyond the limit it is read and dropped
                    chunks[i].append(data[: _OUTPUT_LIMIT - sizes[i]])
                    sizes[i] += len(chunks[i][-1])
        # Its output closed is not its end (red team: a command that closes 1 and 2 and
        # sleeps): the deadline holds until it exits.
        try:
            code = kernel.wait(timeout=left())
        except subprocess.TimeoutExpired:
            raise expired() from None
    finally:
        for fd in readers:
            close_fd(fd)
        if kernel.returncode is None:
            kernel.kill()
            kernel.wait()
    report = b"".join(chunks[2])
    if report:  # the stage failed before the exec: its protocol message
        try:
            reason = loads(report[4:].decode("utf-8", "replace")).get("error")
        except Exception:  # noqa: BLE001 - the host's own stage; still fail closed
            reason = None
        raise SandboxError(f"the command's sandbox failed: {reason or 'no reason given'}")
    out, err = (b"".join(c).decode(errors="replace") for c in chunks[:2])
    return subprocess.CompletedProcess(command, code, out, err)
