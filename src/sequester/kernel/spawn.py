"""A kernel's sandbox: its network (broker on the host, bridge listeners inside) and its
view (bwrap's spec), then bwrap started on it.

The two halves are separate because a view template (:mod:`.template`) shares the view
among kernels of one policy while each kernel keeps a network of its own.
"""

from __future__ import annotations

import os
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sequester.kernel.environ import kernel_environment
from sequester.net.broker import Broker
from sequester.net.plan import NetworkPlan, plan_network
from sequester.policy import Policy
from sequester.sandbox.argv import BOOTSTRAP_CAPS, ROOT_BOOTSTRAP_CAPS, TEMPLATE_CAPS, Identity, SandboxSpec
from sequester.sandbox.bwrap import StartedBwrap, close_fd, start_bwrap
from sequester.sandbox.host import HostFacts
from sequester.sandbox.mounts import MountKind, MountOp, plan_mounts
from sequester.sandbox.procs import descendants

__all__ = [
    "SandboxProcess",
    "KernelNetwork",
    "spawn_sandbox",
    "kernel_network",
    "kernel_view",
    "KernelView",
    "STAGE0_IN_VIEW",
    "FORK_MODULE_IN_VIEW",
]

_HOSTS = Path("/etc/hosts").resolve()
# Where a kernel's view shows the native first stage while it runs (then covered).
STAGE0_IN_VIEW = Path("/tmp/.sequester-stage0")
# A warm kernel's fork module (kernel/stage0_fork.c), read-only; not below /tmp: it is
# imported after the kernel's own /tmp covered what bwrap bound there.
FORK_MODULE_IN_VIEW = Path("/.sequester/fork.so")
# Only a kernel's first stage makes namespaces (and then drops these).
_NAMESPACE_CAPS = frozenset({"CAP_SYS_ADMIN", "CAP_NET_ADMIN"})
_LOCALHOST_ONLY = "127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n"


@dataclass
class SandboxProcess:
    """bwrap running a command in a kernel's view, and the broker serving its network."""

    started: StartedBwrap
    broker: Broker | None
    bridge: dict[str, Any] | None  # what the kernel's bridge must listen on
    below_tmp: tuple[Path, ...] = ()  # top-most binds below /tmp: the kernel's new /tmp keeps them

    def kill(self) -> None:
        self.started.kill()
        if self.broker is not None:
            self.broker.close()

    def signal_kernel(self) -> None:
        """SIGKILL the kernel from any thread, closing nothing (see ``serve.sessions``)."""
        self.started.signal_init()

    def host_pids(self) -> list[int]:
        """bwrap's monitor, the sandbox's init and everything under it."""
        return [self.started.popen.pid, self.started.pid, *descendants(self.started.pid)]


@dataclass
class KernelNetwork:
    """A kernel's own network: the host's broker and what its bridge listens on."""

    plan: NetworkPlan | None
    broker: Broker | None
    bridge: dict[str, Any] | None
    control_fd: int | None  # the bridge's end of the broker, for the kernel to keep

    def close(self) -> None:
        if self.broker is not None:
            self.broker.close()


@dataclass(frozen=True)
class KernelView:
    """What bwrap builds for a kernel of a policy: the spec and its data files."""

    spec: SandboxSpec
    data_files: dict[Path, str]
    below_tmp: tuple[Path, ...]


def kernel_network(policy: Policy) -> KernelNetwork:
    """Start the broker of ``policy``'s allowed services (none: no broker). The caller
    closes ``control_fd`` once the kernel holds it, and the broker with the kernel."""
    plan: NetworkPlan | None = plan_network(policy.allow) if policy.allow else None
    if plan is None:
        return KernelNetwork(None, None, None, None)
    broker = Broker(policy.allow)
    try:
        control_fd = broker.start().detach()
    except BaseException:
        broker.close()
        raise
    bridge = {
        "control_fd": control_fd,
        "listeners": [
            [
                listener.address,
                listener.port,
                listener.target.host if listener.target else None,
                listener.target.port if listener.target else None,
            ]
            for listener in plan.listeners
        ],
    }
    return KernelNetwork(plan, broker, bridge, control_fd)


