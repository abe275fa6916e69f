"""The ``sequester`` command run as a real process, as a user runs it."""

from __future__ import annotations

import subprocess
import sys


def sequester(*args: str, stdin: str | None = None, timeout: float = 120, cwd=None) -> subprocess.CompletedProcess[str]:
    """``sequester ARGS`` (``python -P -m sequester.cli``): its exit status and output."""
    # -P: the current folder is not put on sys.path, as with the installed `sequester` script.
    return subprocess.run([sys.executable, "-P", "-m", "sequester.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)
