"""One trial: one agent on one task, in its own episode, with everything it did kept on disk.

The template (as in Harbor's trial): set up the environment (``Environment.start`` of the
backend's, see :mod:`sequester.environments`), run the agent, run the verifier, and,
whatever happened, close the episode and write ``result.json``. Each phase is timed. The
agent gets the episode through a recording proxy (:mod:`.agent_view`), so every command
it ran is in ``agent/commands.jsonl`` with its output (and in Harbor's
``agent/command-N/``), and it cannot reset, evaluate or close the episode itself: those
steps are the trial's. What the agent prints goes to ``trial.log``.

A trial never raises for what happens inside it (a broken task, a crashing agent, a
verifier without a verdict): that is its ``exception_info``. Only an interrupt
(``KeyboardInterrupt``, ``SystemExit``) propagates, after ``result.json`` is written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import secrets
import string
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from sequester.agents import load_agent
from sequester.environments import Environment, UnsupportedByBackend, missing_capabilities, open_environment
from sequester.environments.archive import unpack
from sequester.environments.base import wanted_verifier_env
from sequester.environments.settings import EpisodeSettings
from sequester.environments.verdict import VerifierError
from sequester.errors import EpisodeError, ImageError, SandboxError
from sequester.jobs.agent_view import RecordingEnvironment
from sequester.jobs.cancel import Cancellation, TrialCancelled
from sequester.jobs.capture import capture_thread_output
from sequester.jobs.harbor import ENVIRONMENT_IMPORT_PATHS, agent_config, agent_info, task_checksum, task_config
from sequester.jobs.images import ImagePlan
from sequester.jobs.paths import TEST_STDOUT, TrialPaths, own_agent_file
from sequester.jobs.results import ExceptionInfo, TimingInfo, TrialResult, VerifierOutcome, utc_now
from sequester.tasks import Task

if TYPE_CHECKING:
    from sequester.images.choose import Choice

__all__ = ["run_trial", "trial_config", "new_trial_name", "settings_to_dict", "write_json"]

log = logging.getLogger("sequester.jobs")

_ALPHABET = string.ascii_lowercase + string.digits


class _StartsOnImage(Protocol):
    """A backend on this machine's image store (the local one): its ``start`` also takes
    the system the job chose (see :meth:`~sequester.environments.base.Environment.start`)."""

    def start(self, task: Task, *, image: Choice) -> object: ...


def new_trial_name(task_name: str) -> str:
    """``<task>__<6 random lowercase letters and digits>``: unique enough to run a task
    many times into one job folder, readable enough to find it by task."""
    return f"{task_name}__{''.join(secrets.choice(_ALPHABET) for _ in range(6))}"


def settings_to_dict(settings: Any) -> dict[str, Any]:
    """A settings dataclass (nested ones too: ``[images]``) as JSON-ready data."""

    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value):
            return settings_to_dict(value)
        if isinstance(value, Path):
            return str(value)
        if isinstance(value, (tuple, list)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return {f.name: plain(getattr(settings, f.name)) for f in dataclasses.fields(settings)}


def write_json(path: Path, data: object) -> None:
    """Write ``path`` whole or not at all (a reader never sees half a result)."""
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(temp, path)


class _TrialLog:
    """``trial.log``: the trial's own steps, plus every log record emitted on its thread
    while it runs (the episode's, the agent's), so concurrent trials do not mix."""

    def __init__(self, path: Path):
        self._file = path.open("a", encoding="utf-8")
        self._handler = logging.StreamHandler(self._file)
        self._handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        thread = threading.get_ident()
        self._handler.addFilter(lambda record: record.thread == thread)

    def write(self, message: str) -> None:
        self._file.write(f"{utc_now()} {message}\n")
        self._file.flush()

    def output(self, stream: str, text: str) -> None:
        """What the agent printed (``print()``, ``sys.stderr.write``) on this thread."""
        for line in text.splitlines():
            self._file.write(f"{utc_now()} agent {stream}: {line}\n")
        self._file.flush()

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        root = logging.getLogger()
        root.addHandler(self._handler)
        try:
            with capture_thread_output(self.output):
                yield
        finally:
            root.removeHandler(self._handler)
            self._file.close()


class _Phases:
    """Times the phases of a trial; a phase cut short by an exception still gets its end."""

    def __init__(self) -> None:
        self.timings: dict[str, TimingInfo] = {}

    @contextlib.contextmanager
    def __call__(self, name: str, trial_log: _TrialLog) -> Iterator[None]:
        started = utc_now()
        self.timings[name] = TimingInfo(started, None)
        trial_log.write(f"{name}: started")
        try:
            yield
        finally:
            self.timings[name] = TimingInfo(started, utc_now())
            trial_log.write(f"{name}: ended after {self.timings[name].duration_sec:.2f} s")

    def get(self, name: str) -> TimingInfo:
        return self.timings.get(name, TimingInfo())


def trial_config(
    task: Task,
    agent_spec: str,
    trial_dir: Path,
    *,
    settings: EpisodeSettings,
    hide: list[Path],
    source: str | None = None,
    job_id: str | None = None,
    agent: object | None = None,
    agent_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The trial's ``config.json``: Harbor's ``TrialConfig`` (the task by ``path``, the
    agent as an ``AgentConfig``, the job's id), plus sequester's ``settings`` and ``hide``."""
    return {
        "schema_version": 1,
        "task": task_config(task.path, source),
        "trial_name": trial_dir.name,
        "trials_dir": str(trial_dir.parent),
        "agent": agent_config(agent_spec, agent, agent_kwargs),
        "environment": {"import_path": ENVIRONMENT_IMPORT_PATHS[settings.backend]},
        "job_id": job_id,
        "settings": settings_to_dict(settings),
        "hide": [str(p) for p in hide],
    }


