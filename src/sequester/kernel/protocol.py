"""Messages between the host and a kernel: 4-byte big-endian length, then UTF-8 JSON.

Standard library only (the kernel imports it). The host treats everything a kernel
sends as untrusted: messages have a size limit and must decode to a JSON object.

JSON through ``_json``, the C encoder and scanner that ``json.dumps``/``json.loads``
use, without the ``json`` package: its Python half imports ``re`` (and with it ``enum``,
``functools``, ``collections``), milliseconds of every kernel's start. Same parser on
both sides; stricter only in refusing whitespace around a message, which neither side
ever sends.
"""

from __future__ import annotations

import _json
import os
import struct

from sequester.kernel.fdread import read_exactly

TYPE_CHECKING = False  # not ``typing``: every kernel imports this module at start-up
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any

__all__ = [
    "ProtocolError",
    "MessageReader",
    "encode",
    "write_message",
    "read_message",
    "MAX_MESSAGE",
    "TEXT_LIMIT",
    "frame_limit",
]

_HEADER = struct.Struct("!I")
MAX_MESSAGE = 256 * 1024 * 1024
# Characters of each text field of a result (value repr, error type, message, traceback):
# the kernel clips them, so an honest result is bounded.
TEXT_LIMIT = 100_000
_RESULT_FIELDS = 4
# JSON can spend up to 6 bytes on one character ("\u001f").
_MAX_JSON_BYTES_PER_CHAR = 6
_MARGIN = 64 * 1024


def frame_limit(output_bytes: int) -> int:
    """The largest frame the host reads from a kernel whose policy allows ``output_bytes``.

    What an honest kernel can put in a frame (its clipped text fields, plus the output
    cap in case output ever rides on frames) and a margin for the JSON around it. A
    kernel that announces more is broken or hostile: the host stops reading and kills
    it, so it can never make the host buffer a frame of its choosing (250 MB, say).
    """
    honest = _RESULT_FIELDS * TEXT_LIMIT * _MAX_JSON_BYTES_PER_CHAR + output_bytes
    return min(MAX_MESSAGE, honest + _MARGIN)


class ProtocolError(Exception):
    """A peer sent something that is not a well-formed message."""


def _not_serializable(value: object) -> object:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


class _ScanContext:
    """What ``_json.make_scanner`` reads: ``json.loads``'s defaults."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}.__getitem__


# json.dumps(separators=(",", ":"), ensure_ascii=False) with no circular-reference
# markers (a message is built by sequester, never by a cell).
_encode_json = _json.make_encoder(None, _not_serializable, _json.encode_basestring, None, ":", ",", False, False, True)
# typeshed asks for a make_scanner (its own TODO: any object with these attributes)
_scan_json = _json.make_scanner(_ScanContext())  # type: ignore[arg-type]


def dumps(message: Any) -> str:
    """``message`` as compact JSON."""
    return "".join(_encode_json(message, 0))


def loads(text: str) -> Any:
    """One JSON value that is all of ``text``; ``ValueError`` otherwise."""
    try:
        value, end = _scan_json(text, 0)
    except StopIteration as stop:
        raise ValueError(f"expecting a JSON value at character {stop.value}") from None
    except SystemError:
        # The C scanner reports a malformed string through json.decoder's error class; in
        # a process that never imported json it fails that way instead (red team).
        raise ValueError("malformed JSON") from None
    if end != len(text):
        raise ValueError(f"extra data at character {end}")
    return value


def encode(message: dict[str, Any]) -> bytes:
    body = dumps(message).encode("utf-8", "surrogatepass")
    return _HEADER.pack(len(body)) + body


def write_message(fd: int, message: dict[str, Any]) -> None:
    view = memoryview(encode(message))
    while view:
        view = view[os.write(fd, view) :]


def _decode(body: bytes) -> dict[str, Any]:
    try:
        message = loads(body.decode("utf-8", "surrogatepass"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: a hostile kernel's [[[[...
        raise ProtocolError(f"message is not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError("message is not a JSON object")
    return message


def read_message(fd: int, limit: int = MAX_MESSAGE) -> dict[str, Any] | None:
    """Blocking read of one message; ``None`` at end of file."""
    header = read_exactly(fd, _HEADER.size, ProtocolError)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    if size > limit:
        raise ProtocolError(f"message of {size} bytes is over the {limit}-byte limit")
    body = read_exactly(fd, size, ProtocolError)
    if body is None:
        raise ProtocolError("end of file inside a message")
    return _decode(body)


class MessageReader:
    """Incremental decoder for a non-blocking reader: feed bytes, get whole messages."""

    def __init__(self, limit: int = MAX_MESSAGE):
        self._buffer = bytearray()
        self._limit = limit

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buffer += data
        out: list[dict[str, Any]] = []
        while len(self._buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buffer)
            if size > self._limit:
                raise ProtocolError(f"message of {size} bytes is over the {self._limit}-byte limit")
            end = _HEADER.size + size
            if len(self._buffer) < end:
                break
            out.append(_decode(bytes(self._buffer[_HEADER.size : end])))
            del self._buffer[:end]
        return out
