"""What a calibration record says of a task, and the state a trial records. Pure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sequester.calibration.store import CalibrationRecord

__all__ = ["MODES", "CalibrationState", "judge_record", "state_for"]

MODES = ("auto", "required", "off")


@dataclass(frozen=True)
class CalibrationState:
    """``state``: "calibrated" (the trial is scored), "not-calibrated" (its trials end with
    TaskNotCalibrated; ``reason`` says why), "uncalibrated" (no record: scored, and said
    so) or "off" (not asked)."""

    state: str
    reason: str | None = None
    key: str | None = None
    record: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.state}
        if self.reason:
            out["reason"] = self.reason
        if self.key:
            out["key"] = self.key
        if self.record:
            out.update({k: self.record.get(k) for k in ("oracle", "nop", "repeats", "calibrated_at")})
        return out


def judge_record(record: CalibrationRecord) -> str | None:
    """Why ``record`` does not calibrate its task (None: it does): the oracle must score
    full marks every time, nop 0 every time, and neither may end in an error."""
    if record.no_solution:
        return "the task ships no solution (solution/solve.sh): it cannot be calibrated"
    problems = []
    for agent, want in (("oracle", record.full_marks), ("nop", 0.0)):
        runs = record.runs.get(agent, [])
        if not runs:
            problems.append(f"{agent} was not run")
            continue
        errors = [r for r in runs if isinstance(r, str)]
        scores = [r for r in runs if not isinstance(r, str)]
        if errors:
            problems.append(f"{agent} ended with an error {len(errors)} of {len(runs)} times ({errors[0][:200]})")
        if any(s != want for s in scores):
            problems.append(f"{agent} scored {', '.join(f'{s:g}' for s in scores)} (must be {want:g} every time)")
    return "; ".join(problems) or None


def state_for(record: CalibrationRecord | None, key: str, *, mode: str) -> CalibrationState:
    """The state of a trial of the task ``record`` is for (None: there is none)."""
    if mode == "off":
        return CalibrationState("off")
    if record is None:
        return CalibrationState("uncalibrated", "no calibration of this task on this system and settings", key)
    if record.no_solution:  # scored, and said so; refused only where calibration is required
        why = "the task ships no solution (solution/solve.sh): it cannot be calibrated"
        return CalibrationState("not-calibrated" if mode == "required" else "uncalibrated", why, key, record.to_dict())
    failed = judge_record(record)
    return CalibrationState("not-calibrated" if failed else "calibrated", failed, key, record.to_dict())
