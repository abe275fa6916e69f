"""Reading a whole frame from a blocking fd: the one loop both the kernel's first stage
(:mod:`.boot`, which imports as little as it can) and the protocol (:mod:`.protocol`) use."""

from __future__ import annotations

import os

__all__ = ["read_exactly"]


def read_exactly(fd: int, size: int, error: type[Exception] = EOFError, what: str = "a message") -> bytes | None:
    """``size`` bytes from ``fd``; ``None`` at end of file before the first byte;
    ``error`` naming ``what`` at end of file inside it."""
    chunks: list[bytes] = []
    remaining = size
    while remaining:
        chunk = os.read(fd, remaining)
        if not chunk:
            if remaining == size:
                return None
            raise error(f"end of file inside {what}")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)
