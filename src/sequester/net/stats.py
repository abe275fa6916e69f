"""What a broker remembers of its sandbox's connections: counts, and the last few targets.

Bounded whatever the sandbox does: a kernel that makes a million refused connections
(each naming a target of up to 64 KB) leaves two counters and :data:`RECENT` short
strings, not a million targets, in the host's memory.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

__all__ = ["BrokerStats", "RECENT"]

RECENT = 64


@dataclass
class BrokerStats:
    """``allowed``/``denied``: the most recent targets (oldest first); ``n_*``: all of them."""

    n_allowed: int = 0
    n_denied: int = 0
    n_over_limit: int = 0  # channels refused because the sandbox had too many open
    _allowed: deque[str] = field(default_factory=lambda: deque(maxlen=RECENT), repr=False)
    _denied: deque[str] = field(default_factory=lambda: deque(maxlen=RECENT), repr=False)

    @property
    def allowed(self) -> list[str]:
        return list(self._allowed)

    @property
    def denied(self) -> list[str]:
        return list(self._denied)

    def allow(self, target: str) -> None:
        self.n_allowed += 1
        self._allowed.append(target)

    def deny(self, target: str) -> None:
        self.n_denied += 1
        self._denied.append(target)
