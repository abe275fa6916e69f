"""Start a kernel process under a policy: the one place that orders the steps.

``sandbox``: plan the network (broker on the host, bridge listeners inside), plan the
mounts; then, with the native first stage, start the kernel as a child of the view
template's keeper (:mod:`.from_template`, :mod:`.template`: bwrap ran once for the
view), else build bwrap's argv, spawn it, write the uid map (root flow) and hand the
kernel its bootstrap configuration. ``guard``: a plain child process that confines
itself (Landlock + seccomp + audit hook) in a fresh workspace. ``off``: a plain child.

Whatever fails on the way, everything started so far is stopped before the error
propagates (fail closed).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sequester.errors import SandboxError
from sequester.guard import landlock
from sequester.guard.native_plan import NativePlanError, encode_plan, plan_stage0
from sequester.kernel.boot import STAGE_ONE, encode_config, encode_stage_two, server_command, stage_two
from sequester.kernel.bootstrap import bootstrap_config
from sequester.kernel.bytecode import ensure_kernel_bytecode
from sequester.kernel.environ import kernel_environment
from sequester.kernel.fork import ForkedKernel, ForkSandbox
from sequester.kernel.from_template import kernel_from_template, run_confined  # noqa: F401 - run_confined is public here
from sequester.kernel.spawn import FORK_MODULE_IN_VIEW, STAGE0_IN_VIEW, SandboxProcess, spawn_sandbox
from sequester.kernel.stage0 import fork_module, stage0_program
from sequester.kernel.template import (
    TemplateKernel,
    TemplateSandbox,
    TemplateUnavailable,
    ViewTemplate,
    templates_enabled,
)
from sequester.net.broker import Broker
from sequester.policy import Isolation, Policy
from sequester.sandbox.bwrap import close_fd
from sequester.sandbox.host import HostFacts, gather_host_facts
from sequester.sandbox.mounts import ROOT_SECRETS, hidden_paths, mount_backs
from sequester.sandbox.native import ctypes_library
from sequester.sandbox.probe import resolve_isolation

log = logging.getLogger("sequester.kernel")

__all__ = [
    "KernelProcess",
    "SandboxProcess",
    "launch_kernel",
    "spawn_sandbox",
    "run_in_sandbox",
    "run_confined",
    "kernel_command",
    "bootstrap_config",
]


@dataclass
class KernelProcess:
    """A started kernel: its process, the host's ends of its pipes, and what to clean up.

    ``popen`` is bwrap (sandbox mode), the kernel of a view template (sandbox mode, a
    :class:`~.template.TemplateKernel`), a warm kernel's fork (a :class:`~.fork.ForkedKernel`)
    or the kernel itself (guard and off modes).
    """

    mode: Isolation
    popen: subprocess.Popen[bytes] | TemplateKernel | ForkedKernel
    to_kernel: int
    from_kernel: int
    stdout: int
    stderr: int
    config: dict[str, Any]
    sandbox: SandboxProcess | TemplateSandbox | ForkSandbox | None = None
    workspace: Path | None = None
    # Start-up timestamps (time.monotonic_ns) of the host's phases, by name.
    timing: dict[str, int] = field(default_factory=dict)
    # The native first stage's plan (:func:`~sequester.guard.native_plan.encode_plan`),
    # sent instead of ``config`` when the kernel starts through it.
    first_frame: bytes | None = None
    # Why a kernel that would have come from a view template has a bwrap of its own.
    view_note: str | None = None
    # A warm kernel's fork channel, the host's end (:mod:`.fork`).
    fork_channel: socket.socket | None = None
    _closed: bool = field(default=False, repr=False)

    @property
    def view_template(self) -> ViewTemplate | None:
        """The view template whose keeper started this kernel (:mod:`.template`); None
        for a kernel with a bwrap of its own (or none)."""
        return self.sandbox.kernel.template if isinstance(self.sandbox, TemplateSandbox) else None

    @property
    def from_template(self) -> bool:
        """The kernel is a view template's child (:mod:`.template`), not bwrap's."""
        return self.view_template is not None

    @property
    def native_stage(self) -> bool:
        """The kernel confined itself through the native first stage (``stage0.c``)."""
        return self.first_frame is not None

    def send_config(self) -> None:
        """Hand the kernel its bootstrap configuration (:func:`~sequester.kernel.boot.encode_config`)
        or, through the native stage, its plan."""
        view = memoryview(self.first_frame if self.first_frame is not None else encode_config(self.config))
        while view:
            view = view[os.write(self.to_kernel, view) :]

    @property
    def broker(self) -> Broker | None:
        return self.sandbox.broker if self.sandbox else None

    def host_pids(self) -> list[int]:
        """Host pids of the kernel's processes (with bwrap's monitor when it has one of its own)."""
        return self.sandbox.host_pids() if self.sandbox is not None else [self.popen.pid]

    def terminate(self) -> None:
        """Kill everything of this kernel and release its resources. Idempotent.

        Returns once the processes are gone: killing the sandbox's init tears down its
        whole PID namespace, and bwrap's monitor exits with it.
        """
        if self._closed:
            return
        self._closed = True
        if self.sandbox is not None:
            self.sandbox.kill()
        else:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)  # the guard and off modes' own session
            except (ProcessLookupError, PermissionError):
                pass
            self.popen.kill()
            self.popen.wait()
        for fd in (self.to_kernel, self.from_kernel, self.stdout, self.stderr):
            close_fd(fd)
        if self.fork_channel is not None:
            self.fork_channel.close()
        if self.workspace is not None:
            shutil.rmtree(self.workspace, ignore_errors=True)

    def forget(self) -> None:
        """In a forked child: close this process's copies of the pipes, kill nothing."""
        if not self._closed:
            self._closed = True
            for fd in (self.to_kernel, self.from_kernel, self.stdout, self.stderr):
                close_fd(fd)


