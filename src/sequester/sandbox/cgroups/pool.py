"""Our own cgroups under a base cgroup, pooled.

Creating a cgroup costs the kernel a few milliseconds: they are pooled per base and reused
by later episodes of this process, and removed at exit; stale ones of dead sequester
processes are removed on first use (:func:`remove_stale_cgroups`, which the limits use
too).
"""

from __future__ import annotations

import atexit
import os
import threading
from pathlib import Path

__all__ = ["give_back", "remove_stale_cgroups", "take_cgroup"]

_pool: list[Path] = []
_pool_lock = threading.Lock()
_created = [0]


def take_cgroup(base: Path) -> Path:
    """A fresh (or pooled, empty and thawed) cgroup of ours under ``base``."""
    with _pool_lock:
        for i, path in enumerate(_pool):
            if path.parent == base:
                return _pool.pop(i)
        if _created[0] == 0:
            remove_stale_cgroups(base)
        _created[0] += 1
        path = base / f"sequester-{os.getpid()}-{_created[0]}"
    path.mkdir()
    return path


def give_back(path: Path) -> None:
    with _pool_lock:
        _pool.append(path)


def _release_pool() -> None:
    with _pool_lock:
        for path in _pool:
            try:
                path.rmdir()
            except OSError:
                pass
        _pool.clear()


atexit.register(_release_pool)


def remove_stale_cgroups(base: Path) -> None:
    """Cgroups of sequester processes that died without cleaning up (empty ones; never raises)."""
    for path in base.glob("sequester-*-*"):
        pid = path.name.split("-")[1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            try:
                path.rmdir()
            except OSError:
                pass
