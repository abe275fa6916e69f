"""A task directory in the Terminal-Bench 2 / Harbor layout, loaded and checked.

::

    hello/
      instruction.md          required: what the agent is asked to do
      task.toml               required: see :mod:`.task_toml`
      environment/Dockerfile  optional; environment/ is its build context
      environment/docker-compose.yaml  services beside the main container: no backend of
                              sequester starts them, so such a task is refused before it
                              starts (:attr:`Task.compose_file`, ``missing_capabilities``)
      tests/                  required: test.sh and/or test_*.py
      solution/solve.sh       optional: a reference solution

Loading reads these files and nothing else, writes nothing, and checks everything a run
would otherwise trip over later, so a malformed task fails here, with the file named,
rather than halfway through an episode. A file that resolves (through a symlink) outside
the task directory is refused: a task must not be able to pull host files into a prompt.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from sequester.errors import TaskError
from sequester.tasks.dockerfile import DockerfilePlan, parse_dockerfile
from sequester.tasks.task_toml import TaskConfig, parse_task_config

__all__ = ["COMPOSE_FILES", "Task", "load_task"]

# The names Docker Compose looks for, in its order.
COMPOSE_FILES = ("compose.yaml", "compose.yml", "docker-compose.yaml", "docker-compose.yml")


@dataclass(frozen=True)
class Task:
    """One loaded task. ``path`` is absolute; ``name`` is its folder's name."""

    name: str
    path: Path
    instruction: str
    config: TaskConfig
    dockerfile: DockerfilePlan | None = None

    @property
    def tests_dir(self) -> Path:
        return self.path / "tests"

    @property
    def solution_dir(self) -> Path:
        return self.path / "solution"

    @property
    def environment_dir(self) -> Path:
        """The Dockerfile's build context (it may not exist)."""
        return self.path / "environment"

    @property
    def compose_file(self) -> Path | None:
        """The task's ``environment/docker-compose.yaml`` (or ``.yml``, ``compose.yaml``,
        ``compose.yml``, the names Docker Compose reads), if it has one."""
        for name in COMPOSE_FILES:
            path = self.environment_dir / name
            if path.is_file() or path.is_symlink():
                return path
        return None

    @property
    def test_script(self) -> Path | None:
        """``tests/test.sh`` if the task has one, else ``None`` (its tests are ``test_*.py``)."""
        script = self.tests_dir / "test.sh"
        return script if script.is_file() else None

    @property
    def test_files(self) -> tuple[Path, ...]:
        """The ``tests/test_*.py`` files, sorted."""
        return tuple(sorted(p for p in self.tests_dir.glob("test_*.py") if p.is_file()))

    @property
    def has_solution(self) -> bool:
        return (self.solution_dir / "solve.sh").is_file()

    @property
    def default_workdir(self) -> str | None:
        """The Dockerfile's last ``WORKDIR``, or ``None`` (``task.toml``'s ``workdir`` is not consulted)."""
        return self.dockerfile.workdir if self.dockerfile else None


def _read(file: Path, root: Path) -> str:
    """The UTF-8 text of ``file``, which must resolve inside ``root``; errors name the file."""
    if not file.exists() and not file.is_symlink():
        raise TaskError(f"{file}: missing")
    real = Path(os.path.realpath(file))
    if root not in real.parents:
        raise TaskError(f"{file}: resolves to {real}, outside the task directory")
    if not real.is_file():
        raise TaskError(f"{file}: not a file")
    try:
        return real.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TaskError(f"{file}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise TaskError(f"{file}: cannot be read: {exc.strerror}") from None


def load_task(path: str | os.PathLike[str]) -> Task:
    """Load and check the task in ``path``; a :class:`TaskError` names the offending file."""
    task_dir = Path(os.path.abspath(path))
    if not task_dir.is_dir():
        raise TaskError(f"{task_dir}: not a task directory" if task_dir.exists() else f"{task_dir}: does not exist")
    root = task_dir.resolve()
    config = parse_task_config(_read(task_dir / "task.toml", root), str(task_dir / "task.toml"))
    instruction = _read(task_dir / "instruction.md", root)
    if not instruction.strip():
        raise TaskError(f"{task_dir / 'instruction.md'}: empty")
    tests = task_dir / "tests"
    if not tests.is_dir():
        raise TaskError(f"{tests}: missing" if not tests.exists() else f"{tests}: not a directory")
    if root not in Path(os.path.realpath(tests)).parents:
        raise TaskError(f"{tests}: resolves outside the task directory")
    if not (tests / "test.sh").is_file() and not any(p.is_file() for p in tests.glob("test_*.py")):
        raise TaskError(f"{tests}: has neither test.sh nor a test_*.py file")
    dockerfile = None
    docker_path = task_dir / "environment" / "Dockerfile"
    if docker_path.exists() or docker_path.is_symlink():
        dockerfile = parse_dockerfile(_read(docker_path, root), str(docker_path))
    return Task(task_dir.name, task_dir, instruction, config, dockerfile)