def kernel_command(
    facts: HostFacts, in_fd: int, out_fd: int, *, confined: bool = True, native: bool = False
) -> tuple[str, ...]:
    """The kernel's command: its confining first stage (which becomes the cell runner):
    the native one (``native``, bound at :data:`STAGE0_IN_VIEW`) or Python's; or (``off``)
    the cell runner straight away."""
    if native:
        return (str(STAGE0_IN_VIEW), str(in_fd), str(out_fd))
    if confined:
        # -I: no PYTHON* variables, no user site, nothing prepended to sys.path; -S: no
        # site (the first stage needs the standard library and sequester, whose root it
        # is given); -B: no .pyc writes. Each saves milliseconds of every start.
        return (
            str(facts.python_executable),
            "-I",
            "-S",
            "-B",
            "-c",
            STAGE_ONE,
            str(facts.package_root),
            str(in_fd),
            str(out_fd),
        )
    return tuple(server_command(str(facts.python_executable), in_fd, out_fd))


def launch_kernel(policy: Policy, *, facts: HostFacts | None = None, warm: bool = False) -> KernelProcess:
    """Start a kernel for ``policy``. The kernel still has to be sent its configuration
    (``KernelProcess.config``) and answer ``ready``; :class:`sequester.Kernel` does that.
    ``warm``: a warm kernel, which forks kernels (:mod:`.fork`): it needs the sandbox, the
    native first stage, view templates and the fork module, or raises
    :class:`SandboxError` saying which is missing."""
    timing = {"launch": time.monotonic_ns()}
    mode = resolve_isolation(policy.isolation)
    if warm:
        return _launch_warm(policy, mode, facts, timing)
    facts = facts or gather_host_facts(scan_ffi=mode is not Isolation.OFF, extra_roots=tuple(policy.readonly))
    ensure_kernel_bytecode(facts.package_root)
    timing["facts"] = time.monotonic_ns()
    with ExitStack() as on_failure, ExitStack() as child_side:

        def pipe() -> tuple[int, int]:
            r, w = os.pipe()
            on_failure.callback(close_fd, r)
            on_failure.callback(close_fd, w)
            return r, w

        to_kernel_r, to_kernel_w = pipe()
        from_kernel_r, from_kernel_w = pipe()
        out_r, out_w = pipe()
        err_r, err_w = pipe()
        child_ends = [to_kernel_r, from_kernel_w, out_w, err_w]
        for fd in child_ends:  # the kernel has them now; the host closes its copies
            child_side.callback(close_fd, fd)
        stage0 = stage0_program() if mode is Isolation.SANDBOX else None
        command = kernel_command(
            facts, to_kernel_r, from_kernel_w, confined=mode is not Isolation.OFF, native=stage0 is not None
        )
        first_frame = None
        sandbox: SandboxProcess | TemplateSandbox | None
        popen: subprocess.Popen[bytes] | TemplateKernel
        view_note = None
        try:
            from_view = None
            if stage0 is not None and templates_enabled():
                # The view is assembled once per policy; this kernel is a child of its keeper.
                def kernel_config(
                    ids: tuple[int, int], bridge: dict[str, Any] | None, below_tmp: tuple[Path, ...]
                ) -> dict[str, Any]:
                    return bootstrap_config(
                        policy, mode, root_flow=facts.is_root, bridge=bridge, keep_below_tmp=below_tmp, template_ids=ids
                    )

                try:
                    from_view = kernel_from_template(
                        policy, facts, stage0, kernel_config, to_kernel_r, from_kernel_w, out_w, err_w, timing
                    )
                except TemplateUnavailable as exc:
                    # A reason of the host's: the kernel still starts, as a bwrap of its own.
                    view_note = f"no view template here ({exc}); the kernel has a bwrap of its own"
                    log.info("%s", view_note)
            if from_view is not None:
                sandbox, config = from_view
                first_frame = b""  # the plan went with the spawn
                on_failure.callback(sandbox.kill)
                popen, workspace = sandbox.kernel, None
            elif stage0 is not None:
                # bwrap execs the native stage (bound below /tmp, which the workspace then
                # covers); it applies the host's plan and execs the cell runner directly.
                sandbox = spawn_sandbox(
                    policy,
                    facts,
                    command,
                    keep_fds=child_ends,
                    stdout=out_w,
                    stderr=err_w,
                    stderr_reader=err_r,
                    timing=timing,
                    stage0=stage0,
                )
                on_failure.callback(sandbox.kill)
                popen, workspace = sandbox.started.popen, None
                config = bootstrap_config(
                    policy, mode, root_flow=facts.is_root, bridge=sandbox.bridge, keep_below_tmp=sandbox.below_tmp
                )
                runner = server_command(
                    str(facts.python_executable), to_kernel_r, from_kernel_w, encode_stage_two(stage_two(config, {}))
                )
                try:
                    first_frame = encode_plan(plan_stage0(config, runner))
                except NativePlanError as exc:
                    raise SandboxError(f"cannot plan the kernel's native first stage: {exc}") from None
            elif mode is Isolation.SANDBOX:
                # The view covers _ctypes; the first stage gets it as this open file.
                ctypes_fd = os.open(ctypes_library(), os.O_RDONLY | os.O_CLOEXEC)
                child_side.callback(close_fd, ctypes_fd)
                sandbox = spawn_sandbox(
                    policy,
                    facts,
                    command,
                    keep_fds=[*child_ends, ctypes_fd],
                    stdout=out_w,
                    stderr=err_w,
                    stderr_reader=err_r,
                    timing=timing,
                )
                on_failure.callback(sandbox.kill)
                popen, workspace = sandbox.started.popen, None
                config = bootstrap_config(
                    policy,
                    mode,
                    root_flow=facts.is_root,
                    bridge=sandbox.bridge,
                    ctypes_fd=ctypes_fd,
                    keep_below_tmp=sandbox.below_tmp,
                )
            else:
                workspace = Path(tempfile.mkdtemp(prefix="sequester-workspace-"))
                on_failure.callback(shutil.rmtree, workspace, ignore_errors=True)
                config = _guard_config(policy, facts, mode, workspace)
                env = kernel_environment(os.environ, passthrough=policy.env, proxy=None, tmpdir=str(workspace))
                popen = subprocess.Popen(
                    command,
                    cwd=workspace,
                    env=env,
                    pass_fds=child_ends,
                    stdin=subprocess.DEVNULL,
                    stdout=out_w,
                    stderr=err_w,
                    start_new_session=True,
                )
                sandbox = None
        except OSError as exc:
            raise SandboxError(f"could not start the kernel: {exc}") from exc
        on_failure.pop_all()
    for fd in (to_kernel_w, from_kernel_r, out_r, err_r):
        os.set_inheritable(fd, False)
    timing["launched"] = time.monotonic_ns()
    return KernelProcess(
        mode,
        popen,
        to_kernel_w,
        from_kernel_r,
        out_r,
        err_r,
        config,
        sandbox,
        workspace,
        timing,
        first_frame,
        view_note=view_note,
    )


