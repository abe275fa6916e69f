"""The on-disk layout of a job and its trials: the one place that names these files.

::

    <jobs_dir>/<job_name>/
      config.json                     Harbor's JobConfig + settings (written at start)
      result.json                     JobResult, with Harbor's stats (rewritten as trials end)
      <task>.build.log                the build log of each task whose Dockerfile was built (a file:
                                      Harbor takes every folder of a job for a trial)
      <task>__<random>/               one folder per trial
        config.json                   Harbor's TrialConfig + settings, hide
        result.json                   TrialResult (always written, also on errors)
        trial.log                     the trial's steps, the log records of its thread, what the agent printed
        agent/commands.jsonl          one JSON object per exec the agent ran
        agent/agent.log               what the agent did, readable
        agent/command-<N>/            Harbor's layout of exec N (from 0): command.txt, stdout.txt,
                                      stderr.txt, return-code.txt
        agent/trajectory.json         the agent's own ATIF trajectory, if it has one
        verifier/test-stdout.txt      what the verifier printed
        verifier/<file>               each file it left in /logs/verifier (reward.txt, ctrf.json, ...)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["TrialPaths", "JobPaths", "check_name", "own_agent_file"]

TEST_STDOUT = "test-stdout.txt"


def own_agent_file(name: str) -> bool:
    """Whether ``name`` (a first path part in ``agent/``) is one of the trial's own files
    there, which nothing the agent left in ``/logs/agent`` may replace."""
    return name in ("commands.jsonl", "agent.log", "trajectory.json") or (
        name.startswith("command-") and name[8:].isdigit()
    )


def check_name(name: str, what: str) -> str:
    """``name`` if it is usable as one folder or file name; raises ``ValueError`` naming it."""
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise ValueError(f"{what} {name!r} is not a single file name")
    return name


@dataclass(frozen=True)
class TrialPaths:
    root: Path

    @property
    def config_path(self) -> Path:
        return self.root / "config.json"

    @property
    def result_path(self) -> Path:
        return self.root / "result.json"

    def build_log(self, task_name: str) -> Path:
        return self.root / f"{check_name(task_name, 'task name')}.build.log"

    @property
    def trial_log_path(self) -> Path:
        return self.root / "trial.log"

    @property
    def agent_dir(self) -> Path:
        return self.root / "agent"

    @property
    def commands_path(self) -> Path:
        return self.agent_dir / "commands.jsonl"

    @property
    def agent_log_path(self) -> Path:
        return self.agent_dir / "agent.log"

    def command_dir(self, index: int) -> Path:
        """Harbor's folder for the agent's ``index``-th exec (from 0)."""
        return self.agent_dir / f"command-{index}"

    @property
    def trajectory_path(self) -> Path:
        return self.agent_dir / "trajectory.json"

    @property
    def artifacts_dir(self) -> Path:
        """What the agent left in ``/logs/artifacts`` (made only when it left something)."""
        return self.root / "artifacts"

    @property
    def verifier_dir(self) -> Path:
        return self.root / "verifier"

    @property
    def test_stdout_path(self) -> Path:
        return self.verifier_dir / TEST_STDOUT

    def verifier_file(self, name: str) -> Path:
        """Where a file the verifier left in ``/logs/verifier`` is kept. Its name comes from
        inside the episode, so it must be one plain name (no folder, no ``..``)."""
        return self.verifier_dir / check_name(name, "verifier file")

    def mkdir(self) -> None:
        """Create the trial's folders; the trial folder itself must not exist yet."""
        self.root.mkdir()
        self.agent_dir.mkdir()
        self.verifier_dir.mkdir()


@dataclass(frozen=True)
class JobPaths:
    root: Path

    @property
    def config_path(self) -> Path:
        return self.root / "config.json"

    @property
    def result_path(self) -> Path:
        return self.root / "result.json"

    def build_log(self, task_name: str) -> Path:
        return self.root / f"{check_name(task_name, 'task name')}.build.log"

    def trial_dir(self, trial_name: str) -> Path:
        return self.root / check_name(trial_name, "trial name")
