"""The one interface the job runner and the server talk to, whatever runs the episode.

An :class:`Environment` is one agent's episode on one task: started on a task, driven with
``exec`` and file calls, scored with ``evaluate``, closed. Backends: ``local`` (namespaces
on this host: :class:`sequester.environments.local.episode.Episode`), ``docker`` (a Docker-API
engine: :mod:`sequester.environments.docker`), and :mod:`.fake` for unit tests.

Compared with Harbor's ``BaseEnvironment`` (start/stop, exec, upload/download file and
dir, plus build and compose plumbing), this keeps the calls an agent and a verifier need
and adds what Harbor leaves implicit: :class:`Capabilities`, which a backend declares and
the runner checks *before* anything starts (:func:`missing_capabilities`), so a trial
that asks for a separate verifier environment, a frozen agent, GPUs or Docker Compose
services never silently gets less.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from sequester.errors import SequesterError

if TYPE_CHECKING:
    from sequester.environments.settings import EpisodeSettings
    from sequester.environments.verdict import VerifierResult
    from sequester.tasks import Task
    from sequester.tasks.task_toml import Artifact

__all__ = [
    "Capabilities",
    "Environment",
    "ExecResult",
    "UnsupportedByBackend",
    "missing_capabilities",
    "separate_artifacts",
    "wanted_verifier_env",
    "wants_freeze",
]


@dataclass(frozen=True)
class ExecResult:
    """What ``environment.exec(command)`` returns, whatever the backend.

    ``stdout``, ``stderr``: the command's output, decoded as UTF-8 (undecodable bytes as
    U+FFFD), each capped at ``output_bytes`` (see :class:`_Capture`); ``exit_code``: its
    status (``None`` when the shell itself went away); ``timed_out``: it ran over its
    timeout and was interrupted (``^C``), then killed; ``duration``: seconds; ``note``: what
    else happened (the cap cut the output, the shell was restarted), else ``""``.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    duration: float
    note: str = ""

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def to_dict(self) -> dict[str, object]:
        return {
            "stdout": self.stdout,
            "stderr": self.stderr,
            "exit_code": self.exit_code,
            "timed_out": self.timed_out,
            "duration": self.duration,
            "note": self.note,
        }


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; the runner refuses a trial that needs more (see module doc)."""

    backend: str
    separate_verifier: bool  # the tests can run in a fresh environment from the pristine system
    shared_verifier: bool  # the tests can run in the agent's own environment
    freeze: bool  # every agent process can be stopped while the verdict is made
    trusted_runner: bool  # the tests' interpreter comes from outside what the agent could write
    network_policies: frozenset[str] = frozenset({"none", "public"})
    default_verifier_env: str = "shared"  # (no longer decides: see wanted_verifier_env; kept for callers)
    compose: bool = False  # starts a task's Docker Compose services (environment/docker-compose.yaml)
    gpus: int | None = 0  # NVIDIA GPUs it can give a trial here; None: its engine says when the container starts
    gpu_source: str = ""  # where those GPUs come from, or why there are none
    # checkpoint(), rollback() and fork() of an episode on an image (the local backend's
    # sealed layers); a Docker-API engine's containers have no layer a client can seal.
    checkpoint: bool = False


class UnsupportedByBackend(SequesterError):
    """A trial asks for something its backend cannot do (the operator's set-up, not the agent's)."""


class Environment(Protocol):
    """One episode of one agent on one task (see module doc). Not thread-safe, but
    :meth:`abort` may be called from any thread."""

    settings: EpisodeSettings

    @property
    def capabilities(self) -> Capabilities: ...

    def start(self, task: Task | str | os.PathLike[str]) -> Environment:
        """Start on ``task`` (replacing an earlier episode); the environment itself. A
        backend that runs on this machine's image store (the local one) also takes
        ``image=`` a :class:`~sequester.images.choose.Choice` made for it, so that a job
        chooses each task's system once."""

    @property
    def task(self) -> Task: ...

    @property
    def instruction(self) -> str: ...

    @property
    def workdir(self) -> str: ...

    @property
    def notes(self) -> list[str]: ...

    @property
    def system(self) -> dict[str, object]:
        """What the episode runs on, for the trial's record."""

    def exec(self, command: str, timeout: float | None = None) -> ExecResult: ...

    def write_file(self, path: str, content: bytes | str, mode: int = 0o644) -> None: ...

    def read_file(self, path: str) -> bytes: ...

    def upload_dir(self, source: str | os.PathLike[str], dest: str) -> None: ...

    def read_dir(self, path: str, limit: int = ...) -> bytes:
        """A tar of the folder ``path`` of the agent's view, names relative to it (see
        :func:`~sequester.environments.archive.reroot`); :class:`~sequester.errors.EpisodeError`
        when it is no folder or its tar is larger than ``limit`` bytes."""

    def evaluate(self, *, freeze: bool | None = None, verifier_env: str | None = None) -> VerifierResult:
        """The task's pristine tests, scored; agent-caused failures are a 0 with a reason,
        :class:`~sequester.environments.verdict.VerifierCouldNotRun` only for what it cannot cause."""

    def abort(self) -> None: ...

    def close(self) -> None: ...


