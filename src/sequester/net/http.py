"""The HTTP proxy protocol as the broker speaks it: parse a request head, answer a refusal. Pure.

Everything here reads bytes a sandbox wrote, so every malformed input is a
:class:`Refused` with a status and a reason, never an exception that escapes into the
broker (a port of 99999, an unparseable IPv6 literal, a name that is not a valid
international domain name, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["Refused", "Request", "parse_request_line", "parse_direct", "origin_headers", "refusal", "shorten"]

_HOP_BY_HOP = {b"proxy-connection", b"proxy-authorization", b"connection", b"keep-alive"}
_TITLES = {400: "Bad Request", 403: "Forbidden", 408: "Request Timeout", 502: "Bad Gateway", 503: "Service Unavailable"}
# A target quoted in a reason (and kept in the broker's records) is cut to this.
_QUOTE = 200


class Refused(Exception):
    """The broker says no: ``status`` and a ``reason`` the sandbox is told."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class Request:
    """A proxy request: a ``CONNECT`` tunnel, or a plain ``http://`` request (``line`` is
    its request line in origin form, for the server)."""

    host: str
    port: int
    tunnel: bool
    line: bytes = b""


def shorten(text: str) -> str:
    return text if len(text) <= _QUOTE else text[:_QUOTE] + f"...[{len(text) - _QUOTE} more]"


def _port(text: str, target: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise Refused(400, f"{shorten(target)!r}: the port is not in 1..65535")
    return int(text)


def _host(host: str, target: str) -> str:
    """A host the broker may look up: ASCII, or an international name that encodes."""
    if not host:
        raise Refused(400, f"{shorten(target)!r} names no host")
    try:
        host.encode("idna")
    except UnicodeError as exc:
        raise Refused(400, f"{shorten(target)!r}: the host is not a valid domain name ({exc})") from None
    return host


def parse_request_line(line: bytes) -> Request:
    """``CONNECT host:port HTTP/1.1`` or ``GET http://host[:port]/path HTTP/1.1``."""
    try:
        method, target, version = line.decode("latin-1").split()
    except ValueError:
        raise Refused(400, "malformed request line") from None
    if method.upper() == "CONNECT":
        host, sep, port = target.rpartition(":")
        if not sep:
            raise Refused(400, f"CONNECT target {shorten(target)!r} is not host:port")
        return Request(_host(host.strip("[]"), target), _port(port, target), True)
    try:
        parts = urlsplit(target)
        hostname, url_port = parts.hostname, parts.port
    except ValueError as exc:  # "Port out of range", "Invalid IPv6 URL", NFKC tricks
        raise Refused(400, f"{shorten(target)!r} is not a valid URL ({exc})") from None
    if parts.scheme.lower() != "http" or not hostname:
        raise Refused(400, "only CONNECT and absolute http:// requests are proxied")
    if url_port == 0:
        raise Refused(400, f"{shorten(target)!r}: the port is not in 1..65535")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Request(_host(hostname, target), url_port or 80, False, f"{method} {path} {version}\r\n".encode("latin-1"))


def parse_direct(line: bytes) -> tuple[str, int] | None:
    """``DIRECT host port``, as the in-sandbox bridge sends it; ``None`` if malformed."""
    parts = line.decode("latin-1").split()
    if len(parts) != 3 or not parts[2].isdigit() or not 1 <= int(parts[2]) <= 65535:
        return None
    return parts[1], int(parts[2])


def origin_headers(head: bytes) -> bytes:
    """Headers for the origin server: hop-by-hop ones dropped, one request per connection."""
    lines = [line for line in head.split(b"\r\n") if line]
    kept = [line for line in lines if line.split(b":", 1)[0].strip().lower() not in _HOP_BY_HOP]
    return b"\r\n".join([*kept, b"Connection: close", b"", b""])


def refusal(status: int, reason: str) -> bytes:
    """A complete response: the reason in the ``X-Sequester-Reason`` header and the body."""
    body = (reason + "\n").encode("utf-8", "replace")
    printable = "".join(c if " " <= c <= "~" else "?" for c in reason)  # nothing can end the header early
    head = (
        f"HTTP/1.1 {status} {_TITLES.get(status, 'Error')}\r\n"
        f"X-Sequester-Reason: {printable}\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("latin-1", "replace") + body
