"""How fetching and unpacking report progress: a small protocol the CLI draws as bars."""

from __future__ import annotations

from typing import Protocol

__all__ = ["Progress", "NO_PROGRESS"]


class Progress(Protocol):
    def phase(self, description: str, total: int | None) -> None:
        """A new step (a download, a layer to unpack) of ``total`` bytes, when known."""

    def advance(self, amount: int) -> None:
        """``amount`` more bytes of the current step are done."""

    def note(self, line: str) -> None:
        """A line of the fetching tool's own progress (``Copying blob ...``)."""

    def done(self) -> None:
        """The current step is complete."""


class _Silent:
    def phase(self, description: str, total: int | None) -> None:
        pass

    def advance(self, amount: int) -> None:
        pass

    def note(self, line: str) -> None:
        pass

    def done(self) -> None:
        pass


NO_PROGRESS: Progress = _Silent()
