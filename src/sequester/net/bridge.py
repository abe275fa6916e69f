"""The sandbox side of the network: loopback listeners that relay to the host's broker.

Runs inside the kernel process, in one thread started before the seccomp filter is
loaded. It decides nothing: every connection it accepts goes to the host over a channel
obtained on the control socket, and the broker says yes or no. A program that tampers
with the bridge only loses its own network.

Built on the C modules (``_socket``, ``select.epoll``, ``_thread``) rather than
``socket``/``selectors``/``threading``: those import ``enum``, ``collections.abc`` and
more, over 15 ms of the start of every kernel that has services.
"""

from __future__ import annotations

import _socket
import _thread
import select
import sys

TYPE_CHECKING = False  # not ``typing``: imported at the start of every kernel with services
if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Sequence

__all__ = ["start_bridge"]

_CHUNK = 65536
_IN, _OUT = select.EPOLLIN, select.EPOLLOUT
_FD_BYTES = 4  # one int in an SCM_RIGHTS message


class _Pipe:
    """One direction of a relayed connection: bytes read from ``src`` wait here for ``dst``."""

    __slots__ = ("src", "dst", "buffer", "eof")

    def __init__(self, src: _socket.socket, dst: _socket.socket):
        self.src, self.dst = src, dst
        self.buffer = b""
        self.eof = False


class _Bridge:
    def __init__(self, control: _socket.socket, listeners: Sequence[tuple[str, int, str | None, int | None]]):
        self.control = control
        self.poll = select.epoll()
        self.watched: dict[int, int] = {}  # fd -> the events it is registered for
        self.listeners: dict[int, tuple[_socket.socket, bytes | None]] = {}
        self.sockets: dict[int, _socket.socket] = {}
        self.pipes: dict[int, list[_Pipe]] = {}
        for address, port, host, target_port in listeners:
            family = _socket.AF_INET6 if ":" in address else _socket.AF_INET
            sock = _socket.socket(family, _socket.SOCK_STREAM)
            sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
            sock.bind((address, port))
            sock.listen(128)
            sock.setblocking(False)
            header = None if host is None else f"DIRECT {host} {target_port}\r\n".encode()
            self.listeners[sock.fileno()] = (sock, header)
            self.poll.register(sock.fileno(), _IN)

    def _channel(self) -> _socket.socket | None:
        """Ask the broker for a fresh channel to the host."""
        try:
            self.control.sendall(b"+")
            _, ancillary, _, _ = self.control.recvmsg(1, _socket.CMSG_SPACE(_FD_BYTES))
        except OSError:
            return None
        fds = [
            int.from_bytes(data[i : i + _FD_BYTES], sys.byteorder)
            for level, kind, data in ancillary
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS
            for i in range(0, len(data) - len(data) % _FD_BYTES, _FD_BYTES)
        ]
        for extra in fds[1:]:  # the broker sends one; never keep more
            _close_fd(extra)
        return _socket.socket(fileno=fds[0]) if fds else None

    def _accept(self, listener: _socket.socket, header: bytes | None) -> None:
        try:
            fd, _ = listener._accept()  # type: ignore[attr-defined]  # C method typeshed omits
        except OSError:
            return
        client = _socket.socket(listener.family, _socket.SOCK_STREAM, 0, fd)
        channel = self._channel()
        if channel is None:
            client.close()
            return
        if header is not None:
            try:
                channel.sendall(header)
            except OSError:
                client.close()
                channel.close()
                return
        client.setblocking(False)
        channel.setblocking(False)
        up, down = _Pipe(client, channel), _Pipe(channel, client)
        for sock in (client, channel):
            self.sockets[sock.fileno()] = sock
            self.pipes[sock.fileno()] = [up, down]
        self._update(client)
        self._update(channel)

    def _update(self, sock: _socket.socket) -> None:
        """Watch ``sock`` for what its pipes need now: reading if there is room, writing if bytes wait."""
        fd = sock.fileno()
        events = 0
        for pipe in self.pipes.get(fd, ()):
            if pipe.src is sock and not pipe.eof and not pipe.buffer:
                events |= _IN
            if pipe.dst is sock and pipe.buffer:
                events |= _OUT
        current = self.watched.get(fd)
        if events and current is None:
            self.poll.register(fd, events)
            self.watched[fd] = events
        elif events and current is not None and current != events:
            self.poll.modify(fd, events)
            self.watched[fd] = events
        elif not events and current is not None:
            self.poll.unregister(fd)
            del self.watched[fd]

    def _relay(self, fd: int, mask: int) -> None:
        pipes = self.pipes.get(fd)
        sock = self.sockets.get(fd)
        if not pipes or sock is None:
            return
        # As selectors reads epoll: a hang-up or error counts as both (so the pipe sees it).
        readable, writable = mask & ~_OUT, mask & ~_IN
        for pipe in pipes:
            if readable and pipe.src is sock and not pipe.buffer and not pipe.eof:
                try:
                    data = sock.recv(_CHUNK)
                except BlockingIOError:
                    data = None
                except OSError:
                    data = b""
                if data == b"":
                    pipe.eof = True
                elif data:
                    pipe.buffer = data
            if writable and pipe.dst is sock and pipe.buffer:
                try:
                    sent = sock.send(pipe.buffer)
                    pipe.buffer = pipe.buffer[sent:]
                except BlockingIOError:
                    pass
                except OSError:
                    pipe.buffer, pipe.eof = b"", True
            if pipe.eof and not pipe.buffer:
                try:
                    pipe.dst.shutdown(_socket.SHUT_WR)
                except OSError:
                    pass
        a, b = pipes[0].src, pipes[0].dst
        if all(p.eof and not p.buffer for p in pipes):
            for s in (a, b):
                number = s.fileno()
                if self.watched.pop(number, None) is not None:
                    self.poll.unregister(number)
                self.pipes.pop(number, None)
                self.sockets.pop(number, None)
                s.close()
            return
        self._update(a)
        self._update(b)

    def run(self) -> None:
        while True:
            for fd, mask in self.poll.poll():
                listening = self.listeners.get(fd)
                if listening is not None:
                    self._accept(*listening)
                else:
                    self._relay(fd, mask)


def _close_fd(fd: int) -> None:
    import os

    try:
        os.close(fd)
    except OSError:
        pass


def start_bridge(control_fd: int, listeners: Sequence[tuple[str, int, str | None, int | None]]) -> int:
    """Bind the listeners now (so a failure is reported at start) and relay in a daemon
    thread (``_thread``'s threads are daemons: they never hold the process up).

    ``listeners`` are ``(address, port, target_host, target_port)``; a ``None`` target
    marks the proxy listener. Returns the thread's identifier.
    """
    control = _socket.socket(fileno=control_fd)
    control.setblocking(True)
    bridge = _Bridge(control, listeners)
    return _thread.start_new_thread(bridge.run, ())
