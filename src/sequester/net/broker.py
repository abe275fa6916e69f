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
that is not allowed is never looked up. Refusals answer ``403`` (``400`` for what does
not parse) with the reason in an ``X-Sequester-Reason`` header and in the body (proxy
clients), or close the channel (``DIRECT``).

One broker serves one sandbox on a loop shared by every sandbox of the process, so none
of them may hold it hostage: a sandbox has at most ``max_channels`` channels open at a
time (the next request is answered with no channel: its connection closes at once), the
whole request head must arrive within ``head_timeout`` seconds (not each line: a client
trickling one header byte at a time is cut at the deadline), and what is remembered of
refused targets is a bounded record (:mod:`.stats`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Iterable
from functools import lru_cache

from sequester.net.http import Refused, Request, origin_headers, parse_direct, parse_request_line, refusal, shorten
from sequester.net.plan import is_allowed
from sequester.net.stats import BrokerStats
from sequester.policy import Endpoint

__all__ = ["Broker", "BrokerStats", "MAX_CHANNELS", "shared_loop"]

log = logging.getLogger("sequester.net")

_HEAD_LIMIT = 64 * 1024
# Connections in flight per sandbox: two host fds each (the channel and the upstream).
MAX_CHANNELS = 64


@lru_cache(maxsize=1)
def shared_loop() -> asyncio.AbstractEventLoop:
    """One event loop, in one daemon thread, serves the brokers of every sandbox of this
    process: starting a sandbox then costs no thread and no loop of its own."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="sequester-network", daemon=True).start()
    return loop


class Broker:
    """Serves one sandbox's connections (on the process's shared network loop)."""

    def __init__(
        self,
        allow: Iterable[Endpoint],
        *,
        connect_timeout: float = 10.0,
        head_timeout: float = 10.0,
        max_channels: int = MAX_CHANNELS,
        loop: asyncio.AbstractEventLoop | None = None,
    ):
        self.allow = frozenset(allow)
        self.connect_timeout = connect_timeout
        self.head_timeout = head_timeout
        self.max_channels = max_channels
        self.stats = BrokerStats()
        self._loop = loop or shared_loop()
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
            if len(self._tasks) >= self.max_channels:
                # No channel: the bridge closes that one connection; the others go on.
                self.stats.n_over_limit += 1
                try:
                    self._control.send(b"-")
                except OSError:
                    return
                continue
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
            await self._serve(reader, writer)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not take the broker down, nor spill onto stderr
            log.debug("network broker: channel failed: %r", exc, exc_info=True)
        finally:
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        direct: tuple[str, int] | None = None
        request: Request | None = None
        try:
            # One deadline for the whole head, however it trickles in.
            async with asyncio.timeout(self.head_timeout):
                first = await reader.readuntil(b"\r\n")
                if first.startswith(b"DIRECT "):
                    direct = parse_direct(first)
                    if direct is None:
                        return
                else:
                    rest = await self._read_headers(reader)
                    request = parse_request_line(first)
        except TimeoutError:
            if direct is None:
                await _respond(writer, 408, f"the request head did not arrive within {self.head_timeout:g} s")
            return
        except Refused as refused:
            await _respond(writer, refused.status, refused.reason)
            return
        try:
            if direct is not None:
                try:
                    self._decide(*direct)
                    up_reader, up_writer = await self._open(*direct)
                except Refused:
                    return  # closing the channel is the refusal
            else:
                assert request is not None
                self._decide(request.host, request.port)
                up_reader, up_writer = await self._open(request.host, request.port)
                if request.tunnel:
                    writer.write(b"HTTP/1.1 200 Connection Established\r\n\r\n")
                    await writer.drain()
                else:
                    up_writer.write(request.line + origin_headers(rest))
        except Refused as refused:
            await _respond(writer, refused.status, refused.reason)
            return
        await _splice(reader, writer, up_reader, up_writer)

    def _decide(self, host: str, port: int) -> None:
        target = shorten(f"{host}:{port}")
        if not is_allowed(self.allow, host, port):
            self.stats.deny(target)
            log.info("network: refused %s (not in the allowlist)", target)
            raise Refused(403, f"{target} is not in the sandbox policy's allowlist")
        self.stats.allow(target)
        log.debug("network: allowed %s", target)

    async def _open(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            return await asyncio.wait_for(asyncio.open_connection(host, port), self.connect_timeout)
        except (TimeoutError, OSError, UnicodeError) as exc:
            raise Refused(502, f"cannot connect to {host}:{port}: {exc or 'timed out'}") from None

    async def _read_headers(self, reader: asyncio.StreamReader) -> bytes:
        """The header lines after the request line, up to the blank line (the caller
        keeps the deadline)."""
        head = b""
        while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
            head += line
            if len(head) > _HEAD_LIMIT:
                raise Refused(400, "request head too large")
        return head


async def _respond(writer: asyncio.StreamWriter, status: int, reason: str) -> None:
    writer.write(refusal(status, reason))
    try:
        await writer.drain()
    except ConnectionError:
        pass


async def _splice(
    a_reader: asyncio.StreamReader,
    a_writer: asyncio.StreamWriter,
    b_reader: asyncio.StreamReader,
    b_writer: asyncio.StreamWriter,
) -> None:
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
