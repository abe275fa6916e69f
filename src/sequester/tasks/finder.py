"""Where tasks are: the one place that recognises a task folder and walks folders of them.

Two rules, each kept by the commands that had it:

* ``sequester run`` and ``sequester build`` (:func:`find_tasks`, and a job's datasets)
  take a folder as a task when it has ``task.toml`` *or* ``instruction.md``: a task with
  one of them missing is still a task, and its own error (naming the missing file) is
  clearer than "not a folder of tasks";
* ``sequester serve`` and the episode pool serve the folders that hold a ``task.toml``
  (:func:`has_task_toml`, :func:`served_task_folders`), found by name under their tasks
  folder (:func:`resolve_task_id`: nothing outside it).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from sequester.errors import PolicyError, TaskError
from sequester.tasks.task import Task, load_task

__all__ = ["find_tasks", "has_task_toml", "looks_like_task", "resolve_task_id", "served_task_folders"]


def looks_like_task(folder: Path) -> bool:
    """A task folder as ``run`` and ``build`` see one: it has ``task.toml`` or ``instruction.md``."""
    return (folder / "task.toml").exists() or (folder / "instruction.md").exists()


def has_task_toml(folder: Path) -> bool:
    """A task folder as ``serve`` sees one: it holds a ``task.toml`` file."""
    return (folder / "task.toml").is_file()


def resolve_task_id(root: Path, task_id: str, where: str = "task") -> Path:
    """The folder of task ``task_id`` under ``root`` (already resolved), or a
    :class:`PolicyError` that starts with ``where``.

    Attack stopped: a client naming a folder outside the tasks folder (``../../etc``,
    ``/root/other-tasks/x``, a symlink inside the folder pointing out of it) to run an
    episode on (and have verified, and see the instruction of) a task the operator did not
    serve. The path is taken apart by name (no ``..``, no hidden names, not absolute),
    then its real path must lie inside ``root``'s.
    """
    if task_id.startswith("/") or "\\" in task_id:
        raise PolicyError(
            f"{where}: an absolute path is refused: name a task of the "
            "tasks folder by its folder name or its path relative to it"
        )
    parts = task_id.split("/")
    if parts[-1] == "":  # "python-csv-stats/"
        parts = parts[:-1]
    if not parts or any(part == "" or part.startswith(".") for part in parts):
        raise PolicyError(
            f"{where}: '..', '.', empty and hidden path components are refused: name a task of the tasks folder"
        )
    # (strings, not Paths: a pool resolves the task id of every reset, a warm one's in well
    # under a millisecond)
    top = os.fspath(root)
    real = os.path.realpath(os.path.join(top, *parts))
    if real == top or not real.startswith(top.rstrip(os.sep) + os.sep):
        raise PolicyError(f"{where}: resolves outside the tasks folder (a symlink pointing out of it?): refused")
    if not os.path.isfile(os.path.join(real, "task.toml")):
        raise PolicyError(f"{where}: no task {task_id[:200]!r} in the tasks folder")
    return Path(real)


def served_task_folders(root: Path, depth: int = 3) -> Iterator[Path]:
    """The folders under ``root`` (not ``root`` itself) that hold a ``task.toml``, at most
    ``depth`` levels down, in name order; hidden ones (``.``, ``_``) and a task's own
    subfolders are left out, and links are not followed."""
    root = Path(root).resolve()
    for current, dirs, files in os.walk(root):
        here = Path(current)
        if "task.toml" in files and here != root:
            yield here
            dirs.clear()  # a task's own folders hold no tasks
            continue
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "_")))
        if len(here.relative_to(root).parts) >= depth:
            dirs.clear()


def find_tasks(paths: Iterable[str | os.PathLike[str]]) -> list[Task]:
    """Load the tasks in ``paths``, in order: each is a task directory (it has ``task.toml``)
    or a folder whose every immediate subfolder is one (loaded sorted by name; subfolders
    whose names start with ``.`` or ``_`` and plain files are left out).

    Two tasks with the same name are an error, even from different folders: results are
    keyed by task name.
    """
    tasks: list[Task] = []
    seen: dict[str, Path] = {}
    for given in paths:
        folder = Path(os.path.abspath(given))
        if looks_like_task(folder):
            found = [load_task(folder)]  # a task, possibly a broken one: its own error is clearer
        elif folder.is_dir():
            subfolders = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))
            if not subfolders:
                raise TaskError(f"{folder}: neither a task (no task.toml) nor a folder of tasks")
            found = [load_task(p) for p in subfolders]
        else:
            raise TaskError(f"{folder}: does not exist" if not folder.exists() else f"{folder}: not a directory")
        for task in found:
            if task.name in seen:
                raise TaskError(f"{task.path}: duplicate task name {task.name!r} (also {seen[task.name]})")
            seen[task.name] = task.path
            tasks.append(task)
    return tasks