def _launch_warm(policy: Policy, mode: Isolation, facts: HostFacts | None, timing: dict[str, int]) -> KernelProcess:
    """A warm kernel: a view template's kernel (a template of its own: its view binds the
    fork module) with a fork channel, the ``warm`` filter and plan."""
    if mode is not Isolation.SANDBOX:
        raise SandboxError(f"a warm kernel needs the sandbox (isolation {mode.value} was asked)")
    stage0 = stage0_program()
    if stage0 is None or not templates_enabled():
        raise SandboxError("a warm kernel needs the native first stage and view templates")
    module = fork_module()
    facts = facts or gather_host_facts(scan_ffi=True, extra_roots=tuple(policy.readonly))
    ensure_kernel_bytecode(facts.package_root)
    timing["facts"] = time.monotonic_ns()
    pipes = [os.pipe() for _ in range(4)]
    host_channel, kernel_channel = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    (to_kernel_r, to_kernel_w), (from_kernel_r, from_kernel_w), (out_r, out_w), (err_r, err_w) = pipes
    channel_fd = kernel_channel.fileno()
    try:

        def kernel_config(
            ids: tuple[int, int], bridge: dict[str, Any] | None, below_tmp: tuple[Path, ...]
        ) -> dict[str, Any]:
            warm = {
                "module": str(FORK_MODULE_IN_VIEW),
                "channel_fd": channel_fd,
                "in_fd": to_kernel_r,
                "out_fd": from_kernel_w,
            }
            return bootstrap_config(
                policy,
                mode,
                root_flow=facts.is_root,
                bridge=bridge,
                keep_below_tmp=below_tmp,
                template_ids=ids,
                warm=warm,
            )

        try:
            sandbox, config = kernel_from_template(
                policy,
                facts,
                stage0,
                kernel_config,
                to_kernel_r,
                from_kernel_w,
                out_w,
                err_w,
                timing,
                warm=(module, channel_fd),
            )
        except TemplateUnavailable as exc:
            raise SandboxError(f"a warm kernel needs a view template, and there is none here: {exc}") from None
    except BaseException:
        for fd in (to_kernel_w, from_kernel_r, out_r, err_r):
            close_fd(fd)
        host_channel.close()
        raise
    finally:
        kernel_channel.close()
        for fd in (to_kernel_r, from_kernel_w, out_w, err_w):
            close_fd(fd)
    timing["launched"] = time.monotonic_ns()
    return KernelProcess(
        mode,
        sandbox.kernel,
        to_kernel_w,
        from_kernel_r,
        out_r,
        err_r,
        config,
        sandbox,
        None,
        timing,
        b"",
        fork_channel=host_channel,
    )


