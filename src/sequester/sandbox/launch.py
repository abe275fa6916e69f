"""Start a kernel process under a policy: the one place that orders the steps.

``sandbox``: plan the network (broker on the host, bridge listeners inside), plan the
mounts, build bwrap's argv, spawn it, write the uid map (root flow), then hand the
kernel its bootstrap configuration. ``guard``: a plain child process that confines
itself (Landlock + seccomp + audit hook) in a fresh workspace. ``off``: a plain child.

Whatever fails on the way, everything started so far is stopped before the error
propagates (fail closed).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import SandboxError
from ..guard import landlock, seccomp
from ..guard.privileges import NOBODY
from ..net.broker import Broker
from ..net.plan import NetworkPlan, plan_network
from ..policy import Isolation, Policy
from .argv import LaunchFds, SandboxSpec, build_argv
from .environment import kernel_environment
from .host import HostFacts, gather_host_facts
from .mounts import WORKSPACE, hidden_paths, mount_backs, plan_mounts
from .probe import bwrap_path, resolve_isolation

__all__ = ["KernelProcess", "launch_kernel", "kernel_command", "bootstrap_config"]

# Root-only files a guard-only kernel running as uid 0 must not read (Landlock grants
# everything else of /etc).
ROOT_SECRETS = tuple(Path(p) for p in ("/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-",
                                        "/etc/sudoers", "/etc/sudoers.d", "/etc/ssh", "/etc/ssl/private"))
_UID_MAP = f"0 0 1\n{NOBODY} {NOBODY} 1\n"
_NO_DNS = "# sequester: no name server is reachable from the sandbox; names resolve from /etc/hosts only\n"


@dataclass
class KernelProcess:
    """A started kernel: its process, the host's ends of its pipes, and what to clean up."""

    mode: Isolation
    popen: subprocess.Popen[bytes]
    to_kernel: int
    from_kernel: int
    stdout: int
    stderr: int
    config: dict[str, Any]
    broker: Broker | None = None
    workspace: Path | None = None
    sandbox_pid: int | None = None
    _closed: bool = field(default=False, repr=False)

    def host_pids(self) -> list[int]:
        """Host pids of the bwrap monitor, the sandbox's init and the processes under it."""
        pids = [self.popen.pid]
        if self.sandbox_pid is not None:
            pids.append(self.sandbox_pid)
            pids += _descendants(self.sandbox_pid)
        return pids

    def terminate(self) -> None:
        """Kill everything of this kernel and release its resources. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            # The whole session: in the sandbox, bwrap's --die-with-parent and the PID
            # namespace take the rest down with it.
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.popen.kill()
        except ProcessLookupError:
            pass
        self.popen.wait()
        for fd in (self.to_kernel, self.from_kernel, self.stdout, self.stderr):
            _close(fd)
        if self.broker is not None:
            self.broker.close()
        if self.workspace is not None:
            shutil.rmtree(self.workspace, ignore_errors=True)


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                children = [int(c) for c in f.read().split()]
        except OSError:
            continue
        for child in children:
            out.append(child)
            out += _descendants(child)
    return out


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def kernel_command(facts: HostFacts, in_fd: int, out_fd: int) -> tuple[str, ...]:
    # -s: no user site; -B: no .pyc writes; -P: never put the (writable) cwd on sys.path.
    return (str(facts.python_executable), "-s", "-B", "-P", "-m", "sequester.kernel.server", str(in_fd), str(out_fd))


def bootstrap_config(policy: Policy, mode: Isolation, *, root_flow: bool = False,
                     bridge: dict[str, Any] | None = None, landlock_spec: dict[str, Any] | None = None,
                     audit_network: dict[str, Any] | None = None) -> dict[str, Any]:
    """The first message a kernel reads: what its bootstrap must do."""
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
    config["seccomp"] = {"bpf": base64.b64encode(seccomp.compile_filter()).decode(), "nr": seccomp.syscall_number("seccomp")}
    if root_flow:
        config.update(root_flow=True, drop_to_uid=NOBODY, chown=[str(WORKSPACE)])
    if bridge:
        config["bridge"] = bridge
    if landlock_spec:
        config["landlock"] = landlock_spec
    if audit_network:
        config["audit_network"] = audit_network
    return config


def _data_fd(text: str) -> int:
    fd = os.memfd_create("sequester-data", 0)
    os.write(fd, text.encode())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _read_all(fd: int, timeout: float) -> bytes:
    deadline = time.monotonic() + timeout
    data = b""
    import select

    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise SandboxError("bwrap did not report its sandbox in time")
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return data
        data += chunk


def _write_id_maps(pid: int) -> None:
    """Root flow: map root (for bwrap's setup) and nobody (for the kernel) to themselves."""
    # setgroups stays allowed: the kernel's bootstrap clears root's supplementary groups.
    for name, text in (("uid_map", _UID_MAP), ("gid_map", _UID_MAP)):
        with open(f"/proc/{pid}/{name}", "w") as f:
            f.write(text)


def launch_kernel(policy: Policy, *, facts: HostFacts | None = None) -> KernelProcess:
    """Start a kernel for ``policy``. The kernel still has to be sent its configuration
    (``KernelProcess.config``) and answer ``ready``; :class:`sequester.Kernel` does that."""
    mode = resolve_isolation(policy.isolation)
    facts = facts or gather_host_facts()
    to_kernel_r, to_kernel_w = os.pipe()
    from_kernel_r, from_kernel_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    child_ends = [to_kernel_r, from_kernel_w, out_w, err_w]
    host_ends = [to_kernel_w, from_kernel_r, out_r, err_r]
    for fd in host_ends:
        os.set_inheritable(fd, False)
    command = kernel_command(facts, to_kernel_r, from_kernel_w)
    extra: list[int] = []
    broker: Broker | None = None
    workspace: Path | None = None
    try:
        if mode is Isolation.SANDBOX:
            popen, broker, sandbox_pid, config = _spawn_sandbox(policy, facts, command, child_ends, out_w, err_w, err_r, extra)
        else:
            workspace = Path(tempfile.mkdtemp(prefix="sequester-workspace-"))
            config = _guard_config(policy, facts, mode, workspace)
            env = kernel_environment(os.environ, passthrough=policy.env, proxy=None, tmpdir=str(workspace))
            popen = subprocess.Popen(
                command, cwd=workspace, env=env, pass_fds=child_ends, stdin=subprocess.DEVNULL,
                stdout=out_w, stderr=err_w, start_new_session=True,
            )
            sandbox_pid = None
    except BaseException as exc:
        for fd in (*host_ends, *child_ends, *extra):
            _close(fd)
        if broker is not None:
            broker.close()
        if workspace is not None:
            shutil.rmtree(workspace, ignore_errors=True)
        if isinstance(exc, SandboxError):
            raise
        if isinstance(exc, OSError):
            raise SandboxError(f"could not start the kernel: {exc}") from exc
        raise
    for fd in (*child_ends, *extra):
        _close(fd)
    return KernelProcess(mode, popen, to_kernel_w, from_kernel_r, out_r, err_r, config, broker, workspace, sandbox_pid)


def _spawn_sandbox(policy: Policy, facts: HostFacts, command: tuple[str, ...], child_ends: list[int],
                   out_w: int, err_w: int, err_r: int, extra: list[int]) -> tuple[subprocess.Popen[bytes], Broker | None, int, dict[str, Any]]:
    """Spawn bwrap; ``extra`` collects descriptors the caller must close."""
    plan: NetworkPlan | None = plan_network(policy.allow) if policy.allow else None
    hosts = Path("/etc/hosts").resolve()
    resolv = Path("/etc/resolv.conf").resolve()
    data_files = {hosts: plan.hosts_file if plan else "127.0.0.1 localhost\n::1 localhost\n", resolv: _NO_DNS}
    broker: Broker | None = None
    bridge: dict[str, Any] | None = None
    pass_fds = list(child_ends)
    popen: subprocess.Popen[bytes] | None = None
    try:
        if plan is not None:
            broker = Broker(policy.allow)
            control = broker.start()
            control_fd = control.detach()
            extra.append(control_fd)
            pass_fds.append(control_fd)
            bridge = {
                "control_fd": control_fd,
                "listeners": [
                    [l.address, l.port, l.target.host if l.target else None, l.target.port if l.target else None]
                    for l in plan.listeners
                ],
            }
        data_fds = {path: _data_fd(text) for path, text in data_files.items()}
        extra += data_fds.values()
        info_r, info_w = os.pipe()
        block_r, block_w = os.pipe()
        extra += [info_r, info_w, block_r, block_w]
        pass_fds += [*data_fds.values(), info_w, *([block_r] if facts.is_root else [])]
        spec = SandboxSpec(
            mounts=plan_mounts(policy, facts, data_files=data_files),
            command=command,
            env=kernel_environment(os.environ, passthrough=policy.env, proxy=plan.env if plan else (), tmpdir="/tmp"),
            root_flow=facts.is_root,
        )
        fds = LaunchFds(data=data_fds, info=info_w, userns_block=block_r if facts.is_root else None)
        argv = build_argv(bwrap_path(), spec, fds)
        popen = subprocess.Popen(
            argv, env=dict(spec.env), pass_fds=pass_fds, stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w,
            start_new_session=True,
        )
        _close(info_w)
        _close(block_r)
        try:
            info = json.loads(_read_all(info_r, 30) or b"null")
        except ValueError:
            info = None
        if not isinstance(info, dict) or not isinstance(info.get("child-pid"), int):
            popen.kill()
            popen.wait()
            raise SandboxError(f"bwrap failed to create the sandbox: {_pending_text(err_r) or 'no message'}")
        sandbox_pid = info["child-pid"]
        if facts.is_root:
            _write_id_maps(sandbox_pid)
            os.write(block_w, b"1")
        config = bootstrap_config(policy, Isolation.SANDBOX, root_flow=facts.is_root, bridge=bridge)
        return popen, broker, sandbox_pid, config
    except BaseException:
        if popen is not None and popen.poll() is None:
            popen.kill()
            popen.wait()
        if broker is not None:
            broker.close()
        raise


def _pending_text(fd: int) -> str:
    """What is waiting in a pipe right now (a dead child's last words), without blocking."""
    os.set_blocking(fd, False)
    chunks = []
    try:
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    except BlockingIOError:
        pass
    finally:
        os.set_blocking(fd, True)
    return b"".join(chunks).decode(errors="replace").strip()


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
    read = [*landlock.readable_roots(top, hidden), *mount_backs(policy, facts)]
    spec = {
        "read": [str(p) for p in dict.fromkeys(read)],
        "write": [str(workspace), "/dev/null"],
        "connect_ports": sorted({e.port for e in policy.allow}),
    }
    connects = [[e.host if e.host != "localhost" else "127.0.0.1", e.port] for e in policy.allow if e.is_ip or e.host == "localhost"]
    names = [e.host for e in policy.allow if not e.is_ip]
    return bootstrap_config(policy, mode, landlock_spec=spec, audit_network={"names": names, "connects": connects})


def run_in_sandbox(policy: Policy, command: list[str], *, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``command`` in the view a kernel of ``policy`` gets, without the kernel.

    For benchmarks and tests of the namespace and mount layer alone: the command gets
    no seccomp filter, and in the root flow it keeps the bootstrap capabilities (the
    kernel drops those itself). Never a way to run untrusted code.
    """
    facts = gather_host_facts()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    extra: list[int] = []
    try:
        popen, broker, _, _ = _spawn_sandbox(policy, facts, tuple(command), [], out_w, err_w, err_r, extra)
    finally:
        for fd in (out_w, err_w, *extra):
            _close(fd)
    try:
        with os.fdopen(out_r, "rb") as out, os.fdopen(err_r, "rb") as err:
            stdout, stderr = out.read(), err.read()
        code = popen.wait(timeout=timeout)
    finally:
        if popen.poll() is None:
            popen.kill()
            popen.wait()
        if broker is not None:
            broker.close()
    return subprocess.CompletedProcess(command, code, stdout.decode(errors="replace"), stderr.decode(errors="replace"))