def run_trial(
    task: Task,
    agent_spec: str,
    trial_dir: Path,
    *,
    settings: EpisodeSettings,
    hide: list[Path],
    cancel: Cancellation | None = None,
    source: str | None = None,
    job_id: str | None = None,
    open_env: Callable[..., Environment] = open_environment,
    image: ImagePlan | None = None,
    refusal: Exception | None = None,
    agent_kwargs: dict[str, Any] | None = None,
) -> TrialResult:
    """Run ``agent_spec`` (see :func:`sequester.agents.load_agent`) on ``task`` in a new
    episode that also hides ``hide``; keep everything in ``trial_dir`` (which must not
    exist; its name is the trial's name). ``source`` is the dataset the task belongs to
    and ``job_id`` the job's id (both for Harbor's grouping). ``open_env``: makes the
    environment (``settings.backend``'s; tests pass a fake). ``image``: the system the
    job chose for the task (:mod:`.images`), or why it cannot be had (the trial's error);
    None: the backend chooses. ``refusal``: why the trial must not run (a task that is not
    calibrated): its error, before anything starts. ``agent_kwargs``: the agent's
    constructor's arguments. Returns the result it wrote to ``result.json``."""
    paths = TrialPaths(trial_dir)
    paths.mkdir()
    started_at = utc_now()
    paths.commands_path.touch()
    paths.agent_log_path.touch()
    # (written again once the agent is loaded: its name and model in Harbor's AgentConfig)
    config_of = functools.partial(
        trial_config,
        task,
        agent_spec,
        trial_dir,
        settings=settings,
        hide=hide,
        source=source,
        job_id=job_id,
        agent_kwargs=agent_kwargs,
    )
    config = config_of()
    write_json(paths.config_path, config)
    checksum = task_checksum(task.path)
    trial_log = _TrialLog(paths.trial_log_path)
    phase = _Phases()
    info: dict[str, Any] = agent_info(agent_spec, None)
    verdict: VerifierOutcome | None = None
    error: ExceptionInfo | None = None
    tampering: list[str] = []
    notes: list[str] = []
    episode: Environment | None = None
    system: dict[str, Any] | None = None
    network: dict[str, Any] | None = None
    mode = wanted_verifier_env(task, settings)  # the backend's default, once it is known (below)
    with trial_log.capture():
        try:
            agent = load_agent(agent_spec, agent_kwargs)
            info = agent_info(agent_spec, agent)
            config = config_of(agent=agent)
            write_json(paths.config_path, config)
            trial_log.write(f"task {task.name} ({task.path}), agent {info['name']}")
            with contextlib.ExitStack() as watch:
                with phase("environment_setup", trial_log):
                    if cancel is not None:
                        cancel.check()
                    if refusal is not None:
                        raise refusal
                    if isinstance(image, ImageError):
                        raise image
                    episode = open_env(settings, hide=hide)
                    # What the trial needs of its backend, before anything starts: a trial
                    # that asks for a separate verifier or a frozen agent never gets less.
                    mode = wanted_verifier_env(task, settings, default=episode.capabilities.default_verifier_env)
                    missing = missing_capabilities(episode.capabilities, task, settings)
                    if missing:
                        raise UnsupportedByBackend("; ".join(missing))
                    # (a backend that chooses its own system is never passed one)
                    if image is None:
                        episode.start(task)
                    else:  # a job chooses images only for the local backend (jobs/job.py)
                        cast(_StartsOnImage, episode).start(task, image=image)
                    system = episode.system
                    if cancel is not None:
                        watch.enter_context(cancel.watching(episode))
                        cancel.check()
                with phase("agent_execution", trial_log):
                    try:
                        agent.run(episode.instruction, RecordingEnvironment(episode, paths, cancel))  # type: ignore[arg-type]
                    finally:
                        notes += _keep_trajectory(agent, paths)
                        notes += _keep_agent_logs(episode, paths)
                    if cancel is not None:
                        cancel.check()
                with phase("verifier", trial_log):
                    verdict, more = _verify(episode, paths, tampering)
                    notes += more
                trial_log.write(f"rewards {verdict.rewards}" + (f", tampering: {tampering}" if tampering else ""))
        except BaseException as exc:
            if cancel is not None and cancel.cancelled and not isinstance(exc, TrialCancelled):
                stopped = TrialCancelled(f"the job was interrupted ({type(exc).__name__}: {exc})")
                error = ExceptionInfo(
                    type(stopped).__name__, str(stopped), "".join(traceback.format_exception(exc)), utc_now()
                )
            else:
                error = ExceptionInfo.from_exception(exc)
            trial_log.write(f"error: {error.exception_traceback}")
            if not isinstance(exc, Exception):
                raise
        finally:
            if episode is not None:
                notes = _episode_notes(episode) + notes
                try:
                    episode.close()
                except Exception as exc:  # noqa: BLE001 - the verdict stands; say so
                    notes.append(f"closing the episode failed: {exc}")
                    log.warning("%s: closing the episode failed: %s", trial_dir.name, exc)
                network = getattr(episode, "network", None)  # (once closed: all it did)
            result = TrialResult(
                task_name=task.name,
                trial_name=trial_dir.name,
                trial_uri=trial_dir.resolve().as_uri(),
                agent_info=info,
                verifier_result=verdict if error is None else None,
                exception_info=error,
                started_at=started_at,
                finished_at=utc_now(),
                environment_setup=phase.get("environment_setup"),
                agent_execution=phase.get("agent_execution"),
                verifier=phase.get("verifier"),
                tampering=tampering,
                notes=notes,
                source=source,
                task_path=str(task.path),
                task_checksum=checksum,
                config=config,
                verifier_environment_mode=mode if "verifier" in phase.timings else None,
                system=system,
                network=network,
            )
            write_json(paths.result_path, result.to_dict())
    return result