def _guard_config(policy: Policy, facts: HostFacts, mode: Isolation, workspace: Path) -> dict[str, Any]:
    if mode is Isolation.OFF:
        return bootstrap_config(policy, mode)
    hide_dirs, hide_files = hidden_paths(policy, facts)
    hidden = (*hide_dirs, *hide_files, Path("/tmp"), Path("/run"), Path("/var/tmp"), Path("/dev/shm"))
    if facts.is_root:
        # Without a user namespace the kernel stays uid 0 (with no capabilities), so it
        # would own root's files: keep the well-known secrets out of its reach too.
        hidden += ROOT_SECRETS
    top = [Path("/") / name for name in sorted(os.listdir("/"))]
    # The FFI libraries are left out of every grant: the cell runner cannot read them, so
    # cannot load them (the first stage imported ctypes before Landlock was applied).
    granted = [*landlock.readable_roots(top, hidden), *mount_backs(policy, facts)]
    # Resolved: a grant on the /lib symlink is a grant on /usr/lib, which must be carved too.
    granted = [Path(os.path.realpath(p)) for p in granted]
    read, listable = landlock.carve_files(dict.fromkeys(granted), facts.ffi_libraries)
    spec = {
        "read": [str(p) for p in read],
        "list_only": [str(p) for p in listable],
        "write": [str(workspace), "/dev/null"],
        "connect_ports": sorted({e.port for e in policy.allow}),
    }
    connects = [
        [e.host if e.host != "localhost" else "127.0.0.1", e.port]
        for e in policy.allow
        if e.is_ip or e.host == "localhost"
    ]
    names = [e.host for e in policy.allow if not e.is_ip]
    # Resolved here: the kernel's filter leaves its resolver no UDP (guard.resolver). An
    # allowed name's addresses are allowed on its own port.
    resolved = {name: ["127.0.0.1"] if name == "localhost" else _resolve(name) for name in names}
    connects += [[address, e.port] for e in policy.allow if not e.is_ip for address in resolved[e.host]]
    connects = [list(pair) for pair in dict.fromkeys(tuple(pair) for pair in connects)]
    return bootstrap_config(
        policy, mode, landlock_spec=spec, audit_network={"names": names, "connects": connects, "resolved": resolved}
    )


