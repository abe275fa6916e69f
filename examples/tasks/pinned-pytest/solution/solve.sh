#!/bin/bash
# Oracle solution for pinned-pytest: writes /app/solution.py.
set -euo pipefail

cat > /app/solution.py <<'PY'
"""Duration helpers."""
import re

_UNITS = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))
_PATTERN = re.compile(r"(?:([0-9]+)d)?(?:([0-9]+)h)?(?:([0-9]+)m)?(?:([0-9]+)s)?", re.ASCII)


def parse_duration(text):
    if not isinstance(text, str):
        raise TypeError(f"expected str, got {type(text).__name__}")
    match = _PATTERN.fullmatch(text)
    if not text or match is None:
        raise ValueError(f"invalid duration: {text!r}")
    return sum(int(g) * size for g, (_, size) in zip(match.groups(), _UNITS) if g is not None)


def format_duration(seconds):
    if isinstance(seconds, bool) or not isinstance(seconds, int):
        raise TypeError(f"expected int, got {type(seconds).__name__}")
    if seconds < 0:
        raise ValueError("negative duration")
    if seconds == 0:
        return "0s"
    parts = []
    for unit, size in _UNITS:
        count, seconds = divmod(seconds, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)
PY

cd /app && python3 -c 'from solution import parse_duration, format_duration; print(parse_duration("1h30m"), format_duration(90061))'
