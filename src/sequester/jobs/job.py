"""A job: one agent on a list of tasks, one trial each, several trials at a time.

Each trial is an episode in its own processes, so trials run on threads (one
:class:`~sequester.environments.local.episode.Episode` per thread). Every episode of the job also
hides every task of the job and the jobs folder: no agent sees another task's tests or
solution, nor any verifier's output or result.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from sequester.agents import load_agent
from sequester.calibration import MODES as CALIBRATION_MODES
from sequester.calibration import CalibrationKey, CalibrationRecord, CalibrationState, CalibrationStore, default_store
from sequester.calibration import state_for as calibration_state_for
from sequester.environments.settings import EpisodeSettings
from sequester.errors import PolicyError, TaskNotCalibrated
from sequester.imagebuild import StepReport
from sequester.images.progress import NO_PROGRESS, Progress
from sequester.jobs.calibrate import calibration_states, record_of, task_key
from sequester.jobs.harbor import ENVIRONMENT_IMPORT_PATHS, agent_config, task_config
from sequester.jobs.images import ImagePlan, choose_job_images
from sequester.jobs.paths import JobPaths, check_name
from sequester.jobs.results import JobResult, TrialResult, utc_now
from sequester.jobs.resume import StoredJob, missing_trials, remove_unfinished
from sequester.jobs.retry import RetryPolicy
from sequester.jobs.schedule import JobRun, LocalScheduler, PlannedTrial, TrialScheduler
from sequester.jobs.trial import new_trial_name, run_trial, settings_to_dict, write_json
from sequester.sandbox.remove import remove_tree
from sequester.tasks import Task, find_tasks
from sequester.tasks.finder import looks_like_task

__all__ = ["PreparedJob", "calibrate_tasks", "default_job_name", "job_config", "prepare_job", "run_job"]


def default_job_name() -> str:
    """The local time, ``YYYY-MM-DD__HH-MM-SS`` (as Harbor names its jobs)."""
    return datetime.now().strftime("%Y-%m-%d__%H-%M-%S")


def run_job(
    task_paths: Sequence[str | os.PathLike[str]],
    agent_spec: str,
    *,
    jobs_dir: str | os.PathLike[str],
    job_name: str | None = None,
    concurrency: int = 4,
    settings: EpisodeSettings | None = None,
    progress: Callable[[TrialResult], None] | None = None,
    image_progress: Progress = NO_PROGRESS,
    build_progress: Callable[[str, StepReport, bool], None] | None = None,
    scheduler: TrialScheduler | None = None,
    calibration: str = "auto",
    calibration_store: CalibrationStore | None = None,
    n_attempts: int = 1,
    include_tasks: Sequence[str] = (),
    exclude_tasks: Sequence[str] = (),
    retry: RetryPolicy | None = None,
    agent_kwargs: dict[str, Any] | None = None,
) -> JobResult:
    """Run ``agent_spec`` once on each task in ``task_paths`` (task folders or folders of
    them, see :func:`sequester.tasks.find_tasks`) into ``jobs_dir/job_name``.

    Bad input (no tasks, a malformed task, a bad agent spec, an existing job folder) raises
    before anything runs. ``progress`` is called with each trial's result as it finishes.
    On an interrupt, running trials are stopped, the job's ``result.json`` is written with
    what finished, and the interrupt propagates. ``scheduler``: where the trials run
    (:class:`~.schedule.LocalScheduler` of ``concurrency`` threads by default; a
    :class:`sequester.cluster.RayScheduler` for a Ray cluster). The same as
    :func:`prepare_job`, then :meth:`PreparedJob.run`. ``calibration``: see
    :mod:`.calibrate` (``auto``, ``required`` or ``off``); ``n_attempts``,
    ``include_tasks``, ``exclude_tasks``, ``retry``: see :func:`prepare_job`.
    """
    job = prepare_job(
        task_paths,
        agent_spec,
        jobs_dir=jobs_dir,
        job_name=job_name,
        concurrency=concurrency,
        settings=settings,
        image_progress=image_progress,
        build_progress=build_progress,
        scheduler=scheduler,
        calibration=calibration,
        calibration_store=calibration_store,
        n_attempts=n_attempts,
        include_tasks=include_tasks,
        exclude_tasks=exclude_tasks,
        retry=retry,
        agent_kwargs=agent_kwargs,
    )
    return job.run(progress)


@dataclass
class PreparedJob:
    """A job whose input is checked, whose folder is made and whose tasks' systems are
    chosen (:mod:`.images`): what is left is to run its trials."""

    name: str
    paths: JobPaths
    agent_spec: str
    settings: EpisodeSettings
    scheduler: TrialScheduler
    trials: list[PlannedTrial]
    hide: tuple[Path, ...]
    config: dict[str, object]
    finished: list[TrialResult] = field(default_factory=list)  # by run(), in the order they finished
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    agent_kwargs: dict[str, Any] = field(default_factory=dict)
    kept: list[TrialResult] = field(default_factory=list)  # a resumed job's finished trials, as they are
    started_at: str | None = None  # a resumed job's first start

    def run(self, progress: Callable[[TrialResult], None] | None = None) -> JobResult:
        """Run the trials; write the job's ``result.json`` as each finishes (see :func:`run_job`)."""
        started_at = self.started_at or utc_now()
        job_id = str(uuid.uuid4())
        write_json(self.paths.config_path, {**self.config, "started_at": started_at})
        finished: dict[str, TrialResult] = {t.trial_name: t for t in self.kept}
        lock = threading.Lock()
        running: set[str] = set()
        names = [t.trial_name for t in self.kept] + [trial.name for trial in self.trials]

        def write_result(finished_at: str | None) -> JobResult:
            with lock:
                in_order = [finished[name] for name in names if name in finished]
                result = JobResult.from_trials(
                    self.name,
                    started_at,
                    finished_at,
                    len(names),
                    in_order,
                    job_id=job_id,
                    n_running=len(running - finished.keys()),
                )
                write_json(self.paths.result_path, result.to_dict())
            return result

        def started(name: str) -> None:
            with lock:
                running.add(name)

        planned = {trial.name: trial for trial in self.trials}

        def finish(trial: TrialResult) -> TrialResult:
            state = planned[trial.trial_name].calibration if trial.trial_name in planned else None
            if state is not None:  # (the trial's own result.json says it too)
                trial = dataclasses.replace(trial, calibration=state.to_dict())
                write_json(planned[trial.trial_name].trial_dir / "result.json", trial.to_dict())
            with lock:
                finished[trial.trial_name] = trial
                running.discard(trial.trial_name)
                self.finished.append(trial)
            return trial

        write_result(None)
        job = JobRun(self.agent_spec, self.settings, self.hide, job_id, self.agent_kwargs)
        refused = [t for t in self.trials if t.calibration is not None and t.calibration.state == "not-calibrated"]
        runs = [t for t in self.trials if t not in refused]
        try:
            for planned_trial in refused:  # nothing of them starts: their error, here
                state = planned_trial.calibration
                assert state is not None
                trial = finish(
                    run_trial(
                        planned_trial.task,
                        self.agent_spec,
                        planned_trial.trial_dir,
                        settings=self.settings,
                        hide=list(self.hide),
                        source=planned_trial.source,
                        job_id=job_id,
                        agent_kwargs=self.agent_kwargs,
                        refusal=TaskNotCalibrated(f"task {planned_trial.task.name} is not calibrated: {state.reason}"),
                    )
                )
                write_result(None)
                if progress is not None:
                    progress(trial)
            attempts: dict[str, int] = {}
            again: list[PlannedTrial] = []

            def retried(trial: TrialResult) -> bool:
                """Whether this errored attempt runs again (then it is not the trial's result)."""
                error = trial.exception_info
                done = attempts.get(trial.trial_name, 0)
                if error is None or done >= self.retry.max_retries or trial.trial_name not in planned:
                    return False
                if not self.retry.retryable(error.exception_type, error.exception_message):
                    return False
                attempts[trial.trial_name] = done + 1
                again.append(planned[trial.trial_name])
                with lock:
                    running.discard(trial.trial_name)
                return True

            batch, round_ = runs, 0
            while batch:
                for trial in self.scheduler.run(job, batch, started):
                    if retried(trial):
                        continue
                    trial = finish(trial)
                    write_result(None)
                    if progress is not None:
                        progress(trial)
                batch, again, round_ = again, [], round_ + 1
                if batch:
                    time.sleep(self.retry.wait(round_))
                    for planned_trial in batch:  # (Harbor removes the failed attempt's folder too)
                        remove_tree(planned_trial.trial_dir)
        except BaseException:
            for trial in self.scheduler.stop():  # running trials stop at once and write their results
                finish(trial)
            raise
        finally:
            result = write_result(utc_now())
        return result


