"""Where things are in the repository, for tests at any depth of tests/."""

from __future__ import annotations

from pathlib import Path

HELPERS = Path(__file__).resolve().parent
TESTS = HELPERS.parent
REPO = TESTS.parent
SRC = REPO / "src"
EXAMPLES = REPO / "examples" / "tasks"
BUILD_TASKS = REPO / "examples" / "build-tasks"
IMAGE_TASKS = REPO / "examples" / "image-tasks"
HACKS = REPO / "examples" / "hacks"
