"""Where a job's trials run: the seam between the job (its folder, its result) and the
machines. :class:`LocalScheduler` runs them on threads of this process;
:class:`sequester.cluster.RayScheduler` runs them on a Ray cluster's nodes. The job hands
either the same :class:`PlannedTrial` list and reads the same :class:`TrialResult` stream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from sequester.calibration import CalibrationState
from sequester.environments.settings import EpisodeSettings
from sequester.jobs.images import ImagePlan
from sequester.jobs.results import TrialResult
from sequester.jobs.trial import Cancellation, run_trial
from sequester.tasks import Task

__all__ = ["PlannedTrial", "JobRun", "TrialScheduler", "LocalScheduler"]


@dataclass(frozen=True)
class PlannedTrial:
    name: str
    task: Task
    trial_dir: Path  # in the job folder, on the driver's machine
    source: str | None
    # The system its episode runs on, chosen once for the job (:mod:`.images`), or why it
    # cannot be had; None: the backend chooses (a Docker engine, a cluster's node).
    image: ImagePlan | None = None
    # Whether its task is calibrated (sequester.jobs.calibrate); None: not asked.
    calibration: CalibrationState | None = None


@dataclass(frozen=True)
class JobRun:
    """What every trial of a job shares."""

    agent_spec: str
    settings: EpisodeSettings
    hide: tuple[Path, ...]
    job_id: str
    agent_kwargs: dict[str, Any] = field(default_factory=dict)  # the agent constructor's (--agent-kwarg)


class TrialScheduler(Protocol):
    #: Whether trials run on this machine (then the job fetches and builds images here first).
    runs_here: bool

    def describe(self) -> dict[str, object]:
        """For the job's ``config.json``."""
        ...

    def run(self, job: JobRun, trials: list[PlannedTrial], started: Callable[[str], None]) -> Iterator[TrialResult]:
        """Start the trials (at most the scheduler's concurrency at once) and yield each
        result as it is written in its ``trial_dir``. ``started(name)`` when one begins."""
        ...

    def stop(self) -> list[TrialResult]:
        """Interrupted: stop every running trial at once, let each write its result, start
        no more; return the results :meth:`run` had not yielded. Nothing is left running."""
        ...


class LocalScheduler:
    """Trials on threads here, ``concurrency`` at a time (each an episode of its own processes)."""

    runs_here = True

    def __init__(self, concurrency: int):
        self.concurrency = concurrency
        self._cancel = Cancellation()
        self._pool: ThreadPoolExecutor | None = None
        self._futures: dict[Future[TrialResult], str] = {}
        self._yielded: set[str] = set()

    def describe(self) -> dict[str, object]:
        return {"type": "local", "n_concurrent_trials": self.concurrency}

    def run(self, job: JobRun, trials: list[PlannedTrial], started: Callable[[str], None]) -> Iterator[TrialResult]:
        def one(trial: PlannedTrial) -> TrialResult:
            started(trial.name)
            return run_trial(
                trial.task,
                job.agent_spec,
                trial.trial_dir,
                settings=job.settings,
                hide=list(job.hide),
                cancel=self._cancel,
                source=trial.source,
                job_id=job.job_id,
                image=trial.image,
                agent_kwargs=job.agent_kwargs,
            )

        self._pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="trial")
        self._futures = {self._pool.submit(one, trial): trial.name for trial in trials}
        try:
            for future in as_completed(self._futures):
                self._yielded.add(self._futures[future])
                yield future.result()
        except BaseException:  # an interrupt while waiting here: stop at once, never wait for trials
            self._cancel.cancel()
            self._pool.shutdown(wait=False, cancel_futures=True)
            raise
        self._pool.shutdown(wait=True)

    def stop(self) -> list[TrialResult]:
        self._cancel.cancel()  # running trials stop at once and write their results
        if self._pool is None:
            return []
        self._pool.shutdown(wait=True, cancel_futures=True)
        return [
            future.result()
            for future, name in self._futures.items()
            if name not in self._yielded and future.done() and not future.cancelled() and future.exception() is None
        ]
