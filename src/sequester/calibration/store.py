"""Calibration records on disk: one JSON file per key in the machine's cache
(``/var/cache/sequester/calibration`` for root, ``~/.cache/sequester/calibration`` for a
user; ``$SEQUESTER_CALIBRATION_DIR`` instead), written whole and renamed into place, so a
reader never sees half of one. Every episode hides the folder."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sequester.caches import cache_root, write_json_whole

__all__ = ["CalibrationRecord", "CalibrationStore", "default_store"]

_RECORD_LIMIT = 1 << 20  # a record is small; a larger file is not one of ours


@dataclass(frozen=True)
class CalibrationRecord:
    """``runs``: per agent ("oracle", "nop"), each run's primary reward or, for a run that
    ended without a verdict, its error (``"ExceptionName: message"``)."""

    key: str
    task: str
    fields: dict[str, Any]
    runs: dict[str, list[float | str]]
    repeats: int
    calibrated_at: str
    full_marks: float = 1.0
    no_solution: bool = False
    jobs: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "task": self.task,
            "fields": self.fields,
            "oracle": list(self.runs.get("oracle", [])),
            "nop": list(self.runs.get("nop", [])),
            "repeats": self.repeats,
            "calibrated_at": self.calibrated_at,
            "full_marks": self.full_marks,
            "no_solution": self.no_solution,
            "jobs": list(self.jobs),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CalibrationRecord:
        return cls(
            key=str(data["key"]),
            task=str(data["task"]),
            fields=dict(data.get("fields") or {}),
            runs={"oracle": list(data.get("oracle") or []), "nop": list(data.get("nop") or [])},
            repeats=int(data.get("repeats") or 0),
            calibrated_at=str(data.get("calibrated_at") or ""),
            full_marks=float(data.get("full_marks", 1.0)),
            no_solution=bool(data.get("no_solution")),
            jobs=[str(j) for j in data.get("jobs") or []],
        )


class CalibrationStore:
    def __init__(self, root: Path):
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        if not key or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"calibration key {key!r} is not a hex digest")
        return self.root / f"{key}.json"

    def get(self, key: str) -> CalibrationRecord | None:
        """The record under ``key``, or None (none, or one that cannot be read: a record
        that is not ours is as good as none, and is replaced by the next calibration)."""
        try:
            with open(self._path(key), "rb") as f:
                data = json.loads(f.read(_RECORD_LIMIT + 1)[:_RECORD_LIMIT])
            record = CalibrationRecord.from_dict(data)
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return record if record.key == key else None

    def put(self, record: CalibrationRecord) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        path = self._path(record.key)
        write_json_whole(path, record.to_dict(), prefix=".record-", indent=2, sort_keys=True)
        return path

    def remove(self, key: str) -> bool:
        try:
            self._path(key).unlink()
            return True
        except FileNotFoundError:
            return False


def default_store() -> CalibrationStore:
    """The machine's records: ``$SEQUESTER_CALIBRATION_DIR`` if set, else ``calibration``
    in the cache folder (root's machine-wide one, a user's own)."""
    return CalibrationStore(Path(os.environ.get("SEQUESTER_CALIBRATION_DIR") or cache_root() / "calibration"))