def prepare_job(
    task_paths: Sequence[str | os.PathLike[str]],
    agent_spec: str,
    *,
    jobs_dir: str | os.PathLike[str],
    job_name: str | None = None,
    concurrency: int = 4,
    settings: EpisodeSettings | None = None,
    image_progress: Progress = NO_PROGRESS,
    build_progress: Callable[[str, StepReport, bool], None] | None = None,
    scheduler: TrialScheduler | None = None,
    calibration: str = "auto",
    calibration_store: CalibrationStore | None = None,
    n_attempts: int = 1,
    include_tasks: Sequence[str] = (),
    exclude_tasks: Sequence[str] = (),
    retry: RetryPolicy | None = None,
    agent_kwargs: dict[str, Any] | None = None,
) -> PreparedJob:
    """Everything of :func:`run_job` before its trials: the input checked, the job's folder
    made, each task's system chosen once (fetched, or built with its log in the job's
    folder). Bad input raises before anything is made; an image that cannot be had with
    ``--image-source prebuilt`` raises after, and the job's folder is removed again.
    ``n_attempts``: trials per task (Harbor's ``-k``); ``include_tasks``/``exclude_tasks``:
    shell patterns of task names to keep or leave out (Harbor's ``-i``/``-x``); ``retry``:
    which errored trials run again (:mod:`.retry`); ``agent_kwargs``: the agent's
    constructor's arguments (Harbor's ``--agent-kwarg``)."""
    settings = settings or EpisodeSettings()
    retry = retry or RetryPolicy()
    if isinstance(n_attempts, bool) or not isinstance(n_attempts, int) or n_attempts < 1:
        raise PolicyError(f"--n-attempts {n_attempts!r} is not a positive integer")
    for given in task_paths:
        if not os.path.exists(given) and DATASET_NAME.fullmatch(str(given)):
            raise PolicyError(
                f"{str(given)!r} looks like a Harbor dataset name, and sequester runs task folders: get the tasks "
                f"as a folder (`harbor datasets download {given}` with Harbor, or a clone of the dataset's "
                "repository, e.g. https://github.com/laude-institute/terminal-bench-2), then give that folder"
            )
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise PolicyError(f"concurrency {concurrency!r} is not a positive integer")
    if calibration not in CALIBRATION_MODES:
        raise PolicyError(f"calibration {calibration!r} is not one of {', '.join(CALIBRATION_MODES)}")
    tasks = find_tasks(task_paths)
    if not tasks:
        raise PolicyError("no tasks given")
    tasks = filter_tasks(tasks, include_tasks, exclude_tasks)
    agent_kwargs = dict(agent_kwargs or {})
    load_agent(agent_spec, agent_kwargs)  # a bad spec (or kwargs) fails here, before any folder is made
    scheduler = scheduler or LocalScheduler(concurrency)
    job_name = default_job_name() if job_name is None else job_name
    try:
        check_name(job_name, "job name")
    except ValueError as exc:
        raise PolicyError(str(exc)) from None
    jobs_root = Path(jobs_dir).resolve()
    for task in tasks:
        if jobs_root == task.path.resolve() or task.path.resolve() in jobs_root.parents:
            raise PolicyError(
                f"jobs folder {str(jobs_root)!r} is inside the task {str(task.path)!r}, which a job only reads"
            )
    jobs_root.mkdir(parents=True, exist_ok=True)
    paths = JobPaths(jobs_root / job_name)
    try:
        paths.root.mkdir()
    except FileExistsError:
        raise PolicyError(f"job {job_name!r}: {paths.root} already exists; choose another job name") from None
    # The tasks' systems, once, before any trial: an engine (docker backend) pulls and
    # builds its own images, a cluster's nodes theirs.
    images: dict[Path, ImagePlan] = {}
    if settings.backend == "local" and scheduler.runs_here:
        try:
            images = choose_job_images(
                tasks, settings, log_path=paths.build_log, progress=image_progress, on_step=build_progress
            )
        except BaseException:
            remove_tree(paths.root)
            raise
    # Each task's calibration on the system chosen for it (see .calibrate): "required"
    # calibrates the tasks without a record first, in jobs of their own beside this one.
    try:
        states = calibration_states(tasks, images, settings, mode=calibration, store=calibration_store)
        missing = [t for t in tasks if states[t.path].state == "uncalibrated"]
        if calibration == "required" and missing:
            calibrate_tasks(
                [t.path for t in missing],
                jobs_dir=jobs_root,
                settings=settings,
                concurrency=concurrency,
                store=calibration_store,
                name=f"{job_name}__calibration",
                scheduler=scheduler if not scheduler.runs_here else None,
            )
            states = calibration_states(tasks, images, settings, mode=calibration, store=calibration_store)
    except BaseException:
        remove_tree(paths.root)
        raise
    hide = (*(task.path for task in tasks), jobs_root)
    datasets, sources = _datasets(task_paths, tasks)
    config = job_config(
        job_name, jobs_root, agent_spec, concurrency, tasks, datasets, sources, settings, None, agent_kwargs
    )
    config.update(
        n_attempts=n_attempts,
        retry=retry.to_dict(),
        include_tasks=list(include_tasks),
        exclude_tasks=list(exclude_tasks),
        calibration=calibration,
    )
    trials = [
        PlannedTrial(name, task, paths.trial_dir(name), sources[task.name], images.get(task.path), states[task.path])
        for name, task in _plan(tasks, n_attempts)
    ]
    return PreparedJob(
        job_name,
        paths,
        agent_spec,
        settings,
        scheduler,
        trials,
        hide,
        {**config, "scheduler": scheduler.describe()},
        retry=retry,
        agent_kwargs=agent_kwargs,
    )


