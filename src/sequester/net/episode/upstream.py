"""Asking the host's resolver, from the host's network namespace: the episode's DNS
responder's only way to the names it answers.

The resolver is the host's (``nameserver`` lines of ``/etc/resolv.conf``, else
``[episodes] dns_servers``): often an address the agent may never reach itself (here
``10.255.255.53``, a private one). Each question goes out with an id of its own from a
socket of its own (a spoofed answer must guess both), over UDP, and over TCP when the
answer was truncated; an answer counts only if it is a response to that very question.
"""

from __future__ import annotations

import ipaddress
import secrets
import socket
import struct
from collections.abc import Sequence
from pathlib import Path

from sequester.net.episode.dns import DnsError, Message, parse_message, with_id

__all__ = ["Upstream", "UpstreamError", "parse_resolv_conf", "parse_server", "host_servers"]

_DEFAULT = [("127.0.0.1", 53)]  # what the C library asks when resolv.conf names none


class UpstreamError(OSError):
    """No resolver answered."""


def parse_server(text: str) -> tuple[str, int]:
    """``IP`` or ``IP:PORT`` / ``[IPv6]:PORT`` -> (address, port). ValueError otherwise."""
    text = text.strip()
    port = 53
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"{text!r} is not IP or IP:PORT")
            port = int(rest[1:])
    elif text.count(":") == 1:
        host, port_text = text.split(":")
        port = int(port_text)
    else:
        host = text
    address = ipaddress.ip_address(host)
    if not 0 < port < 65536:
        raise ValueError(f"{text!r}: port outside 1..65535")
    return str(address), port


def parse_resolv_conf(text: str) -> list[tuple[str, int]]:
    """The ``nameserver`` addresses of a resolv.conf (at most three, as the C library)."""
    found = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[0] == "nameserver":
            try:
                found.append((str(ipaddress.ip_address(fields[1].split("%")[0])), 53))
            except ValueError:
                continue
    return found[:3]


def host_servers(path: Path = Path("/etc/resolv.conf")) -> list[tuple[str, int]]:
    try:
        return parse_resolv_conf(path.read_text()) or list(_DEFAULT)
    except OSError:
        return list(_DEFAULT)


class Upstream:
    """The resolvers an episode's responder asks, in order, each ``timeout`` seconds."""

    def __init__(self, servers: Sequence[tuple[str, int]] | None = None, *, timeout: float = 2.0):
        self.servers = list(servers) if servers else host_servers()
        self.timeout = timeout

    def ask(self, request: bytes) -> tuple[bytes, Message]:
        """The answer to ``request`` (a query, whose id is the caller's), with the caller's
        id back in it. :class:`UpstreamError` when no resolver answered it."""
        asked = parse_message(request)
        last: Exception | None = None
        for server in self.servers:
            for attempt in ("udp", "tcp"):
                ident = secrets.randbits(16)
                try:
                    data = (self._udp if attempt == "udp" else self._tcp)(server, with_id(request, ident))
                    answer = parse_message(data)
                except (OSError, DnsError) as exc:
                    last = exc
                    break
                if answer.id != ident or not answer.is_response or answer.questions != asked.questions:
                    last = UpstreamError(f"{server[0]} answered another question")
                    break
                if answer.truncated and attempt == "udp":
                    continue  # the whole answer, over TCP
                return with_id(data, asked.id), answer
        raise UpstreamError(f"no resolver answered ({', '.join(a for a, _ in self.servers)}): {last}")

    def _udp(self, server: tuple[str, int], data: bytes) -> bytes:
        family = socket.AF_INET6 if ":" in server[0] else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.settimeout(self.timeout)
            sock.connect(server)  # only the server's datagrams are read
            sock.send(data)
            return sock.recv(65535)

    def _tcp(self, server: tuple[str, int], data: bytes) -> bytes:
        family = socket.AF_INET6 if ":" in server[0] else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(self.timeout)
            sock.connect(server)
            sock.sendall(struct.pack("!H", len(data)) + data)
            length = struct.unpack("!H", _exactly(sock, 2))[0]
            return _exactly(sock, length)


def _exactly(sock: socket.socket, size: int) -> bytes:
    chunks, got = [], 0
    while got < size:
        chunk = sock.recv(size - got)
        if not chunk:
            raise UpstreamError("the resolver closed the connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)
