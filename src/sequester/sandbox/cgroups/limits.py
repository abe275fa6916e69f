"""Memory, CPU and process limits of an episode in cgroups of its own, where this process
may make them: cgroup v1 (root on a hybrid or legacy hierarchy), a child of this
process's own cgroup in each of the ``memory``, ``cpu`` and ``pids`` hierarchies:
``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes``), ``cpu.cfs_quota_us``,
``pids.max``.

cgroup v2 is not applied yet: a process is in one v2 cgroup only, and the v2 freezer
(:mod:`sequester.sandbox.freeze`) moves the agent's processes into a cgroup of its own,
which would take them out of their limits; until the two share one cgroup, a v2-only
machine gets the notes (and ``RLIMIT_NPROC``, see
:mod:`sequester.environments.local.limits`). What each version writes is one pure plan
(:func:`limit_plan`), v2's included.

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

from sequester.sandbox.cgroups.hierarchy import find_v1, own_cgroup
from sequester.sandbox.cgroups.pool import remove_stale_cgroups

__all__ = ["LimitGroups", "limit_plan", "make_limit_groups", "remove_stale_groups"]

log = logging.getLogger("sequester.sandbox")

_PERIOD_US = 100_000
_CONTROLLERS = ("memory", "cpu", "pids")


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


def _base(controller: str) -> Path | None:
    """Our own cgroup's folder in the v1 hierarchy of ``controller``."""
    mount, own = find_v1(controller), own_cgroup(controller)
    return None if mount is None or own is None else mount.mount / own.lstrip("/")


def limit_plan(
    *, memory_mb: int | None, cpus: float | None, pids: int | None, v2: bool, memsw: bool = False
) -> list[tuple[str, str, str, str | None]]:
    """What to write for these limits: ``(controller, file, value, label)`` in order (the
    label is what :attr:`LimitGroups.applied` reports; ``None`` for a helper file). v1
    writes one cgroup per controller; v2 one cgroup for all (``controller`` is then only
    the one that must be enabled in the parent's ``cgroup.subtree_control``). ``memsw``:
    the v1 memory controller also limits swap. Pure."""
    plan: list[tuple[str, str, str, str | None]] = []
    if memory_mb:
        limit = str(memory_mb * (1 << 20))
        if v2:
            plan += [("memory", "memory.max", limit, "memory"), ("memory", "memory.swap.max", "0", None)]
        else:
            plan.append(("memory", "memory.limit_in_bytes", limit, "memory"))
            if memsw:
                plan.append(("memory", "memory.memsw.limit_in_bytes", limit, None))
    if cpus:
        quota = str(int(cpus * _PERIOD_US))
        if v2:
            plan.append(("cpu", "cpu.max", f"{quota} {_PERIOD_US}", "cpus"))
        else:
            plan += [("cpu", "cpu.cfs_period_us", str(_PERIOD_US), None), ("cpu", "cpu.cfs_quota_us", quota, "cpus")]
    if pids is not None:
        plan.append(("pids", "pids.max", str(pids), "pids"))
    return plan


def make_limit_groups(
    name: str, *, memory_mb: int | None, cpus: float | None, pids: int | None
) -> tuple[LimitGroups | None, str | None]:
    """Cgroups named ``name`` with these limits, or ``(None, why not)``."""
    if os.geteuid() != 0:
        return None, "an ordinary user's episodes get no cgroups (cgroup v2 delegation is not used yet)"
    group: LimitGroups | None = None
    try:
        paths = {}
        for controller in _CONTROLLERS:
            base = _base(controller)
            if base is None:
                return None, f"no cgroup v1 {controller} hierarchy (cgroup v2 is not used yet)"
            paths[controller] = base / name
        group = LimitGroups([])
        for path in paths.values():
            path.mkdir()
            group.paths.append(path)
        memsw = bool(memory_mb) and (paths["memory"] / "memory.memsw.limit_in_bytes").exists()
        for controller, file, value, label in limit_plan(
            memory_mb=memory_mb, cpus=cpus, pids=pids, v2=False, memsw=memsw
        ):
            (paths[controller] / file).write_text(value)
            if label:
                group.applied.append(label)
        return group, None
    except OSError as exc:
        if group is not None:
            group.remove(0)
        return None, f"the episode's cgroups could not be made ({exc})"


def remove_stale_groups() -> None:
    """Remove the empty cgroups of episodes whose sequester process is gone (killed before
    its teardown), in each limit hierarchy. Never raises: a group that still has processes stays."""
    for controller in _CONTROLLERS:
        base = _base(controller)
        if base is not None:
            remove_stale_cgroups(base)
