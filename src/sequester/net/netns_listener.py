"""A listening socket inside a sandbox's network namespace, served by the host.

A socket belongs to the network namespace it was created in, whoever holds it later. So a
short-lived child joins the sandbox's namespaces, creates, binds and listens, and hands
the socket back over a socketpair (``SCM_RIGHTS``); the host then accepts connections
that programs in the sandbox make to ``127.0.0.1:PORT``, while its own connections out
are made in the host's namespace. The sandbox gets no file descriptor and no route.

Which namespace: the one ``/proc/PID/ns/net`` names. To join it as an ordinary user, the
child first joins the user namespace that *owns* it (``NS_GET_USERNS``: where bwrap's
user namespace holds every capability for its creator), not ``/proc/PID/ns/user``, which
under ``--disable-userns`` is a nested namespace without rights over the network. Root
needs no user namespace, but joining one it made is harmless. ``setns(CLONE_NEWUSER)``
needs a single-threaded caller: hence ``fork()`` (only the forking thread survives), and
in the child only system calls, no locks, then ``os._exit``.

Pid reuse: ``/proc/PID`` might name another process if the sandbox died and its pid was
recycled. Guards, strongest first: ``net_namespace`` (the inode bwrap's ``--info-fd``
reports) must match the namespace opened; a ``pidfd`` (from ``pidfd_open`` at start)
must still be alive after the namespace files were opened, so they were the sandbox's;
without either, a pidfd is opened here, which only narrows the window to the time
between the caller learning the pid and this call.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import signal
import socket
import time

from sequester.errors import SandboxError
from sequester.sandbox.readiness import readable

__all__ = ["open_listener_in"]

_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
_NS_GET_USERNS = 0xB701
_libc = ctypes.CDLL(None, use_errno=True)


def open_listener_in(
    pid: int,
    port: int = 3128,
    *,
    pidfd: int | None = None,
    net_namespace: int | None = None,
    address: str = "127.0.0.1",
    backlog: int = 128,
    timeout: float = 10.0,
) -> socket.socket:
    """A TCP socket listening on ``address:port`` in the network namespace of ``pid``
    (close-on-exec, blocking). :class:`SandboxError` if that cannot be done."""
    if not 0 <= port <= 65535:
        raise SandboxError(f"cannot listen in the sandbox: port {port} is not in 0..65535")
    fds: list[int] = []
    try:
        try:
            if pidfd is None:
                pidfd = os.pidfd_open(pid)
                fds.append(pidfd)
            net = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            fds.append(net)
        except OSError as exc:
            raise SandboxError(
                f"cannot open the network namespace of process {pid}: {exc.strerror} (has the sandbox exited?)"
            ) from None
        if net_namespace is not None and os.fstat(net).st_ino != net_namespace:
            raise SandboxError(
                f"process {pid} is not in the sandbox's network namespace "
                f"(net:[{os.fstat(net).st_ino}], not net:[{net_namespace}]): its pid was reused?"
            )
        user = _owner(net)
        if user is not None:
            fds.append(user)
        if readable(pidfd, 0):  # the process exited
            raise SandboxError(f"process {pid} exited before its network namespace could be joined")
        if os.fstat(net).st_ino == os.stat("/proc/self/ns/net").st_ino:
            raise SandboxError(f"process {pid} shares this process's network namespace: not a sandbox")
        return _listen_in(pid, net, user, address, port, backlog, timeout)
    finally:
        for fd in fds:
            os.close(fd)


def _owner(net: int) -> int | None:
    """The user namespace that owns the network namespace ``net``, or None if it is ours."""
    try:
        user = fcntl.ioctl(net, _NS_GET_USERNS)
    except OSError as exc:
        if exc.errno == errno.EPERM:  # owned by a namespace outside ours: the host's own, for root
            return None
        raise SandboxError(f"cannot find the owner of the sandbox's network namespace: {exc.strerror}") from None
    if os.fstat(user).st_ino == os.stat("/proc/self/ns/user").st_ino:
        os.close(user)
        return None
    return user


def _listen_in(
    pid: int, net: int, user: int | None, address: str, port: int, backlog: int, timeout: float
) -> socket.socket:
    parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with parent_end:
        child = os.fork()
        if child == 0:  # pragma: no cover - the child reports through the socketpair
            _child(child_end, net, user, address, port, backlog)
        child_end.close()
        try:
            parent_end.settimeout(timeout)
            try:
                message, fds, _, _ = socket.recv_fds(parent_end, 4096, 1, socket.MSG_CMSG_CLOEXEC)
            except (TimeoutError, OSError) as exc:
                raise SandboxError(
                    f"the helper that joins process {pid}'s network namespace did not answer: {exc or 'timed out'}"
                ) from None
        finally:
            _reap(child)
    if message[:1] != b"+" or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        said = message[1:].decode(errors="replace") or "it exited without a word"
        raise SandboxError(f"cannot listen on {address}:{port} in the network namespace of process {pid}: {said}")
    return socket.socket(fileno=fds[0])


def _child(
    channel: socket.socket, net: int, user: int | None, address: str, port: int, backlog: int
) -> None:  # pragma: no cover - runs in the forked child
    code = 1
    try:
        try:
            if user is not None and _libc.setns(user, _CLONE_NEWUSER) != 0:
                raise _Failed("setns(user)")
            if _libc.setns(net, _CLONE_NEWNET) != 0:
                raise _Failed("setns(net)")
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            listener = socket.socket(family, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((address, port))
            listener.listen(backlog)
            socket.send_fds(channel, [b"+"], [listener.fileno()])
            code = 0
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
            why = f"{exc}" if isinstance(exc, _Failed) else f"{type(exc).__name__}: {exc}"
            try:
                channel.sendall(b"-" + why.encode(errors="replace")[:4000])
            except BaseException:  # noqa: BLE001
                pass
    finally:
        os._exit(code)


class _Failed(OSError):
    def __init__(self, what: str):
        err = ctypes.get_errno()
        super().__init__(err, f"{what}: {os.strerror(err)}")

    def __str__(self) -> str:
        hint = " (is the sandbox this user's?)" if self.errno == errno.EPERM else ""
        return f"{self.strerror}{hint}"


def _reap(child: int) -> None:
    """Wait for the child (it exits right after answering); kill it if it does not."""
    deadline = time.monotonic() + 2
    while True:
        try:
            done, _ = os.waitpid(child, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        if time.monotonic() > deadline:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
            return
        time.sleep(0.002)
