"""What a trial and a job leave behind, as plain data with ``to_dict()`` for ``result.json``.

Each ``to_dict()`` is a valid Harbor 0.26 document (``TrialResult``, ``JobResult``; see
:mod:`.harbor`), so ``harbor view`` and Harbor's own loaders read our job folders; the
fields Harbor does not know (``tampering``, ``notes``, the counts sequester prints) sit
next to Harbor's, which Harbor ignores. Times are ISO-8601 strings in UTC.
"""

from __future__ import annotations

import traceback
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sequester.environments.verdict import primary_reward
from sequester.jobs.harbor import harbor_exception, job_stats

__all__ = ["TimingInfo", "ExceptionInfo", "VerifierOutcome", "TrialResult", "JobResult", "utc_now"]


def utc_now() -> str:
    return datetime.now(UTC).isoformat()


def _seconds(started_at: str | None, finished_at: str | None) -> float | None:
    if started_at is None or finished_at is None:
        return None
    return (datetime.fromisoformat(finished_at) - datetime.fromisoformat(started_at)).total_seconds()


@dataclass(frozen=True)
class TimingInfo:
    """When one phase ran; both ``None`` for a phase that never started, ``finished_at``
    ``None`` for one that was cut short by an exception."""

    started_at: str | None = None
    finished_at: str | None = None

    @property
    def duration_sec(self) -> float | None:
        return _seconds(self.started_at, self.finished_at)

    def to_dict(self) -> dict[str, Any]:
        return {"started_at": self.started_at, "finished_at": self.finished_at}


@dataclass(frozen=True)
class ExceptionInfo:
    """Why a trial has no verdict: the error's class name (sequester's own), message and
    traceback. On disk ``exception_type`` is Harbor's name for it (so Harbor's error
    policy applies) and ``sequester_exception_type`` is this one."""

    exception_type: str
    exception_message: str
    exception_traceback: str
    occurred_at: str

    @classmethod
    def from_exception(cls, exc: BaseException) -> ExceptionInfo:
        return cls(type(exc).__name__, str(exc), "".join(traceback.format_exception(exc)), utc_now())

    @property
    def harbor_type(self) -> str:
        return harbor_exception(self.exception_type, self.exception_message)[0]

    def to_dict(self) -> dict[str, Any]:
        name, override = harbor_exception(self.exception_type, self.exception_message)
        out: dict[str, Any] = {
            "exception_type": name,
            "sequester_exception_type": self.exception_type,
            "exception_message": self.exception_message,
            "exception_traceback": self.exception_traceback,
            "occurred_at": self.occurred_at,
        }
        if override is not None:
            out["policy_override"] = dict(override)
        return out


@dataclass(frozen=True)
class VerifierOutcome:
    """The verdict: every reward the verifier wrote (``reward.txt`` gives ``{"reward": x}``)."""

    rewards: dict[str, float]

    @property
    def reward(self) -> float:
        return primary_reward(self.rewards)

    def to_dict(self) -> dict[str, Any]:
        return {"rewards": dict(self.rewards)}


@dataclass(frozen=True)
class TrialResult:
    """One agent on one task. Exactly one of ``verifier_result`` and ``exception_info`` is
    set: a trial either produced a verdict or says why it did not.

    ``source`` is the dataset the task came from (the name of the folder of tasks it was
    found in; ``None`` for a task given by itself), as Harbor groups trials by it;
    ``config`` is the trial's ``config.json`` (Harbor embeds it in the result)."""

    task_name: str
    trial_name: str
    trial_uri: str
    agent_info: dict[str, Any]
    verifier_result: VerifierOutcome | None
    exception_info: ExceptionInfo | None
    started_at: str
    finished_at: str
    environment_setup: TimingInfo = TimingInfo()
    agent_execution: TimingInfo = TimingInfo()
    verifier: TimingInfo = TimingInfo()
    tampering: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    source: str | None = None
    id: str = field(default_factory=lambda: str(uuid.uuid4()))
    task_path: str = ""
    task_checksum: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    verifier_environment_mode: str | None = None
    # What the episode ran on: {"mode": "image", "image": ref, "digest": ..., "id": ...} or {"mode": "host"}.
    system: dict[str, Any] | None = None
    # The network it had (sequester.net.episode: its mode, what decided it, the destinations
    # reached with their bytes, bounded); None: the backend says nothing of it.
    network: dict[str, Any] | None = None
    # Where it ran on a cluster (sequester.cluster: node id, host name, worker pid), and
    # each earlier attempt lost with its node or worker (what failed, where, when).
    node: dict[str, Any] | None = None
    retries: list[dict[str, Any]] = field(default_factory=list)
    # Whether the task was calibrated for this trial (sequester.calibration): its state
    # ("calibrated", "uncalibrated", "not-calibrated", "off"), why, and the record's scores.
    calibration: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrialResult:
        """A trial's ``result.json`` read back (``sequester run --resume``): what
        :meth:`to_dict` wrote. Raises ``KeyError``/``TypeError``/``ValueError`` for anything else."""
        exc = d.get("exception_info")
        verdict = d.get("verifier_result")

        def timing(key: str) -> TimingInfo:
            got = d.get(key) or {}
            return TimingInfo(got.get("started_at"), got.get("finished_at"))

        return cls(
            task_name=str(d["task_name"]),
            trial_name=str(d["trial_name"]),
            trial_uri=str(d["trial_uri"]),
            agent_info=dict(d["agent_info"]),
            verifier_result=VerifierOutcome({str(k): float(v) for k, v in verdict["rewards"].items()})
            if verdict
            else None,
            exception_info=ExceptionInfo(
                str(exc.get("sequester_exception_type") or exc["exception_type"]),
                str(exc["exception_message"]),
                str(exc.get("exception_traceback", "")),
                str(exc.get("occurred_at", "")),
            )
            if exc
            else None,
            started_at=str(d["started_at"]),
            finished_at=str(d["finished_at"]),
            environment_setup=timing("environment_setup"),
            agent_execution=timing("agent_execution"),
            verifier=timing("verifier"),
            tampering=list(d.get("tampering") or []),
            notes=list(d.get("notes") or []),
            source=d.get("source"),
            id=str(d.get("id") or uuid.uuid4()),
            task_path=str((d.get("task_id") or {}).get("path", "")),
            task_checksum=str(d.get("task_checksum", "")),
            config=dict(d.get("config") or {}),
            verifier_environment_mode=d.get("verifier_environment_mode"),
            system=d.get("system"),
            network=d.get("network"),
            node=d.get("node"),
            retries=list(d.get("retries") or []),
            calibration=d.get("calibration"),
        )

    @property
    def reward(self) -> float | None:
        """The primary reward, or ``None`` without a verdict."""
        return self.verifier_result.reward if self.verifier_result is not None else None

    @property
    def duration_sec(self) -> float | None:
        return _seconds(self.started_at, self.finished_at)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": 1,
            "id": self.id,
            "task_name": self.task_name,
            "trial_name": self.trial_name,
            "trial_uri": self.trial_uri,
            "task_id": {"path": self.task_path},
            "source": self.source,
            "task_checksum": self.task_checksum,
            "config": dict(self.config),
            "agent_info": dict(self.agent_info),
            "verifier_result": self.verifier_result.to_dict() if self.verifier_result else None,
            "verifier_environment_mode": self.verifier_environment_mode,
            "exception_info": self.exception_info.to_dict() if self.exception_info else None,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "environment_setup": self.environment_setup.to_dict(),
            "agent_execution": self.agent_execution.to_dict(),
            "verifier": self.verifier.to_dict(),
            "tampering": list(self.tampering),
            "notes": list(self.notes),
            "system": dict(self.system) if self.system is not None else None,
            "network": dict(self.network) if self.network is not None else None,
            "node": dict(self.node) if self.node is not None else None,
            "retries": [dict(r) for r in self.retries],
            "calibration": dict(self.calibration) if self.calibration is not None else None,
        }