def prepare_resume(
    job: StoredJob,
    *,
    scheduler: TrialScheduler | None = None,
    image_progress: Progress = NO_PROGRESS,
    build_progress: Callable[[str, StepReport, bool], None] | None = None,
    calibration_store: CalibrationStore | None = None,
) -> PreparedJob:
    """An interrupted job (:func:`~.resume.read_job`) ready to run the trials it lacks: its
    tasks found again where they were (else bad input), the trial folders cut off mid-run
    removed, each task's system chosen once, the finished trials kept as they are."""
    tasks = filter_tasks(find_tasks(job.task_paths), job.include, job.exclude) if job.task_paths else []
    if [t.name for t in tasks] != job.task_names:
        raise PolicyError(
            f"--resume {str(job.root)!r}: its tasks are no longer what they were "
            f"(then {job.task_names}, now {[t.name for t in tasks]} in {job.task_paths})"
        )
    settings = job.settings
    scheduler = scheduler or LocalScheduler(job.concurrency)
    remove_unfinished(job)
    missing = missing_trials(job)
    todo = [t for t in tasks if missing[t.name] > 0]
    paths = JobPaths(job.root)
    images: dict[Path, ImagePlan] = {}
    if settings.backend == "local" and scheduler.runs_here and todo:
        images = choose_job_images(
            todo, settings, log_path=paths.build_log, progress=image_progress, on_step=build_progress
        )
    states = calibration_states(todo, images, settings, mode=job.calibration, store=calibration_store)
    sources = _datasets(job.task_paths, tasks)[1]
    trials = [
        PlannedTrial(name, task, paths.trial_dir(name), sources[task.name], images.get(task.path), states[task.path])
        for task in todo
        for name, _ in _plan([task], missing[task.name])
    ]
    hide = (*(task.path for task in tasks), job.root.parent)
    return PreparedJob(
        job.root.name,
        paths,
        job.agent_spec,
        settings,
        scheduler,
        trials,
        hide,
        {**job.config, "scheduler": scheduler.describe(), "resumed_at": utc_now()},
        retry=job.retry,
        agent_kwargs=job.agent_kwargs,
        kept=job.kept,
        started_at=str(job.config["started_at"]) if job.config.get("started_at") else None,
    )


