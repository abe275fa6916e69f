"""Tasks in the Terminal-Bench 2 / Harbor layout: loaded, checked, and their Dockerfile planned.

:func:`load_task` reads one task directory (``instruction.md``, ``task.toml``, ``tests/``,
optional ``environment/Dockerfile`` and ``solution/``) into a frozen :class:`Task`;
:func:`find_tasks` loads a list of task directories or folders of them. Pure Python,
standard library only, and read-only: the task directory is never written to.

The Dockerfile is not built. :func:`parse_dockerfile` turns it into a
:class:`DockerfilePlan` (base image, WORKDIR, ENV, local COPY/ADD) and lists every
instruction whose effect it cannot reproduce; :func:`resolve_copies` maps the plan's copies
to concrete host files of the build context. Every malformed input is a
:class:`sequester.errors.TaskError` naming the file and the field or line.
"""

from sequester.tasks.dockerfile import DockerfilePlan, parse_dockerfile, resolve_copies
from sequester.tasks.finder import find_tasks
from sequester.tasks.task import Task, load_task
from sequester.tasks.task_toml import TaskConfig, parse_task_config

__all__ = [
    "Task",
    "TaskConfig",
    "DockerfilePlan",
    "load_task",
    "find_tasks",
    "parse_task_config",
    "parse_dockerfile",
    "resolve_copies",
]
