"""The bytes of a build proxy connection (:mod:`.proxy`): reading the head, connecting, splicing.

Split from the proxy, which decides *whether* and *where* a ``RUN`` line may connect;
this module only moves bytes once that is decided: the request head read within a bound
(:data:`HEAD_LIMIT`), the refusal answered, the connection made to exactly the addresses
checked (:func:`connect_direct`) or through the host's upstream proxy by name
(:func:`connect_via`), and the two sides spliced until either ends or the connection is
idle (:func:`splice`). Every byte moved is counted in the proxy's stats.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import TYPE_CHECKING

from sequester.net.addresses import IPAddress
from sequester.net.build.upstream import UpstreamProxy
from sequester.net.http import Refused, Request, origin_headers, refusal, shorten

if TYPE_CHECKING:
    from sequester.net.build.proxy import BuildProxyStats

__all__ = ["HEAD_LIMIT", "connect_direct", "connect_via", "read_headers", "respond", "splice"]

log = logging.getLogger("sequester.net")

HEAD_LIMIT = 64 * 1024


async def read_headers(reader: asyncio.StreamReader) -> bytes:
    """The header lines after the request line, up to the blank line (not included).

    Attack (request smuggling): a bare LF, CR or NUL inside a line ends the head early at
    a lenient server or upstream proxy, and what follows is a second request nobody
    checked. Such a line is refused."""
    head = b""
    while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
        if any(c in line[:-2] for c in (b"\r", b"\n", b"\0")):
            raise Refused(400, "a header line holds a bare CR, LF or NUL")
        head += line
        if len(head) > HEAD_LIMIT:
            raise asyncio.LimitOverrunError("request head too large", len(head))
    return head


def body_length(head: bytes) -> int:
    """The request body's length (Content-Length; none: 0). Attack: bytes after the body
    are a second request on the same connection (to an upstream proxy: to any host), so
    only the declared body is forwarded; a chunked or ambiguous body is refused."""
    lengths = set()
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"transfer-encoding":
            raise Refused(400, "a request body with Transfer-Encoding is not forwarded by the build proxy")
        if name == b"content-length":
            lengths.add(value.strip())
    if not lengths:
        return 0
    if len(lengths) > 1 or not next(iter(lengths)).isdigit():
        raise Refused(400, "the request's Content-Length is ambiguous")
    return int(next(iter(lengths)))


async def forward_body(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, length: int, stats: BuildProxyStats
) -> None:
    """Exactly ``length`` bytes of the sandbox's request body, then nothing more from it."""
    while length > 0:
        data = await reader.read(min(65536, length))
        if not data:
            break
        length -= len(data)
        stats.bytes_out += len(data)
        writer.write(data)
        await writer.drain()


async def respond(writer: asyncio.StreamWriter, status: int, reason: str) -> None:
    writer.write(refusal(status, reason))
    try:
        await writer.drain()
    except ConnectionError:
        pass


async def connect_direct(
    addresses: list[IPAddress], port: int, target: str, *, timeout: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    errors = []
    for ip in addresses:  # exactly the addresses checked: no second lookup to rebind
        try:
            return await asyncio.wait_for(asyncio.open_connection(str(ip), port), timeout)
        except (OSError, TimeoutError) as exc:
            errors.append(f"{ip}: {exc or 'timed out'}")
    raise Refused(502, f"cannot connect to {target}: {'; '.join(errors)}")


async def connect_via(
    proxy: UpstreamProxy, host: str, request: Request, rest: bytes, *, timeout: float, stats: BuildProxyStats
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Through the host's upstream proxy, by name."""
    name = f"[{host}]" if ":" in host else host
    auth = f"Proxy-Authorization: {proxy.authorization}\r\n".encode() if proxy.authorization else b""
    writer = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(
                proxy.host, proxy.port, limit=HEAD_LIMIT, ssl=ssl.create_default_context() if proxy.tls else None
            )
            if not request.tunnel:
                method, path, version = request.line.split()
                line = b"%s http://%s:%d%s %s\r\n" % (method, name.encode(), request.port, path, version)
                head = line + auth + origin_headers(rest)
                stats.bytes_out += len(head)
                writer.write(head)
                return reader, writer
            writer.write(
                f"CONNECT {name}:{request.port} HTTP/1.1\r\nHost: {name}:{request.port}\r\n".encode() + auth + b"\r\n"
            )
            answer = await reader.readuntil(b"\r\n\r\n")
    except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        if writer is not None:
            writer.transport.abort()
        raise Refused(502, f"the upstream proxy {proxy} failed: {exc or 'timed out'}") from None
    status = answer.split(b"\r\n", 1)[0].decode("latin-1", "replace")
    if status.split()[1:2] != ["200"]:
        writer.transport.abort()
        raise Refused(502, f"the upstream proxy {proxy} answered {shorten(status)!r}")
    return reader, writer


async def splice(
    a_reader: asyncio.StreamReader | None,
    a_writer: asyncio.StreamWriter,
    b_reader: asyncio.StreamReader,
    b_writer: asyncio.StreamWriter,
    *,
    idle_timeout: float,
    stats: BuildProxyStats,
) -> None:
    """Copy both ways (``a`` is the sandbox's side; ``a_reader`` None: only the answer
    comes back) until both end, one breaks, or ``idle_timeout`` passes without a byte
    either way."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(idle_timeout) as idle:

            async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, inbound: bool) -> None:
                try:
                    while data := await src.read(65536):
                        idle.reschedule(loop.time() + idle_timeout)  # a byte either way: not idle
                        stats.bytes_in += len(data) if inbound else 0
                        stats.bytes_out += 0 if inbound else len(data)
                        dst.write(data)
                        await dst.drain()
                    if dst.can_write_eof():
                        dst.write_eof()
                except (ConnectionError, OSError):  # one side broke: end both
                    a_writer.transport.abort()
                    b_writer.transport.abort()

            pumps = [pump(b_reader, a_writer, True)]
            if a_reader is not None:
                pumps.append(pump(a_reader, b_writer, False))
            await asyncio.gather(*pumps)
    except TimeoutError:
        log.debug("build proxy: a connection was idle for %g s", idle_timeout)
