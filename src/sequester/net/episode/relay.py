"""The operator's loopback ``HOST:PORT`` entries (``localhost:8080``: a model mock, a
local package mirror), reached from inside an episode: a listening socket on the agent's
own loopback at that port (made by the namespace helper), served by the host process,
which joins each connection to the same port of the host's loopback. Nothing else of the
host's loopback is reachable (the router never forwards loopback, and the stack's gateway
does not lead there).

Only in the agent's phase: while the verifier runs, a connection is accepted and closed
at once (the sockets keep listening, so no agent process can take their ports) and open
connections are cut. At most :data:`MAX_CONNECTIONS` at a time; the record counts
connections and bytes each way.
"""

from __future__ import annotations

import collections
import logging
import os
import selectors
import socket
import threading
from typing import Any

__all__ = ["LoopbackRelay", "MAX_CONNECTIONS"]

log = logging.getLogger("sequester.net.episode")

MAX_CONNECTIONS = 64
_CHUNK = 1 << 16


class LoopbackRelay:
    """Serves ``listeners`` (each ``(socket, target address, port)``) until :meth:`close`."""

    def __init__(self, listeners: list[tuple[socket.socket, str, int]]):
        self.listeners = listeners
        self.agent_phase = True
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._wake_r, self._wake_w = os.pipe()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._applied = threading.Event()
        self.counts: collections.Counter[str] = collections.Counter()

    def start(self) -> LoopbackRelay:
        if self.listeners:
            self._thread = threading.Thread(target=self._serve, name="sequester-relay", daemon=True)
            self._thread.start()
        return self

    def set_agent_phase(self, on: bool) -> None:
        """Off: open connections are cut, and new ones are closed as soon as they are
        accepted; on: they are joined to the host's port again."""
        self.agent_phase = on
        if not on:
            self._cut_all()
        if self._thread is not None and self._thread.is_alive():
            self._applied.clear()
            try:
                os.write(self._wake_w, b"p")
            except OSError:
                return
            self._applied.wait(5)  # the listeners are as the phase says before the caller goes on

    def _cut_all(self) -> None:
        with self._lock:
            for sock in self._open:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._cut_all()
        for sock, _, _ in self.listeners:
            sock.close()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    def _serve(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._wake_r, selectors.EVENT_READ, None)
            # The sockets listen in both phases: in the verifier's, a connection is accepted
            # and closed at once. (Red team: a listening socket shut down for that phase kept
            # its port, an agent process bound it with SO_REUSEADDR and served the verifier
            # its own answers, and the relay could not listen there again.)
            for sock, address, port in self.listeners:
                sock.listen(MAX_CONNECTIONS)
                sock.setblocking(False)
                sel.register(sock, selectors.EVENT_READ, (address, port))
            while not self._closed:
                self._applied.set()
                for key, _ in sel.select():
                    if key.data is None:
                        if os.read(self._wake_r, 64).endswith(b"x"):
                            return
                        continue
                    try:
                        conn, _ = key.fileobj.accept()  # type: ignore[union-attr]
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        if self._closed:
                            return
                        continue
                    if not self.agent_phase or not self._slots.acquire(blocking=False):
                        self._count("refused")
                        conn.close()
                        continue
                    threading.Thread(
                        target=self._join, args=(conn, *key.data), name="sequester-relay-conn", daemon=True
                    ).start()

    def _join(self, inside: socket.socket, address: str, port: int) -> None:
        outside = None
        try:
            inside.setblocking(True)
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            outside = socket.socket(family, socket.SOCK_STREAM)
            outside.settimeout(10)
            try:
                outside.connect((address, port))
            except OSError:
                self._count("failed")
                return
            outside.settimeout(None)
            with self._lock:
                if self._closed or not self.agent_phase:
                    return
                self._open.update((inside, outside))
            self._count("connections")
            pump = threading.Thread(target=self._pump, args=(outside, inside, "bytes_in"), daemon=True)
            pump.start()
            self._pump(inside, outside, "bytes_out")
            pump.join()
        finally:
            with self._lock:
                self._open.discard(inside)
                if outside is not None:
                    self._open.discard(outside)
            for sock in (inside, outside):
                if sock is not None:
                    sock.close()
            self._slots.release()

    def _pump(self, source: socket.socket, sink: socket.socket, counter: str) -> None:
        try:
            while data := source.recv(_CHUNK):
                sink.sendall(data)
                self._count(counter, len(data))
        except OSError:
            pass
        finally:
            try:
                sink.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def _count(self, what: str, amount: int = 1) -> None:
        with self._lock:
            self.counts[what] += amount

    def record(self) -> dict[str, Any]:
        with self._lock:
            return {
                "listening": [f"{'[' + a + ']' if ':' in a else a}:{p}" for _, a, p in self.listeners],
                **{k: self.counts[k] for k in sorted(self.counts)},
            }
