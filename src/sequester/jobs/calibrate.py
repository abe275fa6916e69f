"""Calibrating tasks (see :mod:`sequester.calibration`) and the state each trial of a job
gets from it: ``oracle`` and ``nop`` run as jobs of their own, ``repeats`` times each, in
the jobs folder (:func:`sequester.jobs.job.calibrate_tasks`); what they scored is kept
under each task's key.

``run``'s ``--calibration``: ``auto`` (the default) scores a task's trials when its record
calibrates it, ends them with :class:`~sequester.errors.TaskNotCalibrated` when its record
does not, and scores them uncalibrated (and says so) where there is none; ``required``
calibrates the tasks without a record first (a task without a solution is refused);
``off`` asks nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import sequester
from sequester.calibration import (
    CalibrationKey,
    CalibrationRecord,
    CalibrationState,
    CalibrationStore,
    calibration_key,
    default_store,
    settings_fields,
    state_for,
)
from sequester.environments.settings import EpisodeSettings
from sequester.errors import ImageError
from sequester.jobs.images import ImagePlan
from sequester.jobs.results import TrialResult, utc_now
from sequester.tasks import Task
from sequester.tasks.checksum import task_checksum

__all__ = ["task_key", "calibration_states", "record_of"]


def _system(plan: ImagePlan | None) -> dict[str, Any] | None:
    if plan is None or isinstance(plan, ImageError):
        return None  # the backend (an engine, a cluster's node) chooses; or the trials fail anyway
    if plan.record is None:
        return {"mode": "host"}
    return {"mode": "image", "digest": plan.record.digest}


def task_key(task: Task, plan: ImagePlan | None, settings: EpisodeSettings) -> CalibrationKey:
    """The key ``task``'s calibration is kept under, for the system ``plan`` and ``settings``."""
    return calibration_key(
        task_checksum=task_checksum(task.path),
        system=_system(plan),
        settings=settings_fields(settings),
        version=sequester.__version__,
    )


def calibration_states(
    tasks: Sequence[Task],
    plans: dict[Path, ImagePlan],
    settings: EpisodeSettings,
    *,
    mode: str,
    store: CalibrationStore | None = None,
) -> dict[Path, CalibrationState]:
    """Each task's state (by folder) under ``mode`` (see the module)."""
    store = store or default_store()
    states: dict[Path, CalibrationState] = {}
    for task in tasks:
        if task.path in states:
            continue
        if mode == "off":
            states[task.path] = CalibrationState("off")
            continue
        key = task_key(task, plans.get(task.path), settings)
        state = state_for(store.get(key.digest), key.digest, mode=mode)
        if mode == "required" and state.state == "uncalibrated" and not task.has_solution:
            state = CalibrationState(
                "not-calibrated", "the task ships no solution (solution/solve.sh): it cannot be calibrated", key.digest
            )
        states[task.path] = state
    return states


def record_of(
    task: Task,
    key: CalibrationKey,
    results: dict[str, list[TrialResult]],
    repeats: int,
    jobs: list[str],
) -> CalibrationRecord:
    """The record of ``task`` from its ``oracle`` and ``nop`` trials (``results`` by agent)."""
    runs: dict[str, list[float | str]] = {}
    for agent in ("oracle", "nop"):
        runs[agent] = [
            t.reward
            if t.reward is not None
            else (
                f"{t.exception_info.exception_type}: {t.exception_info.exception_message}"
                if t.exception_info
                else "no verdict"
            )
            for t in results.get(agent, [])
        ]
    return CalibrationRecord(
        key=key.digest,
        task=task.name,
        fields=key.fields,
        runs=runs,
        repeats=repeats,
        calibrated_at=utc_now(),
        no_solution=not task.has_solution,
        jobs=jobs,
    )
