"""A task's calibration state from its record, for what runs one episode at a time (the
server, the Ray pool): the key from the task's checksum, the episode's system and the
settings."""

from __future__ import annotations

from typing import Any

from sequester.calibration.key import calibration_key, settings_fields
from sequester.calibration.store import CalibrationStore, default_store
from sequester.calibration.verdict import CalibrationState, state_for

__all__ = ["lookup"]


def lookup(
    *,
    task_checksum: str,
    system: dict[str, Any] | None,
    settings: object,
    version: str,
    mode: str,
    store: CalibrationStore | None = None,
) -> CalibrationState:
    """The state of a task's trials under ``mode``, from the record (if any) of its key."""
    key = calibration_key(
        task_checksum=task_checksum, system=system, settings=settings_fields(settings), version=version
    )
    return state_for((store or default_store()).get(key.digest), key.digest, mode=mode)
