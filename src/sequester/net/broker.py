"""The host side of a sandbox's network: every connection the sandbox makes is decided here.

The sandbox is born holding one end of a unix socketpair (the *control* socket); it has
no other way out, and its seccomp filter stops it from creating unix sockets of its
own. For each connection, the sandbox's bridge sends one byte on the control socket;
the broker answers with a fresh socketpair end (``SCM_RIGHTS``) and serves the other end.
On that *channel* the sandbox speaks either

* ``DIRECT host port\\r\\n`` followed by raw bytes (a listener that stands for one
  allowed service), or
* HTTP proxy protocol: ``CONNECT host:port`` or an absolute-form request
  (``GET http://host:port/path``), for clients that use ``HTTP(S)_PROXY``.

Names are resolved here, on the host, and only after the allowlist said yes, so a name
that is not allowed is never looked up. Refusals answer ``403`` with an
``X-Sequester-Reason`` header (proxy clients) or close the channel (``DIRECT``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from urllib.parse import urlsplit

from ..policy import Endpoint
from .plan import is_allowed

__all__ = ["Broker", "BrokerStats"]

log = logging.getLogger("sequester.net")

_HEAD_LIMIT = 64 * 1024
_HOP_BY_HOP = {b"proxy-connection", b"proxy-authorization", b"connection", b"keep-alive"}


@dataclass
class BrokerStats:
    allowed: list[str] = field(default_factory=list)
    denied: list[str] = field(default_factory=list)


class _Refused(Exception):
    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


@lru_cache(maxsize=1)
def _shared_loop() -> asyncio.AbstractEventLoop:
    """One event loop, in one daemon thread, serves the brokers of every sandbox of this
    process: starting a sandbox then costs no thread and no loop of its own."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="sequester-network", daemon=True).start()
    return loop


