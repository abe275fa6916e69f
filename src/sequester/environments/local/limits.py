"""The task's resource limits (``[environment] cpus, memory_mb, storage_mb``) and the
episode's process limit, applied where this machine allows; the rest said in the notes.

* processes (``[episodes] max_processes``, default 4096): ``RLIMIT_NPROC`` on every
  process the agent starts, counted per user namespace (Linux >= 5.14), so an ordinary
  user's agent's fork bomb stops at its own limit; the agent's root has no
  ``CAP_SYS_RESOURCE`` in the host's namespace, so it cannot raise it. The kernel does not
  apply ``RLIMIT_NPROC`` to processes of the host's root at all (a root caller's agent is
  host root): for them the ``pids`` cgroup below is what holds (measured: without it, one
  agent's fork bomb took all 32768 pids of the host);
* memory, CPUs and processes: cgroups of the episode's own where this process may make
  them (:mod:`sequester.sandbox.cgroups.limits`: one cgroup v2 in a delegated subtree,
  shared with the freezer, or root's cgroup v1 hierarchies). Elsewhere the note says
  so: an address-space rlimit is not a memory limit (runtimes that reserve address
  space, Node's and the JVM's, fail under one).
* storage: the episode's writable layers are one folder on the host's disk, capped by a
  project quota of its own where root may set one and the filesystem enforces them (XFS
  or ext4 mounted with ``prjquota``: :mod:`sequester.sandbox.quota`); never a RAM-backed
  layer. Elsewhere the note says why not.

Nothing is silently dropped: each limit the task asks for and this machine cannot apply
is one line in the trial's notes.
"""

from __future__ import annotations

import itertools
import logging
import os
import resource
from pathlib import Path
from typing import TYPE_CHECKING

from sequester.sandbox.cgroups.limits import LimitGroups, make_limit_groups
from sequester.sandbox.quota import ProjectQuota, QuotaUnavailable, cap_folder
from sequester.tasks import Task

if TYPE_CHECKING:
    from sequester.environments.local.start import RunningEpisode

__all__ = ["make_episode_limits", "make_storage_cap", "finish_limits"]

_serial = itertools.count()

log = logging.getLogger("sequester.environments.local")


def make_episode_limits(task: Task, *, max_processes: int) -> tuple[LimitGroups | None, str | None]:
    """The episode's cgroups, made before its init starts (which joins them at once, so
    that the one slow step, the first attach, overlaps bwrap's own set-up); ``(None, why
    not)`` where none can be made."""
    env = task.config.environment
    return make_limit_groups(
        f"sequester-{os.getpid()}-{next(_serial)}", memory_mb=env.memory_mb, cpus=env.cpus, pids=max_processes
    )


def make_storage_cap(task: Task, folder: Path) -> tuple[ProjectQuota | None, str | None]:
    """The task's ``storage_mb`` on ``folder`` (the episode's writable layers, just made):
    ``(quota, None)``, ``(None, why not)``, or ``(None, None)`` when the task sets none."""
    storage_mb = task.config.environment.storage_mb
    if not storage_mb:
        return None, None
    try:
        return cap_folder(folder, storage_mb << 20), None
    except QuotaUnavailable as exc:
        return None, str(exc)


def finish_limits(
    task: Task,
    run: RunningEpisode,
    group: LimitGroups | None,
    why: str | None,
    *,
    max_processes: int,
    storage_why: str | None = None,
) -> list[str]:
    """Set ``run.rlimits`` and ``run.limit_groups`` (every agent process's start uses
    both); return the notes for what could not be applied."""
    env = task.config.environment
    run.rlimits = {"RLIMIT_NPROC": max_processes}
    try:  # the init's too (its children, and what a ptrace of it would start)
        resource.prlimit(run.bwrap.pid, resource.RLIMIT_NPROC, (max_processes, max_processes))
    except OSError as exc:
        log.warning("the episode's init got no process limit: %s", exc)
    run.limit_groups = group
    applied = group.applied if group is not None else []
    missing = group.missing if group is not None else {}
    notes = []
    if "pids" not in applied and os.geteuid() == 0:
        notes.append(
            f"process limit of {max_processes} not applied: {missing.get('pids', why)} (RLIMIT_NPROC does not "
            "bind processes of the host's root)"
        )
    if env.memory_mb and "memory" not in applied:
        notes.append(
            f"memory limit of {env.memory_mb} MB ([environment] memory) not applied: {missing.get('memory', why)}"
        )
    if env.cpus and "cpus" not in applied:
        notes.append(f"CPU limit of {env.cpus} ([environment] cpus) not applied: {missing.get('cpus', why)}")
    if env.storage_mb and run.storage_quota is None:
        notes.append(
            f"storage limit of {env.storage_mb} MB ([environment] storage) not applied: "
            f"{storage_why or 'no project quota was set'}"
        )
    elif env.storage_mb and run.image is None:
        notes.append(
            f"storage limit of {env.storage_mb} MB applied to the writable layers; /tmp, /var/tmp, /run and "
            "/dev/shm of a host-mode view are in memory (tmpfs), outside it"
        )
    return notes
