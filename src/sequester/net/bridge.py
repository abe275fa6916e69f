"""The sandbox side of the network: loopback listeners that relay to the host's broker.

Runs inside the kernel process, in one thread started before the seccomp filter is
loaded (standard library only). It decides nothing: every connection it accepts goes to
the host over a channel obtained on the control socket, and the broker says yes or no.
A program that tampers with the bridge only loses its own network.
"""

from __future__ import annotations

import selectors
import socket
import threading
from collections.abc import Sequence

__all__ = ["start_bridge"]

_CHUNK = 65536


class _Pipe:
    """One direction of a relayed connection: bytes read from ``src`` wait here for ``dst``."""

    __slots__ = ("src", "dst", "buffer", "eof")

    def __init__(self, src: socket.socket, dst: socket.socket):
        self.src, self.dst = src, dst
        self.buffer = b""
        self.eof = False


class _Bridge:
    def __init__(self, control: socket.socket, listeners: Sequence[tuple[str, int, str | None, int | None]]):
        self.control = control
        self.selector = selectors.DefaultSelector()
        self.pipes: dict[socket.socket, list[_Pipe]] = {}
        for address, port, host, target_port in listeners:
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((address, port))
            sock.listen(128)
            sock.setblocking(False)
            header = None if host is None else f"DIRECT {host} {target_port}\r\n".encode()
            self.selector.register(sock, selectors.EVENT_READ, ("listen", header))

    def _channel(self) -> socket.socket | None:
        """Ask the broker for a fresh channel to the host."""
        try:
            self.control.sendall(b"+")
            _, fds, _, _ = socket.recv_fds(self.control, 1, 1)
        except OSError:
            return None
        return socket.socket(fileno=fds[0]) if fds else None

    def _accept(self, listener: socket.socket, header: bytes | None) -> None:
        try:
            client, _ = listener.accept()
        except OSError:
            return
        channel = self._channel()
        if channel is None:
            client.close()
            return
        if header is not None:
            channel.sendall(header)
        client.setblocking(False)
        channel.setblocking(False)
        up, down = _Pipe(client, channel), _Pipe(channel, client)
        self.pipes[client] = [up, down]
        self.pipes[channel] = [up, down]
        self._update(client)
        self._update(channel)

    def _update(self, sock: socket.socket) -> None:
        """Watch ``sock`` for what its pipes need now: reading if there is room, writing if bytes wait."""
        events = 0
        for pipe in self.pipes.get(sock, ()):
            if pipe.src is sock and not pipe.eof and not pipe.buffer:
                events |= selectors.EVENT_READ
            if pipe.dst is sock and pipe.buffer:
                events |= selectors.EVENT_WRITE
        key = self.selector.get_map().get(sock)
        if events and key is None:
            self.selector.register(sock, events, ("relay", None))
        elif events and key is not None and key.events != events:
            self.selector.modify(sock, events, ("relay", None))
        elif not events and key is not None:
            self.selector.unregister(sock)

    def _relay(self, sock: socket.socket, mask: int) -> None:
        pipes = self.pipes.get(sock)
        if not pipes:
            return
        for pipe in pipes:
            if mask & selectors.EVENT_READ and pipe.src is sock and not pipe.buffer and not pipe.eof:
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
            if mask & selectors.EVENT_WRITE and pipe.dst is sock and pipe.buffer:
                try:
                    sent = sock.send(pipe.buffer)
                    pipe.buffer = pipe.buffer[sent:]
                except BlockingIOError:
                    pass
                except OSError:
                    pipe.buffer, pipe.eof = b"", True
            if pipe.eof and not pipe.buffer:
                try:
                    pipe.dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
        a, b = pipes[0].src, pipes[0].dst
        if all(p.eof and not p.buffer for p in pipes):
            for s in (a, b):
                if s in self.selector.get_map():
                    self.selector.unregister(s)
                self.pipes.pop(s, None)
                s.close()
            return
        self._update(a)
        self._update(b)

    def run(self) -> None:
        while True:
            for key, mask in self.selector.select():
                kind, header = key.data
                if kind == "listen":
                    self._accept(key.fileobj, header)  # type: ignore[arg-type]
                else:
                    self._relay(key.fileobj, mask)  # type: ignore[arg-type]


def start_bridge(control_fd: int, listeners: Sequence[tuple[str, int, str | None, int | None]]) -> threading.Thread:
    """Bind the listeners now (so a failure is reported at start) and relay in a daemon thread.

    ``listeners`` are ``(address, port, target_host, target_port)``; a ``None`` target
    marks the proxy listener.
    """
    control = socket.socket(fileno=control_fd)
    control.setblocking(True)
    bridge = _Bridge(control, listeners)
    thread = threading.Thread(target=bridge.run, name="sequester-bridge", daemon=True)
    thread.start()
    return thread
