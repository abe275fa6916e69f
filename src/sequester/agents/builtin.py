"""The built-in agents: oracle, nop and script."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sequester.errors import SequesterError

if TYPE_CHECKING:
    from sequester.environments.local.episode import Episode

__all__ = ["OracleAgent", "NopAgent", "ScriptAgent"]

# Where the oracle puts the solution in its own episode (as Harbor's oracle does).
SOLUTION_MOUNT = "/solution"


class NopAgent:
    """Does nothing: the baseline every reward hack must not beat."""

    name = "nop"

    def run(self, instruction: str, episode: Episode) -> None:
        return None


@dataclass
class OracleAgent:
    """Copies the task's ``solution/`` into its own episode and runs ``solve.sh`` in the
    working directory (the only agent that ever sees a solution, and only its task's)."""

    name: str = "oracle"
    results: list = field(default_factory=list)

    def run(self, instruction: str, episode: Episode) -> None:
        task = episode.task
        if not task.has_solution:
            raise SequesterError(f"{task.path}/solution/solve.sh: missing (the oracle needs it)")
        episode.upload_dir(task.solution_dir, SOLUTION_MOUNT)
        self.results.append(episode.exec(f"bash {SOLUTION_MOUNT}/solve.sh", timeout=task.config.agent.timeout_sec))


@dataclass
class ScriptAgent:
    """Runs a file's content as one command in the agent's shell (tests and demos)."""

    path: Path
    results: list = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"script:{self.path}"

    def run(self, instruction: str, episode: Episode) -> None:
        self.results.append(episode.exec(Path(self.path).read_text()))
