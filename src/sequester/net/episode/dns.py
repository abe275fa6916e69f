"""DNS messages as the episode's responder reads and answers them (RFC 1035); pure.

Only what a forwarder needs: a query's question; a response's question and resource records
with where each TTL sits (so TTLs are capped in place and the rest of the answer goes back
byte for byte); a refusal made from a query. Names are read with compression pointers,
each followed at most once (a loop is malformed, not a hang). Everything malformed raises
:class:`DnsError`, and the responder drops it.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass

__all__ = [
    "A",
    "AAAA",
    "CNAME",
    "HTTPS",
    "PTR",
    "NOERROR",
    "SERVFAIL",
    "NXDOMAIN",
    "REFUSED",
    "DnsError",
    "Question",
    "Record",
    "Message",
    "parse_message",
    "refusal",
    "with_id",
    "with_ttls_capped",
    "query",
]

A, NS, CNAME, SOA, PTR, AAAA, OPT, HTTPS = 1, 2, 5, 6, 12, 28, 41, 65
NOERROR, FORMERR, SERVFAIL, NXDOMAIN, NOTIMP, REFUSED = 0, 1, 2, 3, 4, 5
CLASS_IN = 1
_QR, _OPCODE, _TC, _RD, _RA = 0x8000, 0x7800, 0x0200, 0x0100, 0x0080
_MAX_POINTERS = 64


class DnsError(ValueError):
    """A message that is not well-formed DNS."""


@dataclass(frozen=True)
class Question:
    name: str  # lowercase, no trailing dot ("" for the root)
    type: int
    klass: int


@dataclass(frozen=True)
class Record:
    section: int  # 0 answer, 1 authority, 2 additional
    name: str
    type: int
    klass: int
    ttl: int
    ttl_offset: int  # where the TTL's 4 bytes are in the message
    rdata: bytes

    @property
    def address(self) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
        """The address of an A or AAAA record of class IN."""
        if self.klass != CLASS_IN:
            return None
        if self.type == A and len(self.rdata) == 4:
            return ipaddress.IPv4Address(self.rdata)
        if self.type == AAAA and len(self.rdata) == 16:
            return ipaddress.IPv6Address(self.rdata)
        return None


@dataclass(frozen=True)
class Message:
    id: int
    flags: int
    questions: tuple[Question, ...]
    records: tuple[Record, ...] = ()

    @property
    def is_response(self) -> bool:
        return bool(self.flags & _QR)

    @property
    def opcode(self) -> int:
        return (self.flags & _OPCODE) >> 11

    @property
    def rcode(self) -> int:
        return self.flags & 0xF

    @property
    def truncated(self) -> bool:
        return bool(self.flags & _TC)

    @property
    def answers(self) -> tuple[Record, ...]:
        return tuple(r for r in self.records if r.section == 0)


_HOST_LABEL = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")


def _name(data: bytes, offset: int, *, host: bool = False) -> tuple[str, int]:
    """The name at ``offset`` and the offset just past it (in the message, not the pointer
    target). ``host``: every label must be a host name's (letters, digits, ``-``, ``_``):
    a question's name is judged joined with dots, so a label holding a dot or other bytes
    would be judged as another name than the one asked (red team)."""
    labels: list[str] = []
    end = None
    jumps = 0
    total = 0
    while True:
        if offset >= len(data):
            raise DnsError("name runs past the message")
        length = data[offset]
        if length & 0xC0 == 0xC0:
            if offset + 1 >= len(data):
                raise DnsError("name pointer runs past the message")
            jumps += 1
            if jumps > _MAX_POINTERS:
                raise DnsError("name pointers loop")
            if end is None:
                end = offset + 2
            offset = ((length & 0x3F) << 8) | data[offset + 1]
            continue
        if length & 0xC0:
            raise DnsError("unknown label type")
        offset += 1
        if length == 0:
            break
        label = data[offset : offset + length]
        if len(label) != length:
            raise DnsError("label runs past the message")
        total += length + 1
        if total > 255:
            raise DnsError("name longer than 255 bytes")
        if host and not _HOST_LABEL.issuperset(label):
            raise DnsError("a label of the name is not a host name's")
        labels.append(label.decode("ascii", errors="replace").lower())
        offset += length
    return ".".join(labels), (end if end is not None else offset)


def parse_message(data: bytes) -> Message:
    """Header, questions and every resource record of ``data``."""
    if len(data) < 12:
        raise DnsError("shorter than a header")
    ident, flags, qd, an, ns, ar = struct.unpack_from("!HHHHHH", data)
    offset = 12
    questions = []
    for _ in range(qd):
        name, offset = _name(data, offset, host=True)
        if offset + 4 > len(data):
            raise DnsError("question runs past the message")
        qtype, qclass = struct.unpack_from("!HH", data, offset)
        offset += 4
        questions.append(Question(name, qtype, qclass))
    records = []
    for section, count in enumerate((an, ns, ar)):
        for _ in range(count):
            name, offset = _name(data, offset)
            if offset + 10 > len(data):
                raise DnsError("record runs past the message")
            rtype, rclass, ttl, length = struct.unpack_from("!HHIH", data, offset)
            rdata = data[offset + 10 : offset + 10 + length]
            if len(rdata) != length:
                raise DnsError("record data runs past the message")
            records.append(Record(section, name, rtype, rclass, ttl, offset + 4, rdata))
            offset += 10 + length
    return Message(ident, flags, tuple(questions), tuple(records))


def _encode_name(name: str) -> bytes:
    out = b""
    for label in name.split(".") if name else []:
        raw = label.encode("ascii")
        if not 0 < len(raw) < 64:
            raise DnsError(f"bad label in {name!r}")
        out += bytes([len(raw)]) + raw
    return out + b"\0"


def query(ident: int, name: str, qtype: int, *, recursion: bool = True) -> bytes:
    """A query for ``name`` (tests, and asking upstream in the responder's own name)."""
    header = struct.pack("!HHHHHH", ident, _RD if recursion else 0, 1, 0, 0, 0)
    return header + _encode_name(name) + struct.pack("!HH", qtype, CLASS_IN)


def refusal(request: bytes, rcode: int = REFUSED) -> bytes:
    """An answer to ``request`` with ``rcode``, its question echoed (nothing else)."""
    msg = parse_message(request)
    flags = _QR | (msg.flags & (_OPCODE | _RD)) | _RA | rcode
    if len(msg.questions) != 1:
        return struct.pack("!HHHHHH", msg.id, flags, 0, 0, 0, 0)
    # The question as the client wrote it: its first name ends where the question's type does.
    _, end = _name(request, 12)
    return struct.pack("!HHHHHH", msg.id, flags, 1, 0, 0, 0) + request[12 : end + 4]


def with_id(data: bytes, ident: int) -> bytes:
    return struct.pack("!H", ident) + data[2:]


def with_ttls_capped(data: bytes, msg: Message, cap: int) -> bytes:
    """``data`` (parsed as ``msg``) with every record's TTL at most ``cap`` (OPT records,
    whose TTL field holds flags, untouched)."""
    out = bytearray(data)
    for record in msg.records:
        if record.type != OPT and record.ttl > cap:
            struct.pack_into("!I", out, record.ttl_offset, cap)
    return bytes(out)
