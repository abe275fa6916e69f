"""A venv with Inspect (``inspect-ai`` from PyPI) and this checkout's sequester installed
as a distribution (Inspect finds the sandbox through the ``inspect_ai`` entry point group,
which only an installed distribution registers), made once and reused between runs;
sequester itself is reinstalled from this checkout once per test session.

It lives in ``$SEQUESTER_INSPECT_VENV`` (default: root's ``/var/cache/sequester-ci/inspect-venv``,
another user's ``~/.cache/sequester-ci/inspect-venv``).
"""

from __future__ import annotations

import fcntl
import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

from paths import REPO

INSPECT = "inspect-ai==0.3.285"


def venv_path() -> Path:
    home = Path.home() / ".cache/sequester-ci/inspect-venv"
    default = "/var/cache/sequester-ci/inspect-venv" if os.geteuid() == 0 else str(home)
    return Path(os.environ.get("SEQUESTER_INSPECT_VENV", default))


def _pip(python: Path, *args: str) -> None:
    r = subprocess.run([str(python), "-m", "pip", "--quiet", *args], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, f"pip {' '.join(args)} failed:\n{r.stderr[-3000:]}"


@functools.cache
def inspect_python() -> str:
    """The venv's Python, with Inspect and this checkout's sequester."""
    venv = venv_path()
    python = venv / "bin" / "python"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{venv}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ready = python.exists() and subprocess.run(
            [str(python), "-c", "import importlib.metadata as m; assert m.version('inspect-ai') == '0.3.285'"],
            capture_output=True, timeout=120).returncode == 0
        if not ready:
            shutil.rmtree(venv, ignore_errors=True)
            base = getattr(sys, "_base_executable", sys.executable)
            subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=300)
            _pip(python, "install", INSPECT, str(REPO))  # Inspect and sequester's dependencies
        _pip(python, "install", "--no-deps", "--force-reinstall", str(REPO))  # this checkout's code
    return str(python)
