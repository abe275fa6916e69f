"""Task folders in the Terminal-Bench 2 / Harbor layout, made file by file: for the tests
of task loading (tests/tasks/). (Tasks for episodes: tests/helpers/tasks.py.)"""

from __future__ import annotations

from pathlib import Path

# A task.toml in the first schema (Terminal-Bench 2's), with a table sequester does not know.
OLD_SCHEMA = """
version = "1.0"

[metadata]
author_name = "Ada"
difficulty = "easy"
tags = ["files"]

[verifier]
timeout_sec = 120.0

[agent]
timeout_sec = 300

[environment]
build_timeout_sec = 600.0   # not read, tolerated
cpus = 2
memory = "2G"
storage = "10G"
allow_internet = false

[something_new]
x = 1
"""

DOCKERFILE = "FROM python:3.12-slim\nWORKDIR /app\nCOPY app.py .\n"


def make_files(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def hello_task(root: Path, name: str = "hello", **overrides) -> Path:
    """A task ``name`` in the Terminal-Bench 2 layout under ``root``; ``overrides``: files
    (relative path -> text) added or replaced, or removed with None."""
    files = {
        "instruction.md": "Write hello.txt.\n",
        "task.toml": OLD_SCHEMA,
        "environment/Dockerfile": DOCKERFILE,
        "environment/app.py": "print('hi')\n",
        "tests/test.sh": "#!/bin/sh\npytest /tests\n",
        "tests/test_outputs.py": "def test_x():\n    pass\n",
        "solution/solve.sh": "#!/bin/sh\necho hello > hello.txt\n",
    }
    files.update(overrides)
    task = root / name
    make_files(task, {k: v for k, v in files.items() if v is not None})
    return task
