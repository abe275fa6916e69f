"""The episode's DNS responder: sockets inside the router namespace (``10.0.2.3:53``, UDP
and TCP, made by the namespace helper), served by the host process.

Each question is judged (:class:`~sequester.net.episode.answers.Answers`), asked of the
host's own resolver (:class:`~sequester.net.episode.upstream.Upstream`, which the agent can
never reach itself), and its answer judged again: a refusal is ``REFUSED``, an answer that
grants addresses goes out only once the router lets them through (``grant``), a resolver
that fails is ``SERVFAIL``. Malformed messages are dropped.

Bounded: at most :data:`MAX_PENDING` questions in flight (more are dropped: resolvers ask
again), :data:`MAX_TCP` TCP connections at once, each closed after :data:`TCP_IDLE`
seconds without a question or :data:`TCP_QUERIES` questions; the record keeps counts, the
last :data:`KEPT_REFUSALS` refusals, and the names of at most :data:`KEPT_ADDRESSES`
addresses.
"""

from __future__ import annotations

import collections
import logging
import os
import selectors
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sequester.net.episode.answers import Answers
from sequester.net.episode.dns import SERVFAIL, DnsError, parse_message, refusal, with_ttls_capped
from sequester.net.episode.ruleset import Grant
from sequester.net.episode.upstream import Upstream

__all__ = ["DnsResponder", "MAX_PENDING", "MAX_TCP"]

log = logging.getLogger("sequester.net.episode")

MAX_PENDING = 64
MAX_TCP = 16
TCP_IDLE = 10.0
TCP_QUERIES = 64
KEPT_REFUSALS = 32
KEPT_ADDRESSES = 4096
_NAMES_PER_ADDRESS = 8


class DnsResponder:
    """Serves ``udp`` and ``tcp`` (a listening socket) until :meth:`close`. ``grant`` lets
    addresses through the router (it raises if it cannot: the answer is then withheld)."""

    def __init__(
        self,
        udp: socket.socket,
        tcp: socket.socket,
        answers: Answers,
        upstream: Upstream,
        grant: Callable[[Sequence[Grant]], None],
        *,
        workers: int = 4,
    ):
        self.udp, self.tcp = udp, tcp
        self.answers, self.upstream, self.grant = answers, upstream, grant
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sequester-dns")
        self._slots = threading.BoundedSemaphore(MAX_PENDING)
        self._tcp_slots = threading.BoundedSemaphore(MAX_TCP)
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.counts = collections.Counter[str]()
        self.refusals: collections.deque[dict[str, str]] = collections.deque(maxlen=KEPT_REFUSALS)
        self.names: dict[str, list[str]] = {}

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> DnsResponder:
        for sock in (self.udp, self.tcp):
            sock.setblocking(False)
        self._thread = threading.Thread(target=self._serve, name="sequester-dns", daemon=True)
        self._thread.start()
        return self

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
        self._pool.shutdown(wait=False, cancel_futures=True)
        for sock in (self.udp, self.tcp):
            sock.close()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    # -- serving ---------------------------------------------------------------------------

    def _serve(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self.udp, selectors.EVENT_READ, "udp")
            sel.register(self.tcp, selectors.EVENT_READ, "tcp")
            sel.register(self._wake_r, selectors.EVENT_READ, "wake")
            while not self._closed:
                for key, _ in sel.select():
                    if key.data == "wake":
                        return
                    try:
                        if key.data == "udp":
                            data, peer = self.udp.recvfrom(65535)
                            self._submit(self._udp_question, data, peer)
                        else:
                            conn, _ = self.tcp.accept()
                            if not self._tcp_slots.acquire(blocking=False):
                                conn.close()
                                self._count("dropped")
                                continue
                            threading.Thread(
                                target=self._tcp_connection, args=(conn,), name="sequester-dns-tcp", daemon=True
                            ).start()
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError as exc:
                        if self._closed:
                            return
                        log.debug("DNS responder: %s", exc)

    def _submit(self, fn: Callable[..., None], *args: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self._count("dropped")
            return

        def run() -> None:
            try:
                fn(*args)
            finally:
                self._slots.release()

        try:
            self._pool.submit(run)
        except RuntimeError:  # shut down
            self._slots.release()

    def _udp_question(self, data: bytes, peer: Any) -> None:
        reply = self.respond(data)
        if reply is not None:
            try:
                self.udp.sendto(reply, peer)
            except OSError:
                pass

    def _tcp_connection(self, conn: socket.socket) -> None:
        try:
            conn.setblocking(True)
            conn.settimeout(TCP_IDLE)
            for _ in range(TCP_QUERIES):
                head = _read(conn, 2)
                if head is None:
                    return
                data = _read(conn, struct.unpack("!H", head)[0])
                if data is None:
                    return
                reply = self.respond(data)
                if reply is None:
                    return
                conn.sendall(struct.pack("!H", len(reply)) + reply)
        except OSError:
            return
        finally:
            conn.close()
            self._tcp_slots.release()

    # -- one question ------------------------------------------------------------------------

    def respond(self, data: bytes) -> bytes | None:
        """The reply to one question (None: dropped)."""
        try:
            msg = parse_message(data)
        except DnsError:
            self._count("malformed")
            return None
        self._count("questions")
        name = msg.questions[0].name if msg.questions else ""
        why = self.answers.question(msg)
        if why is not None:
            return self._refuse(data, name, why)
        try:
            response, answer = self.upstream.ask(data)
        except (OSError, DnsError) as exc:
            self._count("failed")
            log.debug("DNS responder: %s: %s", name, exc)
            return refusal(data, SERVFAIL)
        verdict = self.answers.answer(msg.questions[0], answer)
        if verdict.refused is not None:
            return self._refuse(data, name, verdict.refused)
        if verdict.grants:
            try:
                self.grant(verdict.grants)
            except Exception as exc:  # noqa: BLE001 - the router could not let it through: no answer
                self._count("failed")
                log.warning("DNS responder: %s: the router did not take the answer's addresses: %s", name, exc)
                return refusal(data, SERVFAIL)
        if verdict.ttl_cap is not None:
            response = with_ttls_capped(response, answer, verdict.ttl_cap)
        self._count("answered")
        self._remember(name, verdict.addresses)
        return response

    def _refuse(self, data: bytes, name: str, why: str) -> bytes:
        self._count("refused")
        with self._lock:
            self.refusals.append({"name": name, "reason": why})
        return refusal(data)

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def _remember(self, name: str, addresses: Sequence[str]) -> None:
        with self._lock:
            for address in addresses:
                names = self.names.get(address)
                if names is None:
                    if len(self.names) >= KEPT_ADDRESSES:
                        continue
                    names = self.names[address] = []
                if name not in names and len(names) < _NAMES_PER_ADDRESS:
                    names.append(name)

    def record(self) -> dict[str, Any]:
        with self._lock:
            return {**{k: self.counts[k] for k in sorted(self.counts)}, "refusals": list(self.refusals)}


def _read(conn: socket.socket, size: int) -> bytes | None:
    chunks, got = [], 0
    while got < size:
        chunk = conn.recv(size - got)
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)
