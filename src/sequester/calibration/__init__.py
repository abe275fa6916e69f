"""Calibration: whether a task, on this machine's system and settings, scores as it must.

``oracle`` (the task's own solution) must score full marks and ``nop`` (nothing done)
must score 0, every time: a task that does not (a verifier that cannot run here, a
flaky test, a broken image) would score agents wrongly, so its trials end with
:class:`~sequester.errors.TaskNotCalibrated` instead of agent verdicts. The records are
kept by :mod:`.store` under a key of everything that can change the outcome (:mod:`.key`);
:mod:`.verdict` reads one. Running the calibration itself is a job of ``oracle`` and
``nop`` trials (:mod:`sequester.jobs.calibrate`).
"""

from __future__ import annotations

from sequester.calibration.key import CalibrationKey, calibration_key, settings_fields
from sequester.calibration.lookup import lookup
from sequester.calibration.store import CalibrationRecord, CalibrationStore, default_store
from sequester.calibration.verdict import MODES, CalibrationState, judge_record, state_for

__all__ = [
    "CalibrationKey",
    "calibration_key",
    "settings_fields",
    "lookup",
    "CalibrationRecord",
    "CalibrationStore",
    "default_store",
    "CalibrationState",
    "judge_record",
    "state_for",
    "MODES",
]