DATASET_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?@[\w.-]+")


def filter_tasks(tasks: list[Task], include: Sequence[str], exclude: Sequence[str]) -> list[Task]:
    """The tasks whose name matches one of ``include`` (shell patterns; none: every task)
    and none of ``exclude``, in order; none left is bad input. Pure."""
    kept = [
        t
        for t in tasks
        if (not include or any(fnmatch.fnmatchcase(t.name, p) for p in include))
        and not any(fnmatch.fnmatchcase(t.name, p) for p in exclude)
    ]
    if not kept:
        raise PolicyError(
            f"no task of the {len(tasks)} given is left by --include-task-name {list(include)} "
            f"--exclude-task-name {list(exclude)}"
        )
    return kept


def job_config(
    job_name: str,
    jobs_root: Path,
    agent_spec: str,
    concurrency: int,
    tasks: list[Task],
    datasets: list[Path],
    sources: dict[str, str | None],
    settings: EpisodeSettings,
    started_at: str | None,
    agent_kwargs: dict[str, Any] | None = None,
) -> dict[str, object]:
    """The job's ``config.json``: Harbor's ``JobConfig`` (``agents``, ``n_concurrent_trials``,
    each folder of tasks as a local dataset and each task given by itself under
    ``tasks``), plus sequester's ``settings``, the exact ``task_names`` in order and the
    ``agent_spec`` as given."""
    return {
        "schema_version": 1,
        "job_name": job_name,
        "jobs_dir": str(jobs_root),
        "n_attempts": 1,
        "n_concurrent_trials": concurrency,
        "agents": [agent_config(agent_spec, load_agent(agent_spec, agent_kwargs), agent_kwargs)],
        "environment": {"import_path": ENVIRONMENT_IMPORT_PATHS[settings.backend]},
        "datasets": [{"path": str(folder)} for folder in datasets],
        "tasks": [task_config(t.path, None) for t in tasks if sources[t.name] is None],
        "agent_spec": agent_spec,
        "task_names": [t.name for t in tasks],
        "settings": settings_to_dict(settings),
        "started_at": started_at,
    }


