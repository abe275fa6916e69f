"""The build proxy: a ``RUN`` line's only way out, an HTTP proxy the host serves.

The sandbox of a ``RUN`` line has only ``lo``. The host opens a listening socket on
``127.0.0.1:PORT`` *inside* the sandbox's network namespace (:mod:`sequester.net.netns_listener`) and
serves every connection accepted on it, here, on the host: ``CONNECT host:port`` (TLS:
pip, uv, curl) and absolute-form ``GET http://host/path`` (apt). What may be reached is
:mod:`.network`'s decision; names are resolved here, the addresses checked, and the
connection made to exactly a checked address.

One proxy serves one build step, on the process's shared network loop (the brokers'), so
none may hold it hostage: at most ``max_connections`` at a time (the next is answered
``503`` and closed at once), the whole request head within ``head_timeout`` (a client
trickling a byte at a time is cut at the deadline), ``idle_timeout`` without a byte either
way ends a connection, lookups run on a small pool of their own, and the record of
refusals is bounded.

Use: start bwrap with ``--block-fd`` and ``--info-fd``; read ``child-pid`` (and
``net-namespace``); ``proxy.serve(open_listener_in(pid, 3128, pidfd=..., net_namespace=...))``;
give the command :func:`proxy_env` (3128); unblock; wait; ``proxy.close()`` (also when the
sandbox died), then ``proxy.refusals`` for the build log.

The bytes themselves (reading the head, connecting, splicing) are :mod:`.forward`'s;
this module owns the listener, the connections' lifetime, and the decision.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from sequester.errors import SandboxError
from sequester.net.addresses import (
    HOST_NAME,
    LOOPBACK,
    OWN,
    PRIVATE,
    IPAddress,
    LocalAddresses,
    classify_address,
    literal,
    normalize_host,
)
from sequester.net.broker import shared_loop
from sequester.net.build.forward import HEAD_LIMIT as _HEAD_LIMIT
from sequester.net.build.forward import (
    body_length,
    connect_direct,
    connect_via,
    forward_body,
    read_headers,
    respond,
    splice,
)
from sequester.net.build.network import BuildNetwork, HostRule, parse_host_rule
from sequester.net.build.upstream import Upstream, UpstreamProxy
from sequester.net.http import Refused, origin_headers, parse_request_line, refusal, shorten
from sequester.net.stats import BrokerStats

__all__ = ["BuildProxy", "BuildProxyStats", "proxy_env", "MAX_CONNECTIONS", "MAX_REFUSALS"]

log = logging.getLogger("sequester.net")

MAX_CONNECTIONS = 64
MAX_REFUSALS = 100  # kept for the build log (the first ones: usually the cause); all are counted
_MAX_ADDRESSES = 8  # of one name, tried in order


def proxy_env(port: int) -> dict[str, str]:
    """The variables a ``RUN`` process gets: every client goes through the proxy, except
    for the sandbox's own loopback."""
    url = f"http://127.0.0.1:{port}"
    local = "localhost,127.0.0.1,::1"
    return {
        "http_proxy": url,
        "https_proxy": url,
        "HTTP_PROXY": url,
        "HTTPS_PROXY": url,
        "no_proxy": local,
        "NO_PROXY": local,
    }


@dataclass
class BuildProxyStats(BrokerStats):
    bytes_in: int = 0  # to the sandbox
    bytes_out: int = 0  # from the sandbox
    n_connections: int = 0


