"""Start a kernel process under a policy: the one place that orders the steps.

``sandbox``: plan the network (broker on the host, bridge listeners inside), plan the
mounts, build bwrap's argv, spawn it, write the uid map (root flow), then hand the
kernel its bootstrap configuration. ``guard``: a plain child process that confines
itself (Landlock + seccomp + audit hook) in a fresh workspace. ``off``: a plain child.

Whatever fails on the way, everything started so far is stopped before the error
propagates (fail closed).
"""

from __future__ import annotations

import os
import time
import shutil
import signal
import subprocess
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..errors import SandboxError
from ..guard import landlock, seccomp
from ..guard.namespaces import plan_workspace
from ..guard.native_plan import NativePlanError, encode_plan, plan_stage0
from ..guard.privileges import NOBODY
from ..guard.workspace import steps_for_kernel
from ..kernel.boot import STAGE_ONE, encode_config, encode_stage_two, server_command, stage_two
from ..kernel.bytecode import ensure_kernel_bytecode
from ..kernel.stage0 import stage0_program
from ..net.broker import Broker
from ..net.plan import NetworkPlan, plan_network
from ..policy import Isolation, Policy
from .argv import BOOTSTRAP_CAPS, ROOT_BOOTSTRAP_CAPS, Identity, SandboxSpec
from .environment import kernel_environment
from .host import HostFacts, gather_host_facts
from .mounts import WORKSPACE, MountKind, MountOp, hidden_paths, mount_backs, plan_mounts
from .native import ctypes_library
from .bwrap import StartedBwrap, close_fd, descendants, start_bwrap
from .probe import resolve_isolation

__all__ = ["KernelProcess", "SandboxProcess", "launch_kernel", "spawn_sandbox", "run_in_sandbox", "kernel_command",
           "bootstrap_config"]

# Root-only files a guard-only kernel running as uid 0 must not read (Landlock grants
# everything else of /etc).
ROOT_SECRETS = tuple(Path(p) for p in ("/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-",
                                        "/etc/sudoers", "/etc/sudoers.d", "/etc/ssh", "/etc/ssl/private"))
_HOSTS = Path("/etc/hosts").resolve()
# Where a kernel's view shows the native first stage while it runs (then covered).
STAGE0_IN_VIEW = Path("/tmp/.sequester-stage0")
# Only a kernel's first stage makes namespaces (and then drops these).
_NAMESPACE_CAPS = frozenset({"CAP_SYS_ADMIN", "CAP_NET_ADMIN"})
_LOCALHOST_ONLY = "127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n"


@dataclass
class KernelProcess:
    """A started kernel: its process, the host's ends of its pipes, and what to clean up.

    ``popen`` is bwrap (sandbox mode) or the kernel itself (guard and off modes).
    """

    mode: Isolation
    popen: subprocess.Popen[bytes]
    to_kernel: int
    from_kernel: int
    stdout: int
    stderr: int
    config: dict[str, Any]
    sandbox: SandboxProcess | None = None
    workspace: Path | None = None
    # Start-up timestamps (time.monotonic_ns) of the host's phases, by name.
    timing: dict[str, int] = field(default_factory=dict)
    # The native first stage's plan (:func:`~sequester.guard.native_plan.encode_plan`),
    # sent instead of ``config`` when the kernel starts through it.
    first_frame: bytes | None = None
    _closed: bool = field(default=False, repr=False)

    @property
    def native_stage(self) -> bool:
        """The kernel confined itself through the native first stage (``stage0.c``)."""
        return self.first_frame is not None

    def send_config(self) -> None:
        """Hand the kernel its bootstrap configuration (:func:`~sequester.kernel.boot.encode_config`)
        or, through the native stage, its plan."""
        view = memoryview(self.first_frame if self.first_frame is not None else encode_config(self.config))
        while view:
            view = view[os.write(self.to_kernel, view):]

    @property
    def broker(self) -> Broker | None:
        return self.sandbox.broker if self.sandbox else None

    def host_pids(self) -> list[int]:
        """Host pids of the bwrap monitor, the sandbox's init and the processes under it."""
        pids = [self.popen.pid]
        if self.sandbox is not None:
            pids += [self.sandbox.started.pid, *descendants(self.sandbox.started.pid)]
        return pids

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
        if self.workspace is not None:
            shutil.rmtree(self.workspace, ignore_errors=True)


