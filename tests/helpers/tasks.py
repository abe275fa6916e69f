"""Tasks and conditions the episode tests share."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

__all__ = ["make_task", "writable_usr"]


def make_task(root: Path, name: str = "t", test_sh: str = "echo 1 > /logs/verifier/reward.txt\n", *,
              dockerfile: str = "FROM debian:12\nWORKDIR /app\n", toml: str = "", files: dict | None = None,
              verifier_timeout: float = 30) -> Path:
    task = root / name
    (task / "tests").mkdir(parents=True)
    (task / "environment").mkdir()
    (task / "solution").mkdir()
    (task / "instruction.md").write_text("Do the thing.\n")
    (task / "task.toml").write_text(f'version = "1.0"\n[verifier]\ntimeout_sec = {verifier_timeout}\n' + toml)
    (task / "environment" / "Dockerfile").write_text(dockerfile)
    (task / "tests" / "test.sh").write_text(test_sh)
    (task / "solution" / "solve.sh").write_text("echo solved\n")
    for rel, content in (files or {}).items():
        (task / rel).parent.mkdir(parents=True, exist_ok=True)
        (task / rel).write_text(content)
    return task


# An episode mounts the Python installation that runs it back read-only; with Debian's own
# python3 that installation is /usr, so the agent cannot write /usr at all; and an ordinary
# user's agent cannot write the system's root-owned folders (README).
writable_usr = pytest.mark.skipif(
    os.geteuid() != 0 or any(f"{Path(p).resolve()}/".startswith("/usr/") for p in {sys.prefix, sys.base_prefix}),
    reason="the agent can write /usr only when sequester runs as root from a Python installed outside /usr")