class Broker:
    """Serves one sandbox's connections (on the process's shared network loop)."""

    def __init__(self, allow: Iterable[Endpoint], *, connect_timeout: float = 10.0, head_timeout: float = 30.0,
                 loop: asyncio.AbstractEventLoop | None = None):
        self.allow = frozenset(allow)
        self.connect_timeout = connect_timeout
        self.head_timeout = head_timeout
        self.stats = BrokerStats()
        self._loop = loop or _shared_loop()
        self._control: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self) -> socket.socket:
        """Start serving; returns the sandbox's end of the control socket (to inherit)."""
        host_end, sandbox_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        host_end.setblocking(False)
        self._control = host_end
        self._loop.call_soon_threadsafe(self._loop.add_reader, host_end.fileno(), self._on_control)
        return sandbox_end

    def close(self) -> None:
        """Stop serving: every channel of this sandbox is closed when this returns."""
        if self._control is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=5)
        except Exception:  # noqa: BLE001 - closing must not raise
            log.debug("network broker: shutdown was not clean", exc_info=True)

    async def _shutdown(self) -> None:
        control, self._control = self._control, None
        if control is not None:
            self._loop.remove_reader(control.fileno())
            control.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- control socket -------------------------------------------------------------

    def _on_control(self) -> None:
        if self._control is None:
            return
        try:
            requests = self._control.recv(64)
        except BlockingIOError:
            return
        except OSError:
            requests = b""
        if not requests:  # the sandbox is gone
            self._loop.remove_reader(self._control.fileno())
            return
        for _ in requests:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                # One byte and one fd: fits any socket buffer the bridge has not flooded.
                socket.send_fds(self._control, [b"+"], [theirs.fileno()])
            except OSError:
                ours.close()
                return
            finally:
                theirs.close()
            task = self._loop.create_task(self._serve_channel(ours))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    # -- one channel ----------------------------------------------------------------

    async def _serve_channel(self, sock: socket.socket) -> None:
        reader, writer = await asyncio.open_connection(sock=sock, limit=_HEAD_LIMIT)
        try:
            first = await asyncio.wait_for(reader.readuntil(b"\r\n"), self.head_timeout)
            if first.startswith(b"DIRECT "):
                await self._direct(first, reader, writer)
            else:
                await self._proxy(first, reader, writer)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, ConnectionError):
            pass
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must not take the broker down
            log.exception("network broker: channel failed")
        finally:
            writer.close()

    def _decide(self, host: str, port: int) -> None:
        target = f"{host}:{port}"
        if not is_allowed(self.allow, host, port):
            self.stats.denied.append(target)
            log.info("network: refused %s (not in the allowlist)", target)
            raise _Refused(403, f"{target} is not in the sandbox policy's allowlist")
        self.stats.allowed.append(target)
        log.debug("network: allowed %s", target)

    async def _open(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            return await asyncio.wait_for(asyncio.open_connection(host, port), self.connect_timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            raise _Refused(502, f"cannot connect to {host}:{port}: {exc or 'timed out'}") from None

    async def _read_headers(self, reader: asyncio.StreamReader) -> bytes:
        """The header lines after the request line, up to the blank line."""
        head = b""
        while (line := await asyncio.wait_for(reader.readuntil(b"\r\n"), self.head_timeout)) != b"\r\n":
            head += line
            if len(head) > _HEAD_LIMIT:
                raise asyncio.LimitOverrunError("request head too large", len(head))
        return head

    async def _direct(self, first: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        parts = first.decode("latin-1").split()
        if len(parts) != 3 or not parts[2].isdigit():
            return
        try:
            self._decide(parts[1], int(parts[2]))
            up_reader, up_writer = await self._open(parts[1], int(parts[2]))
        except _Refused:
            return  # closing the channel is the refusal
        await _splice(reader, writer, up_reader, up_writer)

    async def _proxy(self, first: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        rest = await self._read_headers(reader)
        try:
            method, target, version = first.decode("latin-1").split()
        except ValueError:
            await _respond(writer, 400, "malformed request line")
            return
        try:
            if method.upper() == "CONNECT":
                host, port = _authority(target)
                self._decide(host, port)
                up_reader, up_writer = await self._open(host, port)
                writer.write(b"HTTP/1.1 200 Connection Established\r\n\r\n")
                await writer.drain()
            else:
                parts = urlsplit(target)
                if parts.scheme.lower() != "http" or not parts.hostname:
                    raise _Refused(400, "only CONNECT and absolute http:// requests are proxied")
                host, port = parts.hostname, parts.port or 80
                self._decide(host, port)
                up_reader, up_writer = await self._open(host, port)
                path = parts.path or "/"
                if parts.query:
                    path += "?" + parts.query
                up_writer.write(f"{method} {path} {version}\r\n".encode("latin-1") + _origin_headers(rest))
        except _Refused as refusal:
            await _respond(writer, refusal.status, refusal.reason)
            return
        await _splice(reader, writer, up_reader, up_writer)


def _authority(target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise _Refused(400, f"CONNECT target {target!r} is not host:port")
    return host.strip("[]"), int(port)


def _origin_headers(head: bytes) -> bytes:
    """Headers for the origin server: hop-by-hop ones dropped, one request per connection."""
    lines = [line for line in head.split(b"\r\n") if line]
    kept = [line for line in lines if line.split(b":", 1)[0].strip().lower() not in _HOP_BY_HOP]
    return b"\r\n".join([*kept, b"Connection: close", b"", b""])


async def _respond(writer: asyncio.StreamWriter, status: int, reason: str) -> None:
    titles = {400: "Bad Request", 403: "Forbidden", 502: "Bad Gateway"}
    body = (reason + "\n").encode()
    head = (
        f"HTTP/1.1 {status} {titles.get(status, 'Error')}\r\n"
        f"X-Sequester-Reason: {reason}\r\nContent-Type: text/plain\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    writer.write(head.encode("latin-1", "replace") + body)
    try:
        await writer.drain()
    except ConnectionError:
        pass


async def _splice(a_reader: asyncio.StreamReader, a_writer: asyncio.StreamWriter,
                  b_reader: asyncio.StreamReader, b_writer: asyncio.StreamWriter) -> None:
    async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
            if dst.can_write_eof():
                dst.write_eof()
        except (ConnectionError, OSError):
            pass

    try:
        await asyncio.gather(pump(a_reader, b_writer), pump(b_reader, a_writer))
    finally:
        b_writer.close()
