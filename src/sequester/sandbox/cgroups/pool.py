"""Our own cgroups under a base cgroup, pooled.

Creating a cgroup costs the kernel a few milliseconds: they are pooled per base and reused
by later episodes of this process, and removed at exit; stale ones of dead sequester
processes are removed on first use (:func:`remove_stale_cgroups`, which the limits use
too), with any sandbox process still in them killed.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import time
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
    """Cgroups of sequester processes that died without cleaning up (never raises).

    One that still holds processes holds a sandbox its dead process left: a process killed
    while a reset was under way can leave the episode's init running for good (its bwrap
    sets the parent-death signal in the sandbox only after its own parent, killed with
    ours, was gone; seen after a thousand-episode benchmark was killed, issue #25). Nothing
    but a sandbox's processes is ever put in such a cgroup (an episode's, a verifier's, a
    build step's; never ``sequester-PID-host``, where a sequester process moves itself), so
    they are killed, thawed first if frozen, and then the cgroup goes."""
    for path in base.glob("sequester-*-*"):
        pid = path.name.split("-")[1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            if not path.name.endswith("-host"):
                _kill_members(path)
            try:
                path.rmdir()
            except OSError:
                pass


def _members(path: Path) -> list[int]:
    try:
        return [int(p) for p in (path / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def _kill_members(path: Path, wait: float = 2.0) -> None:
    """SIGKILL every process of the cgroup ``path`` (thawed first), and wait a little for
    them to be gone. Each is signalled through a pidfd opened while it is still listed."""
    members = _members(path)
    if not members:
        return
    for name, value in (("freezer.state", "THAWED"), ("cgroup.freeze", "0")):  # v1, v2
        try:
            (path / name).write_text(value)
        except OSError:
            pass
    for pid in members:
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            if pid in _members(path):  # the pid is this process still, not a reused one
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        except OSError:
            pass
        finally:
            os.close(fd)
    deadline = time.monotonic() + wait
    while _members(path) and time.monotonic() < deadline:
        time.sleep(0.01)
