"""Where a freezer cgroup can be made: the hierarchy, its ownership, a pool of our cgroups.

Root uses the whole hierarchy (cgroup v2 first, else the v1 ``freezer`` controller). An
ordinary user may use only a cgroup v2 subtree *delegated* to it: its own cgroup, when
that directory and its ``cgroup.procs`` belong to the user (systemd does this for
``user@UID.service`` and for ``systemd-run --user --scope``/``Delegate=yes`` units; a
container manager may too). Moving a process between two cgroups needs write access to
their common ancestor's ``cgroup.procs``: the agent's processes start in our own cgroup,
and the freezer cgroup is a child of it, so that ancestor is ours.

Creating a cgroup costs the kernel a few milliseconds: they are pooled per base and reused
by later episodes of this process, and removed at exit; stale ones of dead sequester
processes are removed on first use.
"""

from __future__ import annotations

import atexit
import os
import threading
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Hierarchy", "find_hierarchy", "take_cgroup", "give_back"]


@dataclass(frozen=True)
class Hierarchy:
    """``mount``: where it is mounted; ``root``: which cgroup that mount shows (``/``
    unless in a cgroup namespace); ``base``: the cgroup under which ours are made."""

    mount: Path
    root: str
    v2: bool
    delegated: bool
    base: Path

    def cgroup_path(self, path: Path) -> str:
        """How ``/proc/PID/cgroup`` names the cgroup at ``path``."""
        rel = path.relative_to(self.mount)
        return "/" + "/".join(p for p in (*self.root.strip("/").split("/"), *rel.parts) if p)


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _mounts() -> list[tuple[Path, str, bool]]:
    """``(mount point, root, v2)`` of each cgroup2 mount and each v1 mount with the freezer."""
    found = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        head, sep, tail = line.partition(" - ")
        if not sep:
            continue
        fields, rest = head.split(), tail.split()
        if len(fields) < 5 or len(rest) < 3:
            continue
        fstype, superopts = rest[0], rest[2].split(",")
        if fstype == "cgroup2" or (fstype == "cgroup" and "freezer" in superopts):
            found.append((Path(_unescape(fields[4])), _unescape(fields[3]), fstype == "cgroup2"))
    found.sort(key=lambda m: not m[2])  # v2 first
    return found


def _own_cgroup(mount: Path, root: str) -> Path | None:
    """Our own cgroup v2 directory under ``mount``."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            root = root.rstrip("/")
            if root and not (path == root or path.startswith(root + "/")):
                return None
            rel = path[len(root):].strip("/")
            return mount / rel if rel else mount
    return None


def _delegated(path: Path) -> bool:
    """``path`` is a cgroup v2 directory we own and may make children in and move
    processes through. (Writing ``cgroup.subtree_control`` is not needed: freezing is a
    core feature of every non-root v2 cgroup.)"""
    uid = os.geteuid()
    try:
        return (path.stat().st_uid == uid and (path / "cgroup.procs").stat().st_uid == uid
                and os.access(path, os.W_OK | os.X_OK) and os.access(path / "cgroup.procs", os.W_OK))
    except OSError:
        return False


def find_hierarchy() -> Hierarchy | None:
    """The hierarchy to freeze in, or None (then only signals are left)."""
    mounts = _mounts()
    if os.geteuid() == 0:
        for mount, root, v2 in mounts:
            marker = mount / ("cgroup.controllers" if v2 else "freezer.state")
            if (marker.exists() or (not v2 and (mount / "cgroup.procs").exists())) and os.access(mount, os.W_OK):
                return Hierarchy(mount, root, v2, False, mount)
        return None
    for mount, root, v2 in mounts:
        own = _own_cgroup(mount, root) if v2 else None
        if own is not None and own != mount and _delegated(own):
            return Hierarchy(mount, root, True, True, own)
    return None


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