class BuildProxy:
    """Serves one build step's proxy connections. ``close()`` ends them all."""

    def __init__(
        self,
        policy: BuildNetwork,
        *,
        index_hosts: frozenset[str] = frozenset(),
        upstream: Upstream | None = None,
        max_connections: int = MAX_CONNECTIONS,
        head_timeout: float = 10.0,
        idle_timeout: float = 120.0,
        connect_timeout: float = 15.0,
        resolve_timeout: float = 10.0,
        local: LocalAddresses | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ):
        self.policy = policy
        self._rules = policy.rules
        self._index = tuple(parse_host_rule(h, field="index_hosts") for h in sorted(index_hosts))
        self.upstream = Upstream.from_env() if upstream is None else upstream
        self.max_connections = max_connections
        self.head_timeout, self.idle_timeout = head_timeout, idle_timeout
        self.connect_timeout, self.resolve_timeout = connect_timeout, resolve_timeout
        self.local = local or LocalAddresses()
        self.stats = BuildProxyStats()
        self._refusals: list[str] = []
        self._loop = loop or shared_loop()
        # Lookups on a pool of their own: a build resolving slow names cannot starve the
        # loop's default executor, which the kernels' brokers connect with.
        self._resolver = ThreadPoolExecutor(4, thread_name_prefix="sequester-build-dns")
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._transports: set[asyncio.WriteTransport] = set()
        self._accepted: set[socket.socket] = set()  # not yet handed to a transport
        self._closed = False

    @property
    def refusals(self) -> list[str]:
        """``host:port: reason`` of the first :data:`MAX_REFUSALS` refused targets."""
        return list(self._refusals)

    def __enter__(self) -> BuildProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def serve(self, listener: socket.socket) -> None:
        """Serve every connection accepted on ``listener`` (which this proxy now owns)."""
        if self._closed or self._listener is not None:
            listener.close()
            raise SandboxError("the build proxy is closed" if self._closed else "the build proxy is already serving")
        listener.setblocking(False)
        self._listener = listener
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)

    def close(self) -> None:
        """Stop accepting and close every connection; idempotent, returns within seconds."""
        if self._closed:
            return
        self._closed = True
        try:
            if _running_loop() is self._loop:  # from a callback on the loop itself: cannot wait
                self._loop.create_task(self._shutdown())
            else:
                asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=5)
        except Exception:  # noqa: BLE001 - closing must not raise
            log.debug("build proxy: shutdown was not clean", exc_info=True)
        self._resolver.shutdown(wait=False, cancel_futures=True)

    async def _start(self) -> None:
        assert self._listener is not None
        self._loop.add_reader(self._listener.fileno(), self._on_accept)

    async def _shutdown(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            self._loop.remove_reader(listener.fileno())
            listener.close()
        for task in list(self._tasks):
            task.cancel()
        for transport in list(self._transports):  # no graceful flush: a peer that never reads
            transport.abort()  # must not keep a connection open
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=3)
        for conn in list(self._accepted):  # of tasks cancelled before they ran
            conn.close()

    # -- accepting ----------------------------------------------------------------------

    def _on_accept(self) -> None:
        for _ in range(64):  # then let the loop serve others
            if self._listener is None:
                return
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:  # EMFILE, ENOBUFS: back off, or the readable listener spins the loop
                log.warning("build proxy: cannot accept: %s", exc)
                self._pause(1.0)
                return
            self.stats.n_connections += 1
            conn.setblocking(False)
            if len(self._tasks) >= self.max_connections:
                self._over_limit(conn)
                continue
            self._accepted.add(conn)
            task = self._loop.create_task(self._handle(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _pause(self, seconds: float) -> None:
        listener = self._listener
        if listener is None:
            return
        self._loop.remove_reader(listener.fileno())

        def resume() -> None:
            if self._listener is listener:
                self._loop.add_reader(listener.fileno(), self._on_accept)

        self._loop.call_later(seconds, resume)

    def _over_limit(self, conn: socket.socket) -> None:
        """Answer 503 at once, without a task: a flood of connections costs no memory."""
        self.stats.n_over_limit += 1
        try:
            conn.recv(_HEAD_LIMIT)  # what it sent already: closing over unread data would reset
        except OSError:
            pass
        try:
            conn.send(refusal(503, f"too many connections through the build proxy (at most {self.max_connections})"))
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        conn.close()

    # -- one connection -----------------------------------------------------------------

    async def _handle(self, conn: socket.socket) -> None:
        try:
            reader, writer = await asyncio.open_connection(sock=conn, limit=_HEAD_LIMIT)
        finally:
            self._accepted.discard(conn)
        self._transports.add(writer.transport)
        try:
            await self._serve(reader, writer)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, TimeoutError):
            pass
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not take the loop down, nor spill onto stderr
            log.debug("build proxy: connection failed: %r", exc, exc_info=True)
        finally:
            self._transports.discard(writer.transport)
            writer.transport.abort() if self._closed else writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(self.head_timeout):  # one deadline for the whole head
                first = await reader.readuntil(b"\r\n")
                rest = await read_headers(reader)
            request = parse_request_line(first)
        except TimeoutError:
            return await respond(writer, 408, f"the request head did not arrive within {self.head_timeout:g} s")
        except asyncio.LimitOverrunError:
            return await respond(writer, 400, "request head too large")
        except Refused as refused:
            return await respond(writer, refused.status, refused.reason)
        host = normalize_host(request.host)
        target = shorten(f"[{host}]:{request.port}" if ":" in host else f"{host}:{request.port}")
        try:
            length = 0 if request.tunnel else body_length(rest)
            addresses, proxy = await self._decide(host, request.port, request.tunnel, target)
            timeout = self.connect_timeout
            up_reader, up_writer = await (
                connect_via(proxy, host, request, rest, timeout=timeout, stats=self.stats)
                if proxy is not None
                else connect_direct(addresses, request.port, target, timeout=timeout)
            )
        except Refused as refused:
            return await respond(writer, refused.status, refused.reason)
        self._transports.add(up_writer.transport)
        try:
            if request.tunnel:
                writer.write(b"HTTP/1.1 200 Connection Established\r\n\r\n")
            else:
                if proxy is None:
                    head = request.line + origin_headers(rest)
                    self.stats.bytes_out += len(head)
                    up_writer.write(head)
                await forward_body(reader, up_writer, length, self.stats)
            await splice(
                reader if request.tunnel else None,
                writer,
                up_reader,
                up_writer,
                idle_timeout=self.idle_timeout,
                stats=self.stats,
            )
        finally:
            self._transports.discard(up_writer.transport)
            up_writer.transport.abort()

    # -- the decision -------------------------------------------------------------------

    def _refuse(self, target: str, reason: str) -> Refused:
        self.stats.deny(target)
        text = f"{target}: {reason}"
        if len(self._refusals) < MAX_REFUSALS:  # logged as recorded: a flood of refusals is not a flood of logs
            self._refusals.append(text)
            log.info("build network: refused %s", text)
        return Refused(403, text)

    def _address_refusal(self, ip: IPAddress, index: HostRule | None) -> str | None:
        found = classify_address(ip, local=self.local)
        if found is None:
            return None
        category, reason = found
        # A configured index (the operator's, not the Dockerfile's) may be private or on
        # this host; loopback only if its URL names loopback itself.
        if index is not None and (category in (PRIVATE, OWN) or (category == LOOPBACK and index.names_loopback)):
            return None
        return reason

    async def _decide(
        self, host: str, port: int, tunnel: bool, target: str
    ) -> tuple[list[IPAddress], UpstreamProxy | None]:
        mode = self.policy.mode
        if mode == "none":
            raise self._refuse(target, "the build network is 'none'")
        address = literal(host)
        if address is None and (len(host) > 253 or not HOST_NAME.fullmatch(host)):
            # Only DNS names go on, to the resolver or into an upstream's request line.
            raise Refused(400, f"{target}: not a valid host name")
        index = next(
            (
                r
                for r in self._index
                if (r.matches_address(address, port) if address is not None else r.matches_name(host, port))
            ),
            None,
        )
        listed = mode != "allowlist" or (address is None and any(r.matches_name(host, port) for r in self._rules))
        networks = [r for r in self._rules if r.network is not None]

        def unlisted(ip: IPAddress) -> str | None:
            return (
                None
                if listed or any(r.matches_address(ip, port) for r in networks)
                else f"{ip} is not in allowed_hosts"
            )

        if not listed and (address is None and not networks):  # an unlisted name is never even looked up
            raise self._refuse(target, "not in allowed_hosts")
        proxy = self.upstream.for_target(host, port, tunnel=tunnel)
        if address is not None:
            reason = self._address_refusal(address, index) or unlisted(address)
            if reason:
                raise self._refuse(target, reason)
            self.stats.allow(target)
            return [address], proxy
        try:
            resolved = await self._resolve(host, port)
        except Refused:
            if proxy is None or not listed:
                raise
            # The host's proxy resolves names the host cannot (residual: what it resolves
            # them to is not checked here; names it and we resolve alike are).
            return [], proxy
        checked = [(ip, self._address_refusal(ip, index) or unlisted(ip)) for ip in resolved]
        good = [ip for ip, reason in checked if reason is None]
        refused = [f"{host} -> {reason}" for ip, reason in checked if reason is not None]
        # Direct: connect only to the good ones. Through the upstream, which resolves again
        # and picks its own address: refuse if any answer is bad.
        if refused and (proxy is not None or not good):
            raise self._refuse(target, refused[0])
        if not good:
            raise Refused(502, f"cannot resolve {shorten(host)}: no address")
        self.stats.allow(target)
        return good, proxy

    async def _resolve(self, host: str, port: int) -> list[IPAddress]:
        try:
            infos = await asyncio.wait_for(
                self._loop.run_in_executor(
                    self._resolver, lambda: socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                ),
                self.resolve_timeout,
            )
        except (OSError, ValueError, TimeoutError, RuntimeError) as exc:
            raise Refused(502, f"cannot resolve {shorten(host)}: {exc or 'timed out'}") from None
        found: list[IPAddress] = []
        for info in infos:
            ip = literal(str(info[4][0]))
            if ip is not None and ip not in found:
                found.append(ip)
        return found[:_MAX_ADDRESSES]


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
