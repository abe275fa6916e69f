"""What an agent gets of its environment in a trial: a recording proxy.

Its own calls (``exec``, ``read_file``, ``write_file``, ``upload_dir``) and a few
read-only facts, nothing else (an allowlist); every ``exec`` is kept in the trial's
folder. The proxy keeps an agent class (the operator's code) to its API; it is not a
boundary against hostile Python in the operator's process: the model's commands are
what the sandbox holds.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from sequester.environments import Environment
from sequester.environments.base import ExecResult
from sequester.errors import EpisodeError
from sequester.jobs.paths import TrialPaths
from sequester.jobs.results import utc_now

if TYPE_CHECKING:
    from sequester.jobs.cancel import Cancellation

__all__ = ["RecordingEnvironment"]


# What an agent may read of its environment; every call it may make is a method below.
# An allowlist: a backend's new method (``start`` was one) is not the agent's by default.
_AGENT_READS = frozenset({"task", "instruction", "workdir", "settings", "system", "notes", "capabilities"})


class RecordingEnvironment:
    """What the agent gets instead of the environment: its calls (``exec``, ``read_file``,
    ``write_file``, ``upload_dir``) and :data:`_AGENT_READS`, nothing else. Each ``exec``
    is appended to ``agent/commands.jsonl`` (and, readable, to ``agent/agent.log``);
    ``start``/``reset``/``evaluate``/``close``/``abort`` are refused: an agent that could run
    the verifier could search for the reward instead of solving the task."""

    def __init__(self, episode: Environment, paths: TrialPaths, cancel: Cancellation | None):
        self._episode, self._paths, self._cancel = episode, paths, cancel
        self._n_commands = 0

    def __getattr__(self, name: str) -> Any:
        if name not in _AGENT_READS:  # also before __init__ ran (copy, pickle), and the internals
            raise AttributeError(f"{name}: not something an agent may use of its episode")
        return getattr(self._episode, name)

    def read_file(self, path: str) -> bytes:
        return self._episode.read_file(path)

    def exec(self, command: str, timeout: float | None = None) -> ExecResult:
        if self._cancel is not None:
            self._cancel.check()
        limit = self._episode.settings.exec_timeout if timeout is None else timeout
        entry: dict[str, Any] = {"command": command, "timeout": limit, "started_at": utc_now()}
        self._transcript(f"$ {command}    # timeout {limit:g} s")
        command_dir = self._paths.command_dir(self._n_commands)
        self._n_commands += 1
        command_dir.mkdir()
        (command_dir / "command.txt").write_text(command, encoding="utf-8")
        try:
            result = self._episode.exec(command, timeout)
        except BaseException as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
            self._record(entry)
            (command_dir / "stdout.txt").write_text(f"[raised {entry['error']}]\n", encoding="utf-8")
            self._transcript(f"[raised {entry['error']}]")
            raise
        entry.update(result.to_dict())
        self._record(entry)
        (command_dir / "stdout.txt").write_text(result.stdout, encoding="utf-8")
        (command_dir / "stderr.txt").write_text(result.stderr, encoding="utf-8")
        (command_dir / "return-code.txt").write_text("timed out\n" if result.timed_out else f"{result.exit_code}\n")
        status = "timed out" if result.timed_out else f"exit {result.exit_code}"
        note = f"; {result.note}" if result.note else ""
        self._transcript(f"{result.stdout}{result.stderr}[{status}, {result.duration:.2f} s{note}]")
        return result

    def write_file(self, path: str, content: bytes | str, mode: int = 0o644) -> None:
        self._transcript(f"[write_file {path} ({len(content)} {'bytes' if isinstance(content, bytes) else 'chars'})]")
        self._episode.write_file(path, content, mode)

    def upload_dir(self, source: str | os.PathLike[str], dest: str) -> None:
        self._transcript(f"[upload_dir {source} -> {dest}]")
        self._episode.upload_dir(source, dest)

    def reset(self, *args: object, **kwargs: object) -> None:
        raise EpisodeError("an agent may not reset its episode: the trial does")

    start = reset

    def abort(self) -> None:
        raise EpisodeError("an agent may not abort its episode: the trial ends it")

    def evaluate(self, *args: object, **kwargs: object) -> None:
        raise EpisodeError("an agent may not run the verifier: the trial does, after the agent")

    def close(self) -> None:
        raise EpisodeError("an agent may not close its episode: the trial does")

    def _record(self, entry: dict[str, Any]) -> None:
        with self._paths.commands_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")

    def _transcript(self, text: str) -> None:
        with self._paths.agent_log_path.open("a", encoding="utf-8") as f:
            f.write(text if text.endswith("\n") else text + "\n")