@dataclass(frozen=True)
class JobResult:
    """A job's totals. ``n_trials`` counts the trials that finished (with or without a
    verdict); ``mean_reward`` averages the primary reward of those with a verdict only, so
    an error is never silently scored as 0 (it is counted in ``n_errors`` instead).
    ``tampered`` names the trials whose tampering report is not empty (whatever their
    reward: the report is information, the verdict is the tests'). ``stats`` is Harbor's
    ``JobStats`` of the same trials."""

    job_name: str
    started_at: str
    finished_at: str | None
    n_total_trials: int
    n_trials: int
    n_errors: int
    mean_reward: float | None
    reward_counts: dict[str, int]
    errors: list[dict[str, str]]
    trials: list[str]
    tampered: list[str] = field(default_factory=list)
    id: str = field(default_factory=lambda: str(uuid.uuid4()))
    updated_at: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)

    uncalibrated: list[str] = field(default_factory=list)  # trials scored without a calibration record

    @property
    def n_tampered(self) -> int:
        return len(self.tampered)

    @property
    def n_uncalibrated(self) -> int:
        return len(self.uncalibrated)

    @classmethod
    def from_trials(
        cls,
        job_name: str,
        started_at: str,
        finished_at: str | None,
        n_total_trials: int,
        trials: list[TrialResult],
        *,
        job_id: str | None = None,
        n_running: int = 0,
    ) -> JobResult:
        rewards = [t.reward for t in trials if t.reward is not None]
        errors = [
            {
                "trial_name": t.trial_name,
                "exception_type": t.exception_info.harbor_type,
                "sequester_exception_type": t.exception_info.exception_type,
                "exception_message": t.exception_info.exception_message,
            }
            for t in trials
            if t.exception_info is not None
        ]
        counts = Counter(str(r) for r in rewards)
        return cls(
            job_name,
            started_at,
            finished_at,
            n_total_trials,
            len(trials),
            len(errors),
            sum(rewards) / len(rewards) if rewards else None,
            dict(sorted(counts.items(), key=lambda kv: -float(kv[0]))),
            errors,
            [t.trial_name for t in trials],
            [t.trial_name for t in trials if t.tampering],
            job_id or str(uuid.uuid4()),
            finished_at or utc_now(),
            job_stats(trials, n_total_trials, 0 if finished_at else n_running),
            [t.trial_name for t in trials if (t.calibration or {}).get("state") == "uncalibrated"],
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": 1,
            "id": self.id,
            "job_name": self.job_name,
            "started_at": self.started_at,
            "updated_at": self.updated_at,
            "finished_at": self.finished_at,
            "n_total_trials": self.n_total_trials,
            "stats": self.stats,
            "n_trials": self.n_trials,
            "n_errors": self.n_errors,
            "mean_reward": self.mean_reward,
            "reward_counts": dict(self.reward_counts),
            "n_tampered": self.n_tampered,
            "tampered": list(self.tampered),
            "errors": [dict(e) for e in self.errors],
            "trials": list(self.trials),
            "n_uncalibrated": self.n_uncalibrated,
            "uncalibrated": list(self.uncalibrated),
        }
