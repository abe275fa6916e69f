"""Inspect's ``SandboxEnvironment`` over a sequester episode: ``sandbox=("sequester", TASK_DIR)``.

Each sample gets an episode on the task (a Terminal-Bench 2 / Harbor task folder): its
system as ``sequester run`` has it (its image fetched, its Dockerfile built without a
daemon, or the host's, by the config's ``[images] source``), closed at the sample's
cleanup. Every ``exec`` is a fresh process of the episode (:meth:`Episode.run
<sequester.environments.local.episode.Episode.run>`), with the agent's restrictions; calls
may run at once (Inspect's parallel tool calls). ``TimeoutError`` past ``timeout``,
Inspect's ``OutputLimitExceededError`` past its output limit (its process group killed
there); ``timeout_retry`` is not used (a command that timed out is not run again).

The config is a task folder (a string), or :class:`SequesterSandboxConfig` (the task, a
sequester config file, the image source). The docker backend has no fresh-process exec
here: a config naming it is refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any, Literal, overload

from inspect_ai.util import (
    ExecResult,
    OutputLimitExceededError,
    SandboxEnvironment,
    SandboxEnvironmentConfigType,
    SandboxEnvironmentLimits,
    sandboxenv,
)
from pydantic import BaseModel

from sequester.environments.settings import EpisodeSettings
from sequester.errors import EpisodeError, SandboxError, SequesterError
from sequester.tasks import Task, load_task

__all__ = ["SequesterSandbox", "SequesterSandboxConfig"]


class SequesterSandboxConfig(BaseModel, frozen=True):
    """``task``: the task folder; ``config``: a sequester config file (default: the
    embedded one); ``image_source``: ``auto``, ``prebuilt``, ``dockerfile`` or ``host``."""

    task: str
    config: str | None = None
    image_source: Literal["auto", "prebuilt", "dockerfile", "host"] | None = None


def _config(config: SandboxEnvironmentConfigType | None) -> SequesterSandboxConfig:
    if isinstance(config, SequesterSandboxConfig):
        return config
    if isinstance(config, str):
        return SequesterSandboxConfig(task=config)
    raise ValueError('the sequester sandbox needs a task folder: sandbox=("sequester", "path/to/task")')


def _settings(config: SequesterSandboxConfig) -> EpisodeSettings:
    from sequester.config import load_config

    settings = load_config(config.config).episodes
    if config.image_source:
        settings = dataclasses.replace(
            settings, images=dataclasses.replace(settings.images, source=config.image_source)
        )
    if settings.backend != "local":
        raise ValueError(
            f"the sequester sandbox runs local episodes only (the config's backend is {settings.backend!r}): "
            "a Docker engine's exec is not a fresh process with the episode's restrictions"
        )
    return settings


@sandboxenv(name="sequester")
class SequesterSandbox(SandboxEnvironment):
    """One sample's episode (see the module)."""

    def __init__(self, episode: Any, task: Task) -> None:
        super().__init__()
        self.episode = episode
        self.task = task

    # -- lifecycle ----------------------------------------------------------------------

    @classmethod
    def config_deserialize(cls, config: dict[str, Any]) -> BaseModel:
        return SequesterSandboxConfig(**config)

    @classmethod
    async def task_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None) -> None:
        """The task's system fetched or built once, before any sample starts."""
        conf = _config(config)
        await asyncio.to_thread(_prepare, conf)

    @classmethod
    async def sample_init(
        cls, task_name: str, config: SandboxEnvironmentConfigType | None, metadata: dict[str, str]
    ) -> dict[str, SandboxEnvironment]:
        conf = _config(config)
        episode, task = await asyncio.to_thread(_start, conf)
        return {"default": cls(episode, task)}

    @classmethod
    async def sample_cleanup(
        cls,
        task_name: str,
        config: SandboxEnvironmentConfigType | None,
        environments: dict[str, SandboxEnvironment],
        interrupted: bool,
    ) -> None:
        for env in environments.values():
            if isinstance(env, SequesterSandbox):
                await asyncio.to_thread(env.episode.close)

    # -- commands and files -------------------------------------------------------------

    async def exec(
        self,
        cmd: list[str],
        input: str | bytes | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        user: str | None = None,
        timeout: int | None = None,
        timeout_retry: bool = True,
        concurrency: bool = True,
    ) -> ExecResult[str]:
        data = input.encode() if isinstance(input, str) else input
        limit = SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE
        try:
            r = await asyncio.to_thread(
                self.episode.run,
                list(cmd),
                input=data,
                cwd=cwd,
                env=env,
                user=user,
                timeout=float(timeout) if timeout else 24 * 3600.0,
                output_limit=limit,
            )
        except EpisodeError as exc:
            if "no such user" in str(exc):  # as docker exec -u says it
                return ExecResult(False, 126, "", f"unable to find user {user}: no matching entries in passwd file\n")
            if "/etc/passwd cannot be read" in str(exc):
                return ExecResult(False, 126, "", f"unable to find user {user}: {exc}\n")
            raise
        if r.timed_out:
            raise TimeoutError(f"Command timed out after {timeout} seconds")
        if r.note.startswith("the output passed"):
            raise OutputLimitExceededError(SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE_STR, r.stdout)
        code = r.exit_code if r.exit_code is not None else 1
        return ExecResult(code == 0, code, r.stdout, r.stderr)

    async def write_file(self, file: str, contents: str | bytes) -> None:
        data = contents.encode() if isinstance(contents, str) else contents
        try:
            await asyncio.to_thread(self.episode.write_file, file, data)
        except (SandboxError, EpisodeError) as exc:
            raise _file_error(file, exc) from exc

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    async def read_file(self, file: str, text: bool = True) -> str | bytes:
        try:
            data: bytes = await asyncio.to_thread(self.episode.read_file, file)
        except (SandboxError, EpisodeError) as exc:
            raise _file_error(file, exc) from exc
        if len(data) > SandboxEnvironmentLimits.MAX_READ_FILE_SIZE:
            raise OutputLimitExceededError(SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR, None)
        return data.decode("utf-8") if text else data

    async def evaluate(self) -> Any:
        """sequester's verdict on the episode (:func:`~sequester.inspect.scorer.task_verdict`)."""
        return await asyncio.to_thread(self.episode.evaluate)


def _prepare(conf: SequesterSandboxConfig) -> None:
    from sequester.jobs.images import choose_job_images

    task = load_task(Path(conf.task))
    plan = choose_job_images([task], _settings(conf))[task.path]
    if isinstance(plan, Exception):
        raise plan


def _start(conf: SequesterSandboxConfig) -> tuple[Any, Task]:
    from sequester.environments import open_environment
    from sequester.jobs.images import choose_job_images

    settings = _settings(conf)
    task = load_task(Path(conf.task))
    plan = choose_job_images([task], settings)[task.path]  # (chosen once: the store has it now)
    if isinstance(plan, Exception):
        raise plan
    episode = open_environment(settings)
    try:
        episode.start(task, image=plan)  # type: ignore[call-arg]
    except BaseException:
        episode.close()
        raise
    return episode, task


def _file_error(file: str, exc: SequesterError) -> Exception:
    """The exception Inspect's contract names for a file that cannot be read or written."""
    text = str(exc)
    if "No such file" in text or "FileNotFoundError" in text:
        return FileNotFoundError(f"{file}: no such file in the sandbox")
    if "Is a directory" in text or "IsADirectoryError" in text:
        return IsADirectoryError(f"{file}: is a directory")
    if "Permission denied" in text or "PermissionError" in text or "Read-only" in text:
        return PermissionError(f"{file}: {text}")
    return exc
