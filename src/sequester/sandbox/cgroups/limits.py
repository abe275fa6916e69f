"""Memory, CPU and process limits of an episode in cgroups of its own, where this process
may make them: cgroup v1 (root on a hybrid or legacy hierarchy), a child of this
process's own cgroup in each of the ``memory``, ``cpu`` and ``pids`` hierarchies:
``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes``), ``cpu.cfs_quota_us``,
``pids.max``.

cgroup v2 is not used yet: a process is in one v2 cgroup only, and the v2 freezer
(:mod:`.freeze`) moves the agent's processes into a cgroup of its own, which would take
them out of their limits; until the two share one cgroup, a v2-only machine gets the
notes (and ``RLIMIT_NPROC``, see :mod:`.limits`).

Children of our own cgroup, so an episode never escapes the limits sequester itself runs
under. The episode's init is moved in once it is up; every process the agent starts joins
on its way in (the namespace helper writes itself into each ``cgroup.procs`` before it
enters the episode). The verifier's processes do not: what the agent leaves behind cannot
starve the tests of memory. Removed at teardown, after every process in them is gone.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from sequester.sandbox.cgroups.freezer import remove_stale_cgroups

__all__ = ["LimitGroups", "make_limit_groups"]

log = logging.getLogger("sequester.environments.local")

_PERIOD_US = 100_000


@dataclass
class LimitGroups:
    """The episode's cgroups (one per controller)."""

    paths: list[Path]
    applied: list[str] = field(default_factory=list)

    @property
    def procs(self) -> list[str]:
        return [str(p / "cgroup.procs") for p in self.paths]

    def enrol(self, pid: int) -> None:
        for procs in self.procs:
            with open(procs, "w") as f:
                f.write(str(pid))

    def remove(self, timeout: float = 5.0) -> None:
        for path in self.paths:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY: a process is still on its way out
                    if time.monotonic() > deadline:
                        log.warning("cgroup %s still has processes; left for the next start", path)
                        break
                    time.sleep(0.005)


def _own(controller_line: str) -> str | None:
    """This process's cgroup path in the v1 hierarchy of ``controller_line``."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            parts = line.split(":", 2)
            if len(parts) == 3 and (parts[1] == controller_line or controller_line in parts[1].split(",")):
                return parts[2]
    except OSError:
        pass
    return None


def _mount_of(controller: str) -> Path | None:
    try:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) > 3 and fields[2] == "cgroup" and controller in fields[3].split(","):
                return Path(fields[1])
    except OSError:
        pass
    return None


def make_limit_groups(name: str, *, memory_mb: int | None, cpus: float | None,
                      pids: int | None) -> tuple[LimitGroups | None, str | None]:
    """Cgroups named ``name`` with these limits, or ``(None, why not)``."""
    if os.geteuid() != 0:
        return None, "an ordinary user's episodes get no cgroups (cgroup v2 delegation is not used yet)"
    group: LimitGroups | None = None
    try:
        paths = {}
        for controller in ("memory", "cpu", "pids"):
            mount, own = _mount_of(controller), _own(controller)
            if mount is None or own is None:
                return None, f"no cgroup v1 {controller} hierarchy (cgroup v2 is not used yet)"
            paths[controller] = mount / own.lstrip("/") / name
        group = LimitGroups([])
        for controller, path in paths.items():
            path.mkdir()
            group.paths.append(path)
        _write(group, paths["memory"] / "memory.limit_in_bytes", memory_mb * (1 << 20) if memory_mb else None, "memory")
        if memory_mb and (paths["memory"] / "memory.memsw.limit_in_bytes").exists():
            _write(group, paths["memory"] / "memory.memsw.limit_in_bytes", memory_mb * (1 << 20), None)
        if cpus:
            _write(group, paths["cpu"] / "cpu.cfs_period_us", _PERIOD_US, None)
            _write(group, paths["cpu"] / "cpu.cfs_quota_us", int(cpus * _PERIOD_US), "cpus")
        _write(group, paths["pids"] / "pids.max", pids, "pids")
        return group, None
    except OSError as exc:
        if group is not None:
            group.remove(0)
        return None, f"the episode's cgroups could not be made ({exc})"


def _write(group: LimitGroups, path: Path, value: object, label: str | None) -> None:
    if value is None:
        return
    path.write_text(str(value))
    if label:
        group.applied.append(label)


def remove_stale_groups() -> None:
    """Remove the empty cgroups of episodes whose sequester process is gone (killed before
    its teardown), in each limit hierarchy. Never raises: a group that still has processes stays."""
    for controller in ("memory", "cpu", "pids"):
        mount, own = _mount_of(controller), _own(controller)
        if mount is not None and own is not None:
            remove_stale_cgroups(mount / own.lstrip("/"))