def timed_task(task: Task, settings: EpisodeSettings) -> Task:
    """``task`` with its ``[agent]`` and ``[verifier]`` ``timeout_sec`` scaled by the
    settings' multipliers (Harbor's ``--agent-timeout-multiplier`` and
    ``--verifier-timeout-multiplier``), as a backend's episode keeps it once started (a
    separate verifier's environment takes the started episode's task as it is). Pure."""
    a, v = settings.agent_timeout_multiplier, settings.verifier_timeout_multiplier
    if a == 1 and v == 1:
        return task
    agent = task.config.agent
    if agent.timeout_sec is not None:
        agent = dataclasses.replace(agent, timeout_sec=agent.timeout_sec * a)
    verifier = dataclasses.replace(task.config.verifier, timeout_sec=task.config.verifier.timeout_sec * v)
    return dataclasses.replace(task, config=dataclasses.replace(task.config, agent=agent, verifier=verifier))


def wanted_verifier_env(
    task: Task, settings: EpisodeSettings, verifier_env: str | None = None, *, default: str = "shared"
) -> str:
    """``"shared"`` or ``"separate"``: the call's, else the settings', else the task's, else
    the one its tests can pass in, in every backend: ``separate`` for a task that declares
    artifacts (its tests check those), ``shared`` for one that declares none (every TB2
    task: its tests check the agent's live system, a service it started included).
    ``default`` is no longer consulted (kept for callers that still pass a backend's)."""
    declared = "separate" if task.config.artifacts else "shared"
    mode = verifier_env or settings.verifier_env or task.config.verifier.environment_mode or declared
    if mode not in ("shared", "separate"):
        raise ValueError(f"verifier_env: {mode!r} is not 'shared' or 'separate'")
    return mode


def separate_artifacts(task: Task, workdir: str) -> tuple[tuple[Artifact, ...], str | None]:
    """What a separate verifier environment gets of the agent's final state, and a note:
    the task's declared ``artifacts``, else its working directory (where Terminal-Bench
    tasks, which declare none, keep the work their tests check; without it every such
    task would score 0 in a separate environment)."""
    from sequester.tasks.task_toml import Artifact

    if task.config.artifacts:
        return tuple(task.config.artifacts), None
    if workdir in ("", "/"):
        return (), "the task declares no artifacts and works in /: the tests saw none of the agent's work"
    return (Artifact(workdir),), f"the task declares no artifacts: its working directory {workdir} was copied"


def wants_freeze(task: Task, settings: EpisodeSettings, freeze: bool | None = None) -> bool:
    """Whether the agent is to be frozen while its verdict is made: the call's, the task's, the settings'."""
    if freeze is not None:
        return freeze
    if task.config.verifier.freeze_agent is not None:
        return task.config.verifier.freeze_agent
    return settings.freeze_agent


def missing_capabilities(caps: Capabilities, task: Task, settings: EpisodeSettings) -> list[str]:
    """What ``task`` under ``settings`` needs that ``caps`` lacks, each said in a sentence."""
    missing = []
    mode = wanted_verifier_env(task, settings, default=caps.default_verifier_env)
    if mode == "separate" and not caps.separate_verifier:
        missing.append(f"the {caps.backend} backend cannot run the verifier in a separate environment")
    if mode == "shared" and not caps.shared_verifier:
        missing.append(f"the {caps.backend} backend cannot run the verifier in the agent's environment")
    if wants_freeze(task, settings) and not caps.freeze:
        missing.append(f"the {caps.backend} backend cannot freeze the agent while it is scored (freeze_agent)")
    compose = task.compose_file
    if compose is not None and not caps.compose:
        missing.append(
            f"{task.name}: {compose} asks for Docker Compose services beside the task's container, "
            f"which the {caps.backend} backend does not start"
        )
    gpus = task.config.environment.gpus
    if gpus and caps.gpus is not None and caps.gpus < gpus:
        missing.append(
            f"{task.name} asks for {gpus} GPU{'s' * (gpus != 1)} ([environment] gpus = {gpus}); the "
            f"{caps.backend} backend has {caps.gpus or 'none'} on this host: {caps.gpu_source}"
        )
    return missing