def kernel_view(
    policy: Policy,
    facts: HostFacts,
    command: tuple[str, ...],
    network: KernelNetwork,
    *,
    kernel: bool = True,
    stage0: Path | None = None,
    allow_userns: bool = False,
    fork_module: Path | None = None,
) -> KernelView:
    """bwrap's spec for ``command`` in the view of ``policy`` (pure but for the
    environment it copies). ``stage0``: the native first stage's program, bound
    read-only at :data:`STAGE0_IN_VIEW`."""
    # Only the allowed names resolve: /etc/hosts is ours. No name server is reachable
    # from the empty network namespace, whatever /etc/resolv.conf says.
    plan = network.plan
    data_files = {_HOSTS: plan.hosts_file if plan else _LOCALHOST_ONLY}
    mounts = plan_mounts(policy, facts, data_files=data_files)
    below_tmp = _below_tmp(mounts)
    if stage0 is not None:
        # Last, so below the view's /tmp tmpfs; not in below_tmp, so the kernel's own
        # /tmp covers it once the native stage has run.
        mounts += (MountOp(MountKind.READONLY, STAGE0_IN_VIEW, source=stage0),)
    if fork_module is not None:  # a warm kernel's view (a template of its own)
        # (its folder made first: bwrap would make it 0700, out of a nobody kernel's reach)
        mounts += (
            MountOp(MountKind.DIR, FORK_MODULE_IN_VIEW.parent, mode=0o755),
            MountOp(MountKind.READONLY, FORK_MODULE_IN_VIEW, source=fork_module),
        )
    spec = SandboxSpec(
        mounts=mounts,
        command=command,
        env=kernel_environment(os.environ, passthrough=policy.env, proxy=plan.env if plan else (), tmpdir="/tmp"),
        # A template's keeper of an ordinary caller is root of its namespace (the caller
        # outside), so that it owns the view's mount namespace: its kernels map themselves
        # back to the caller (bwrap's own --uid would leave it in a nested namespace that
        # owns nothing, and no kernel could mount its /proc).
        identity=Identity.NOBODY if facts.is_root else Identity.ROOT if allow_userns else Identity.CALLER,
        caps=TEMPLATE_CAPS if allow_userns and not facts.is_root else _caps(facts.is_root, kernel),
        # The command is the namespace's only process. Attack (red team): with bwrap's
        # own init as pid 1 (same uid, no seccomp filter, in bwrap's mount namespace
        # with its writable, exec-capable /tmp), an ordinary caller's cell could write
        # /proc/1/mem and run code outside the filter, or load a library from
        # /proc/1/root/tmp.
        as_pid_1=True,
        allow_userns=allow_userns,
    )
    return KernelView(spec, data_files, below_tmp)


def spawn_sandbox(
    policy: Policy,
    facts: HostFacts,
    command: tuple[str, ...],
    *,
    keep_fds: list[int],
    stdout: int,
    stderr: int,
    stderr_reader: int,
    kernel: bool = True,
    timing: dict[str, int] | None = None,
    stage0: Path | None = None,
) -> SandboxProcess:
    """Spawn bwrap running ``command`` in the view of ``policy``; fail closed.

    ``keep_fds`` are passed to the command; ``stderr_reader`` is read for bwrap's own
    error message if it fails. ``kernel``: the command is a kernel's first stage, which
    gets the capabilities it needs to make its namespaces (and drops them); otherwise
    (:func:`~.launch.run_in_sandbox`) it gets fewer: no SYS_ADMIN, no NET_ADMIN. ``stage0``: the
    native first stage's program, bound read-only at :data:`STAGE0_IN_VIEW`.
    """
    with ExitStack() as on_failure, ExitStack() as temporary:
        network = kernel_network(policy)
        on_failure.callback(network.close)
        pass_fds = list(keep_fds)
        if network.control_fd is not None:
            temporary.callback(close_fd, network.control_fd)
            pass_fds.append(network.control_fd)
        view = kernel_view(policy, facts, command, network, kernel=kernel, stage0=stage0)
        if timing is not None:
            timing["planned"] = time.monotonic_ns()
        started = start_bwrap(
            view.spec,
            data_files=view.data_files,
            keep_fds=pass_fds,
            stdout=stdout,
            stderr=stderr,
            stderr_reader=stderr_reader,
            timing=timing,
        )
        on_failure.pop_all()
    return SandboxProcess(started, network.broker, network.bridge, view.below_tmp)


def _below_tmp(mounts: tuple[MountOp, ...]) -> tuple[Path, ...]:
    tmp = Path("/tmp")
    binds = [
        op.dest for op in mounts if op.kind is MountKind.READONLY and op.dest.is_relative_to(tmp) and op.dest != tmp
    ]
    return tuple(b for b in binds if not any(b != o and b.is_relative_to(o) for o in binds))


def _caps(root: bool, kernel: bool) -> tuple[str, ...]:
    caps = ROOT_BOOTSTRAP_CAPS if root else BOOTSTRAP_CAPS
    return caps if kernel else tuple(c for c in caps if c not in _NAMESPACE_CAPS)
