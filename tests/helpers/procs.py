"""Processes on this machine, as the tests look for them: by command line in /proc,
alive or not (a zombie counts as gone), and waiting for a condition."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["pids_with_cmdline", "pids_mentioning", "pid_alive", "wait_until"]


def _cmdlines() -> list[tuple[int, bytes]]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    found.append((int(name), f.read()))
            except OSError:
                continue
    return found


def pids_with_cmdline(cmdline: bytes) -> list[int]:
    """The pids whose whole command line is ``cmdline`` (NUL-separated, as in
    ``/proc/PID/cmdline``): a sandbox's or container's processes, seen from the host."""
    return [pid for pid, line in _cmdlines() if line == cmdline]


def pids_mentioning(marker: str) -> list[int]:
    """The pids whose command line (arguments joined by spaces) contains ``marker``."""
    wanted = marker.encode()
    return [pid for pid, line in _cmdlines() if wanted in line.replace(b"\0", b" ")]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def wait_until(condition: Callable[[], Any], timeout: float = 20, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return bool(condition())