def kernel_command(facts: HostFacts, in_fd: int, out_fd: int, *, confined: bool = True,
                   native: bool = False) -> tuple[str, ...]:
    """The kernel's command: its confining first stage (which becomes the cell runner):
    the native one (``native``, bound at :data:`STAGE0_IN_VIEW`) or Python's; or (``off``)
    the cell runner straight away."""
    if native:
        return (str(STAGE0_IN_VIEW), str(in_fd), str(out_fd))
    if confined:
        # -I: no PYTHON* variables, no user site, nothing prepended to sys.path; -S: no
        # site (the first stage needs the standard library and sequester, whose root it
        # is given); -B: no .pyc writes. Each saves milliseconds of every start.
        return (str(facts.python_executable), "-I", "-S", "-B", "-c", STAGE_ONE, str(facts.package_root),
                str(in_fd), str(out_fd))
    return tuple(server_command(str(facts.python_executable), in_fd, out_fd))


def bootstrap_config(policy: Policy, mode: Isolation, *, root_flow: bool = False,
                     bridge: dict[str, Any] | None = None, landlock_spec: dict[str, Any] | None = None,
                     audit_network: dict[str, Any] | None = None, ctypes_fd: int | None = None,
                     keep_below_tmp: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The first message a kernel reads: what its bootstrap must do. Everything in it
    that depends only on the policy and the host (the seccomp program, the workspace's
    mounts) is computed here, once, so the kernel's first stage only applies it."""
    limits = policy.limits
    config: dict[str, Any] = {
        "mode": mode.value,
        "limits": {
            "memory_bytes": limits.memory_mb * 1024 * 1024,
            "max_threads": limits.max_threads,
            "file_bytes": limits.workspace_mb * 1024 * 1024,
            "output_bytes": limits.output_bytes,
        },
    }
    if mode is Isolation.OFF:
        return config
    config["seccomp"] = {"bpf": seccomp.compile_filter(), "nr": seccomp.syscall_number("seccomp")}
    if mode is Isolation.SANDBOX:
        # The kernel's own noexec tmpfs for /tmp and /dev/shm together (see guard.namespaces).
        steps = plan_workspace(limits.workspace_mb * 1024 * 1024, WORKSPACE, keep_below_tmp)
        config["workspace"] = {"steps": steps_for_kernel(steps), "path": str(WORKSPACE)}
        # Attack (red team): /proc/self/mem is covered, but a thread's /proc/<tid>/mem is
        # not listed and still opens: a cell wrote its own code through it. With Landlock,
        # nothing is writable but the workspace and the device nodes (reads are the view's).
        abi = _landlock_abi()
        if abi:
            config["write_lock"] = {"handled": landlock.write_rights(abi), "paths": ["/tmp", "/dev/shm", "/dev"], "abi": abi}
    if ctypes_fd is not None:
        config["ctypes_fd"] = ctypes_fd
    if root_flow:
        config.update(root_flow=True, drop_to_uid=NOBODY, chown=[str(WORKSPACE)])
    if bridge:
        config["bridge"] = bridge
    if landlock_spec:
        config["landlock"] = landlock_spec
    if audit_network:
        config["audit_network"] = audit_network
    return config


@lru_cache(maxsize=1)
def _landlock_abi() -> int:
    return landlock.abi_version()


def launch_kernel(policy: Policy, *, facts: HostFacts | None = None) -> KernelProcess:
    """Start a kernel for ``policy``. The kernel still has to be sent its configuration
    (``KernelProcess.config``) and answer ``ready``; :class:`sequester.Kernel` does that."""
    timing = {"launch": time.monotonic_ns()}
    mode = resolve_isolation(policy.isolation)
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
        command = kernel_command(facts, to_kernel_r, from_kernel_w, confined=mode is not Isolation.OFF,
                                 native=stage0 is not None)
        first_frame = None
        try:
            if stage0 is not None:
                # bwrap execs the native stage (bound below /tmp, which the workspace then
                # covers); it applies the host's plan and execs the cell runner directly.
                sandbox = spawn_sandbox(policy, facts, command, keep_fds=child_ends, stdout=out_w, stderr=err_w,
                                        stderr_reader=err_r, timing=timing, stage0=stage0)
                on_failure.callback(sandbox.kill)
                popen, workspace = sandbox.started.popen, None
                config = bootstrap_config(policy, mode, root_flow=facts.is_root, bridge=sandbox.bridge,
                                          keep_below_tmp=sandbox.below_tmp)
                runner = server_command(str(facts.python_executable), to_kernel_r, from_kernel_w,
                                        encode_stage_two(stage_two(config, {})))
                try:
                    first_frame = encode_plan(plan_stage0(config, runner))
                except NativePlanError as exc:
                    raise SandboxError(f"cannot plan the kernel's native first stage: {exc}") from None
            elif mode is Isolation.SANDBOX:
                # The view covers _ctypes; the first stage gets it as this open file.
                ctypes_fd = os.open(ctypes_library(), os.O_RDONLY | os.O_CLOEXEC)
                child_side.callback(close_fd, ctypes_fd)
                sandbox = spawn_sandbox(policy, facts, command, keep_fds=[*child_ends, ctypes_fd], stdout=out_w,
                                        stderr=err_w, stderr_reader=err_r, timing=timing)
                on_failure.callback(sandbox.kill)
                popen, workspace = sandbox.started.popen, None
                config = bootstrap_config(policy, mode, root_flow=facts.is_root, bridge=sandbox.bridge, ctypes_fd=ctypes_fd,
                                          keep_below_tmp=sandbox.below_tmp)
            else:
                workspace = Path(tempfile.mkdtemp(prefix="sequester-workspace-"))
                on_failure.callback(shutil.rmtree, workspace, ignore_errors=True)
                config = _guard_config(policy, facts, mode, workspace)
                env = kernel_environment(os.environ, passthrough=policy.env, proxy=None, tmpdir=str(workspace))
                popen = subprocess.Popen(
                    command, cwd=workspace, env=env, pass_fds=child_ends, stdin=subprocess.DEVNULL,
                    stdout=out_w, stderr=err_w, start_new_session=True,
                )
                sandbox = None
        except OSError as exc:
            raise SandboxError(f"could not start the kernel: {exc}") from exc
        on_failure.pop_all()
    for fd in (to_kernel_w, from_kernel_r, out_r, err_r):
        os.set_inheritable(fd, False)
    timing["launched"] = time.monotonic_ns()
    return KernelProcess(mode, popen, to_kernel_w, from_kernel_r, out_r, err_r, config, sandbox, workspace, timing,
                         first_frame)


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


def spawn_sandbox(policy: Policy, facts: HostFacts, command: tuple[str, ...], *, keep_fds: list[int],
                  stdout: int, stderr: int, stderr_reader: int, kernel: bool = True,
                  timing: dict[str, int] | None = None, stage0: Path | None = None) -> SandboxProcess:
    """Spawn bwrap running ``command`` in the view of ``policy``; fail closed.

    ``keep_fds`` are passed to the command; ``stderr_reader`` is read for bwrap's own
    error message if it fails. ``kernel``: the command is a kernel's first stage, which
    gets the capabilities it needs to make its namespaces (and drops them); otherwise
    (:func:`run_in_sandbox`) it gets fewer: no SYS_ADMIN, no NET_ADMIN. ``stage0``: the
    native first stage's program, bound read-only at :data:`STAGE0_IN_VIEW`.
    """
    plan: NetworkPlan | None = plan_network(policy.allow) if policy.allow else None
    # Only the allowed names resolve: /etc/hosts is ours. No name server is reachable
    # from the empty network namespace, whatever /etc/resolv.conf says.
    data_files = {_HOSTS: plan.hosts_file if plan else _LOCALHOST_ONLY}
    with ExitStack() as on_failure, ExitStack() as temporary:
        pass_fds = list(keep_fds)
        broker: Broker | None = None
        bridge: dict[str, Any] | None = None
        if plan is not None:
            broker = Broker(policy.allow)
            on_failure.callback(broker.close)
            control_fd = broker.start().detach()
            temporary.callback(close_fd, control_fd)
            pass_fds.append(control_fd)
            bridge = {"control_fd": control_fd, "listeners": [
                [l.address, l.port, l.target.host if l.target else None, l.target.port if l.target else None]
                for l in plan.listeners]}
        mounts = plan_mounts(policy, facts, data_files=data_files)
        below_tmp = _below_tmp(mounts)
        if stage0 is not None:
            # Last, so below the view's /tmp tmpfs; not in below_tmp, so the kernel's own
            # /tmp covers it once the native stage has run.
            mounts += (MountOp(MountKind.READONLY, STAGE0_IN_VIEW, source=stage0),)
        spec = SandboxSpec(
            mounts=mounts,
            command=command,
            env=kernel_environment(os.environ, passthrough=policy.env, proxy=plan.env if plan else (), tmpdir="/tmp"),
            identity=Identity.NOBODY if facts.is_root else Identity.CALLER,
            caps=_caps(facts.is_root, kernel),
            # The command is the namespace's only process. Attack (red team): with bwrap's
            # own init as pid 1 (same uid, no seccomp filter, in bwrap's mount namespace
            # with its writable, exec-capable /tmp), an ordinary caller's cell could write
            # /proc/1/mem and run code outside the filter, or load a library from
            # /proc/1/root/tmp.
            as_pid_1=True,
        )
        if timing is not None:
            timing["planned"] = time.monotonic_ns()
        started = start_bwrap(spec, data_files=data_files, keep_fds=pass_fds, stdout=stdout, stderr=stderr,
                              stderr_reader=stderr_reader, timing=timing)
        on_failure.pop_all()
    return SandboxProcess(started, broker, bridge, below_tmp)


def _below_tmp(mounts: tuple[MountOp, ...]) -> tuple[Path, ...]:
    tmp = Path("/tmp")
    binds = [op.dest for op in mounts if op.kind is MountKind.READONLY and op.dest.is_relative_to(tmp) and op.dest != tmp]
    return tuple(b for b in binds if not any(b != o and b.is_relative_to(o) for o in binds))


def _caps(root: bool, kernel: bool) -> tuple[str, ...]:
    caps = ROOT_BOOTSTRAP_CAPS if root else BOOTSTRAP_CAPS
    return caps if kernel else tuple(c for c in caps if c not in _NAMESPACE_CAPS)


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
    connects = [[e.host if e.host != "localhost" else "127.0.0.1", e.port] for e in policy.allow if e.is_ip or e.host == "localhost"]
    names = [e.host for e in policy.allow if not e.is_ip]
    return bootstrap_config(policy, mode, landlock_spec=spec, audit_network={"names": names, "connects": connects})


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
        sandbox = spawn_sandbox(policy, gather_host_facts(scan_ffi=True, extra_roots=tuple(policy.readonly)),
                                tuple(command), keep_fds=[], stdout=out_w, stderr=err_w, stderr_reader=err_r,
                                kernel=False)
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
