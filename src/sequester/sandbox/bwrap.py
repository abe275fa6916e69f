"""Start bwrap for a :class:`~.argv.SandboxSpec` and learn its sandbox's pid: kernels and
episodes alike.

bwrap reports the pid of the sandbox's init on an info pipe; we keep a pidfd on it (a pid
could be recycled, a pidfd cannot). For the ``NOBODY`` identity, bwrap then waits until
we have written the uid map that also maps ``nobody``. A held sandbox
(``SandboxSpec.hold``) is returned only once its view is complete. Any failure kills
what started.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from sequester.errors import SandboxError
from sequester.guard.privileges import KERNEL_HOST_ID, NOBODY
from sequester.sandbox.argv import Identity, LaunchFds, SandboxSpec, build_argv
from sequester.sandbox.hostlimits import explain
from sequester.sandbox.idmap import write_id_map
from sequester.sandbox.probe import bwrap_path
from sequester.sandbox.readiness import readable

__all__ = ["StartedBwrap", "start_bwrap", "close_fd", "read_pending"]

# Inside, a root caller's kernel drops to nobody; on the host that id is KERNEL_HOST_ID,
# which no host process has. Attack (red team): mapped to the host's own nobody, every
# root caller's kernel could be signalled (stopped, killed) by any host process running
# as nobody (daemons, NFS-squashed users, other sandboxes).
_ID_MAP = f"0 0 1\n{NOBODY} {KERNEL_HOST_ID} 1\n"
_SYS_READ = {"x86_64": 0, "aarch64": 63}  # read(2)'s number, as /proc/PID/syscall shows it


@dataclass
class StartedBwrap:
    popen: subprocess.Popen[bytes]
    pid: int  # the sandbox's init, in the host's PID namespace
    pidfd: int
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _reaped: bool = field(default=False, repr=False)
    hold_fd: int | None = None  # write end of --block-fd (SandboxSpec.hold): release() lets the command run
    net_namespace: int | None = None  # the sandbox's network namespace inode, as bwrap reported it

    def release(self) -> None:
        """Let a held command (``SandboxSpec.hold``) start; nothing if it was not held."""
        fd, self.hold_fd = self.hold_fd, None
        if fd is not None:
            try:
                os.write(fd, b"1")
            finally:
                close_fd(fd)

    def signal_init(self) -> None:
        """SIGKILL the sandbox's init, from any thread; nothing if it is already gone."""
        with self._lock:
            if not self._reaped:
                try:
                    signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def kill(self) -> None:
        """Kill the sandbox's init (its whole PID namespace goes with it); bwrap reaps it
        and exits. bwrap itself is killed only if it does not."""
        self.signal_init()
        try:
            bwrap_fd = os.pidfd_open(self.popen.pid)
        except ProcessLookupError:
            bwrap_fd = None
        if bwrap_fd is not None:
            exited = readable(bwrap_fd, 5.0)  # a timed wait() would poll
            close_fd(bwrap_fd)
            if not exited:
                self.popen.kill()
        self.popen.wait()
        with self._lock:
            if not self._reaped:
                self._reaped = True
                close_fd(self.pidfd)


def close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def start_bwrap(
    spec: SandboxSpec,
    *,
    data_files: dict[Path, str],
    keep_fds: list[int],
    stdout: int | None,
    stderr: int | None,
    stderr_reader: int | None,
    timing: dict[str, int] | None = None,
) -> StartedBwrap:
    """Run bwrap for ``spec``; ``stderr_reader`` is read for bwrap's own message on failure.
    ``timing`` gets the ``time.monotonic_ns()`` of its steps (``spawned``, ``sandbox``)."""
    with ExitStack() as on_failure, ExitStack() as temporary:

        def temp(fd: int) -> int:
            temporary.callback(close_fd, fd)
            return fd

        data_fds = {path: temp(_data_fd(text)) for path, text in data_files.items()}
        info_r, info_w = os.pipe()
        temp(info_r)
        info_w_open = [info_w]  # closed early (below), or at the end if Popen fails

        def close_info_w() -> None:
            for fd in info_w_open:
                close_fd(fd)

        temporary.callback(close_info_w)
        needs_map = spec.identity is Identity.NOBODY or (spec.identity is Identity.ROOT and spec.id_map is not None)
        block_r, block_w = (temp(fd) for fd in os.pipe())
        seccomp_fd = temp(_data_fd(spec.seccomp)) if spec.seccomp is not None else None
        hold_r, hold_w = os.pipe() if spec.hold else (None, None)
        if hold_r is not None:
            assert hold_w is not None  # made with hold_r, by the same os.pipe()
            temp(hold_r)
            on_failure.callback(close_fd, hold_w)
        fds = LaunchFds(
            data=data_fds, info=info_w, userns_block=block_r if needs_map else None, seccomp=seccomp_fd, hold=hold_r
        )
        pass_fds = [
            *keep_fds,
            *data_fds.values(),
            info_w,
            *([block_r] if needs_map else []),
            *([seccomp_fd] if seccomp_fd is not None else []),
            *([hold_r] if hold_r is not None else []),
        ]
        try:
            popen = subprocess.Popen(
                build_argv(bwrap_path(), spec, fds),
                env=dict(spec.env),
                pass_fds=pass_fds,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
            )
        except BlockingIOError as exc:  # EAGAIN: no process may be started (pid_max, pids.max, ...)
            raise SandboxError(explain(f"bwrap could not be started: {exc}")) from None

        def kill_bwrap() -> None:
            popen.kill()
            popen.wait()

        on_failure.callback(kill_bwrap)
        if timing is not None:
            timing["spawned"] = time.monotonic_ns()
        close_fd(info_w_open.pop())  # so that bwrap's exit ends our read
        try:
            info = json.loads(_read_all(info_r, 30) or b"null")
        except ValueError:
            info = None
        if not isinstance(info, dict) or not isinstance(info.get("child-pid"), int):
            popen.wait()
            said = read_pending(stderr_reader).decode(errors="replace").strip() if stderr_reader is not None else ""
            raise SandboxError(explain(f"bwrap failed to create the sandbox: {said or 'no message'}"))
        pid = info["child-pid"]
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:  # the sandbox failed right after it was made (a mount)
            popen.wait()
            said = read_pending(stderr_reader).decode(errors="replace").strip() if stderr_reader is not None else ""
            raise SandboxError(explain(f"bwrap failed to set up the sandbox: {said or 'no message'}")) from None
        on_failure.callback(close_fd, pidfd)
        if needs_map:
            if spec.id_map is not None:
                write_id_map(pid, spec.id_map)  # an episode's 65,536 ids (sandbox.idmap)
            else:
                for name in ("uid_map", "gid_map"):
                    # setgroups stays allowed: the kernel's bootstrap clears root's groups.
                    with open(f"/proc/{pid}/{name}", "w") as f:
                        f.write(_ID_MAP)
            os.write(block_w, b"1")
        if hold_r is not None:
            _wait_until_held(pid, pidfd, hold_r, popen, stderr_reader)
        if timing is not None:
            timing["sandbox"] = time.monotonic_ns()
        on_failure.pop_all()
    net_ns = info.get("net-namespace")
    return StartedBwrap(popen, pid, pidfd, hold_fd=hold_w, net_namespace=net_ns if isinstance(net_ns, int) else None)