def _keep_trajectory(agent: object, paths: TrialPaths) -> list[str]:
    """An agent's own trajectory (an ATIF document: its ``trajectory`` attribute, a
    mapping or a method returning one), written to ``agent/trajectory.json`` where Harbor's
    viewer reads it. A trajectory that is not JSON is left out, with a note."""
    trajectory = getattr(agent, "trajectory", None)
    try:
        if callable(trajectory):
            trajectory = trajectory()
        if trajectory is None:
            return []
        if not isinstance(trajectory, dict):
            raise TypeError(f"a {type(trajectory).__name__}, not a mapping")
        write_json(paths.trajectory_path, trajectory)
    except Exception as exc:  # noqa: BLE001 - the agent's own object: say why it is not kept
        return [f"the agent's trajectory was not kept: {type(exc).__name__}: {exc}"]
    return []


def _keep_agent_logs(episode: Environment, paths: TrialPaths) -> list[str]:
    """What the agent left in ``/logs/agent`` and ``/logs/artifacts`` (its to write, as
    under Harbor), kept in the trial's ``agent/`` and ``artifacts/`` folders as Harbor keeps
    them; never over the trial's own files in ``agent/``. Bounded (see
    :mod:`sequester.environments.archive`); what is not kept is a note."""
    notes = []
    for folder, dest, own in (
        ("/logs/agent", paths.agent_dir, own_agent_file),
        ("/logs/artifacts", paths.artifacts_dir, None),
    ):
        try:
            data = episode.read_dir(folder)
        except (EpisodeError, SandboxError, OSError) as exc:
            notes.append(f"{folder} was not kept: {exc}")
            continue
        notes += [f"{folder}: {n}" for n in unpack(data, dest, skip=own)]
    return notes


def _verify(episode: Environment, paths: TrialPaths, tampering: list[str]) -> tuple[VerifierOutcome, list[str]]:
    """Run the verifier; keep what it printed and left (and the tampering found), also when
    it gives no verdict."""
    try:
        found = episode.evaluate()
    except VerifierError as exc:
        tampering += exc.tampering
        _keep(paths, exc.output, exc.files)
        raise
    tampering += found.tampering
    notes = _keep(paths, found.output, found.files)
    if found.zero_reason:
        notes.append(f"reward 0 for the agent: {found.zero_reason}")
    notes += found.notes
    if found.frozen:
        notes.append(f"the agent's processes were frozen while the verifier ran ({found.frozen})")
    return VerifierOutcome(dict(found.rewards)), notes


def _keep(paths: TrialPaths, output: str, files: dict[str, bytes]) -> list[str]:
    paths.test_stdout_path.write_text(output, encoding="utf-8")
    notes = []
    for name, data in files.items():
        if name == TEST_STDOUT:
            notes.append(f"the verifier's own /logs/verifier/{TEST_STDOUT} was not kept (the captured output was)")
            continue
        try:
            target = paths.verifier_file(name)
        except ValueError as exc:
            notes.append(f"not kept: {exc}")
            continue
        target.write_bytes(data)
    return notes


def _episode_notes(episode: Environment) -> list[str]:
    try:
        return episode.notes
    except EpisodeError:  # the episode never started
        return []