def _resolve(name: str) -> list[str]:
    """The addresses ``name`` has from here (none when it does not resolve: then the
    kernel cannot reach it, as in sandbox mode a failed lookup gets a refusal)."""
    import socket

    try:
        return list(dict.fromkeys(str(info[4][0]) for info in socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)))
    except OSError:
        return []


def run_in_sandbox(policy: Policy, command: list[str]) -> subprocess.CompletedProcess[str]:
    """Run ``command`` in the view a kernel of ``policy`` gets, without the kernel.

    For benchmarks and tests of the namespace and mount layer alone: the command gets
    no seccomp filter, no noexec workspace of its own (that is the kernel's first stage),
    and it keeps the bootstrap capabilities but SYS_ADMIN and NET_ADMIN (the kernel drops
    those itself). Never a way to run untrusted code.
    """
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        sandbox = spawn_sandbox(
            policy,
            gather_host_facts(scan_ffi=True, extra_roots=tuple(policy.readonly)),
            tuple(command),
            keep_fds=[],
            stdout=out_w,
            stderr=err_w,
            stderr_reader=err_r,
            kernel=False,
        )
    except BaseException:
        for fd in (out_r, err_r):
            close_fd(fd)
        raise
    finally:
        for fd in (out_w, err_w):
            close_fd(fd)
    try:
        with os.fdopen(out_r, "rb") as out, os.fdopen(err_r, "rb") as err:
            stdout, stderr = out.read(), err.read()
        code = sandbox.started.popen.wait()  # its output ended: it is exiting (a timeout would poll)
    finally:
        sandbox.kill()
    return subprocess.CompletedProcess(command, code, stdout.decode(errors="replace"), stderr.decode(errors="replace"))