def _wait_until_held(
    pid: int, pidfd: int, hold_fd: int, popen: subprocess.Popen[bytes], stderr_reader: int | None, timeout: float = 30
) -> None:
    """Return once bwrap's child is blocked reading ``hold_fd`` (its ``--block-fd``).

    Attack (CI, a root caller's ``ADD`` of a tar with ``proc/sys/...``): bwrap reports the
    child's pid as soon as it has cloned it, *before* the child builds the view. Host-side
    setup done then (hardening the view's ``/proc``) lands on the mounts the child is
    about to replace: the fresh ``/proc`` it mounts next stays writable by host uid 0.
    The child reads the block fd only after its last mount, its ``pivot_root`` and the
    drop of its privileges, so a child seen in that read has its final view. The kernel
    says which call a blocked process is in (``/proc/PID/syscall``: number and arguments);
    nothing the sandbox runs exists yet to fake it."""
    number = _SYS_READ.get(platform.machine())
    if number is None:
        raise SandboxError(f"holding a sandbox is not supported on {platform.machine()} (no read(2) number known)")
    deadline, pause = time.monotonic() + timeout, 0.0002
    while True:
        try:
            with open(f"/proc/{pid}/syscall") as f:
                fields = f.read().split()
        except PermissionError as exc:
            raise SandboxError(
                f"cannot see whether the sandbox is ready ({exc}): a held sandbox needs read access "
                "to its own child's /proc/PID/syscall (kernel.yama.ptrace_scope 0 or 1)"
            ) from None
        except OSError:
            fields = []  # the child is gone: found below
        if len(fields) >= 4 and fields[0] == str(number) and int(fields[1], 16) == hold_fd and int(fields[3], 16) == 1:
            return
        if readable(pidfd, 0):  # the child died building the view
            popen.wait()
            said = read_pending(stderr_reader).decode(errors="replace").strip() if stderr_reader is not None else ""
            raise SandboxError(f"bwrap failed to set up the sandbox: {said or 'no message'}")
        if time.monotonic() > deadline:
            raise SandboxError("bwrap did not finish building the sandbox in time")
        time.sleep(pause)
        pause = min(pause * 2, 0.005)


def _data_fd(text: str | bytes) -> int:
    fd = os.memfd_create("sequester-data", 0)
    os.write(fd, text.encode() if isinstance(text, str) else text)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _read_all(fd: int, timeout: float) -> bytes:
    deadline = time.monotonic() + timeout
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise SandboxError("bwrap did not report its sandbox in time")
        ready = readable(fd, left)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return data
        data += chunk


def read_pending(fd: int, limit: int | None = None) -> bytes:
    """What is already in a pipe, without waiting for more (a dead child's last words,
    output written before a message that says it is all there), at most ``limit`` bytes:
    a writer that keeps writing cannot keep the reader here, nor grow its buffer."""
    os.set_blocking(fd, False)
    chunks, size = [], 0
    try:
        while (limit is None or size < limit) and (
            chunk := os.read(fd, 65536 if limit is None else min(65536, limit - size))
        ):
            chunks.append(chunk)
            size += len(chunk)
    except OSError:  # BlockingIOError: nothing more for now
        pass
    finally:
        os.set_blocking(fd, True)
    return b"".join(chunks)
