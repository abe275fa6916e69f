"""Where a freezer cgroup can be made: the hierarchy and its ownership (the cgroups
themselves come from :mod:`.pool`).

Root uses the whole hierarchy (cgroup v2 first, else the v1 ``freezer`` controller). An
ordinary user may use only a cgroup v2 subtree *delegated* to it: its own cgroup, when
that directory and its ``cgroup.procs`` belong to the user (systemd does this for
``user@UID.service`` and for ``systemd-run --user --scope``/``Delegate=yes`` units; a
container manager may too). Moving a process between two cgroups needs write access to
their common ancestor's ``cgroup.procs``: the agent's processes start in our own cgroup,
and the freezer cgroup is a child of it, so that ancestor is ours.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from sequester.sandbox.cgroups.hierarchy import CgroupMount, cgroup_mounts, own_cgroup

__all__ = ["Hierarchy", "find_hierarchy", "freezer_mounts", "is_delegated", "own_cgroup_dir"]


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


def freezer_mounts() -> list[CgroupMount]:
    """Each cgroup v2 mount and each v1 mount with the freezer, v2 first."""
    found = [m for m in cgroup_mounts() if m.v2 or "freezer" in m.controllers]
    found.sort(key=lambda m: not m.v2)
    return found


def own_cgroup_dir(mount: Path, root: str) -> Path | None:
    """Our own cgroup v2 directory under ``mount``."""
    path = own_cgroup(None)
    if path is None:
        return None
    root = root.rstrip("/")
    if root and not (path == root or path.startswith(root + "/")):
        return None
    rel = path[len(root) :].strip("/")
    return mount / rel if rel else mount


def is_delegated(path: Path) -> bool:
    """``path`` is a cgroup v2 directory we own and may make children in and move
    processes through. (Writing ``cgroup.subtree_control`` is not needed: freezing is a
    core feature of every non-root v2 cgroup.)"""
    uid = os.geteuid()
    try:
        return (
            path.stat().st_uid == uid
            and (path / "cgroup.procs").stat().st_uid == uid
            and os.access(path, os.W_OK | os.X_OK)
            and os.access(path / "cgroup.procs", os.W_OK)
        )
    except OSError:
        return False


def find_hierarchy() -> Hierarchy | None:
    """The hierarchy to freeze in, or None (then only signals are left)."""
    mounts = [(m.mount, m.root, m.v2) for m in freezer_mounts()]
    if os.geteuid() == 0:
        for mount, root, v2 in mounts:
            marker = mount / ("cgroup.controllers" if v2 else "freezer.state")
            if (marker.exists() or (not v2 and (mount / "cgroup.procs").exists())) and os.access(mount, os.W_OK):
                return Hierarchy(mount, root, v2, False, mount)
        return None
    for mount, root, v2 in mounts:
        own = own_cgroup_dir(mount, root) if v2 else None
        if own is not None and own != mount and is_delegated(own):
            return Hierarchy(mount, root, True, True, own)
    return None