def _datasets(
    task_paths: Sequence[str | os.PathLike[str]], tasks: list[Task]
) -> tuple[list[Path], dict[str, str | None]]:
    """The folders of tasks among ``task_paths`` (Harbor's local datasets) and, for each
    task, the name of the one it came from (``None``: the task was given by itself)."""
    given = [Path(os.path.abspath(p)) for p in task_paths]
    folders = [p for p in dict.fromkeys(given) if not looks_like_task(p)]
    sources: dict[str, str | None] = {}
    for task in tasks:
        path = Path(os.path.abspath(task.path))
        sources[task.name] = path.parent.name if path not in given and path.parent in folders else None
    return folders, sources


def _plan(tasks: list[Task], n_attempts: int = 1) -> list[tuple[str, Task]]:
    """``n_attempts`` trials of each task, each with a unique name, in the tasks' order."""
    names: set[str] = set()
    planned = []
    for task in (t for t in tasks for _ in range(n_attempts)):
        name = new_trial_name(task.name)
        while name in names:
            name = new_trial_name(task.name)
        names.add(name)
        planned.append((name, task))
    return planned


def calibrate_tasks(
    task_paths: Sequence[str | os.PathLike[str]],
    *,
    jobs_dir: str | os.PathLike[str],
    settings: EpisodeSettings,
    repeats: int = 1,
    concurrency: int = 4,
    store: CalibrationStore | None = None,
    name: str | None = None,
    scheduler: TrialScheduler | None = None,
    progress: Callable[[TrialResult], None] | None = None,
    **job_options: object,
) -> list[tuple[CalibrationRecord, CalibrationState]]:
    """Run ``oracle`` and ``nop`` ``repeats`` times on each task of ``task_paths`` (jobs
    ``NAME-oracle-1``, ``NAME-nop-1``, ... in ``jobs_dir``), keep each task's record under
    its key (see :mod:`.calibrate`) and return it with the state it gives."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise PolicyError(f"repeats {repeats!r} is not a positive integer")
    store = store or default_store()
    stamp = name or "calibration__" + default_job_name()
    results: dict[Path, dict[str, list[TrialResult]]] = {}
    keys: dict[Path, CalibrationKey] = {}
    tasks: dict[Path, Task] = {}
    jobs: list[str] = []
    for i in range(1, repeats + 1):
        for agent in ("oracle", "nop"):
            prepared = prepare_job(
                task_paths,
                agent,
                jobs_dir=jobs_dir,
                job_name=f"{stamp}-{agent}-{i}",
                concurrency=concurrency,
                settings=settings,
                scheduler=scheduler,
                calibration="off",
                **job_options,  # type: ignore[arg-type]
            )
            jobs.append(str(prepared.paths.root))
            for trial in prepared.trials:
                tasks.setdefault(trial.task.path, trial.task)
                keys.setdefault(trial.task.path, task_key(trial.task, trial.image, settings))
            prepared.run(progress)
            by_name = {t.trial_name: t for t in prepared.finished}
            for trial in prepared.trials:
                if trial.name in by_name:
                    results.setdefault(trial.task.path, {}).setdefault(agent, []).append(by_name[trial.name])
    out = []
    for path, task in tasks.items():
        record = record_of(task, keys[path], results.get(path, {}), repeats, jobs)
        store.put(record)
        out.append((record, calibration_state_for(record, record.key, mode="auto")))
    return out
