"""What a cell returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["CellError", "CellResult"]


@dataclass(frozen=True)
class CellError:
    """An exception the cell raised, or a refusal by the kernel's limits.

    ``type`` is the exception's class name (``"ZeroDivisionError"``, ``"PermissionError"``,
    ``"TimeoutError"``, ``"OutputLimitExceeded"``, ``"KernelDied"``, ...).
    """

    type: str
    message: str
    traceback: str = ""

    def __str__(self) -> str:
        return f"{self.type}: {self.message}" if self.message else self.type


@dataclass(frozen=True)
class CellResult:
    """stdout, stderr, the repr of the last expression's value, and the error if any.

    ``timed_out``: the cell ran over its timeout. ``restarted``: the kernel had to be
    killed and started afresh (state lost) to recover from this cell.
    """

    stdout: str
    stderr: str
    value: str | None
    error: CellError | None
    duration: float
    timed_out: bool = False
    restarted: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        return {
            "stdout": self.stdout,
            "stderr": self.stderr,
            "value": self.value,
            "error": None if self.error is None else vars(self.error),
            "duration": self.duration,
            "timed_out": self.timed_out,
            "restarted": self.restarted,
        }
