"""Whether this process and host can hold ``n`` idle episodes at once (issue #25: a thousand
episodes per machine), asked before any of them starts: each limit they count against, set
beside their share of it.

    from sequester.environments.local.capacity import shortfalls
    short = shortfalls(1000, network=True)     # [] when they fit; else one sentence per limit

Each ``reset`` checks its own episode's room as it starts (the open-file limit, a pty:
:mod:`sequester.sandbox.fdlimit`, :mod:`sequester.sandbox.hostlimits`); this is for a
caller that knows how many it will open (a trainer, ``sequester serve --max-sessions``, the
thousand-episode test and benchmark) and would rather hear it before the first than at the
501st. What one idle host-mode episode holds (measured on the project's 2-core machine:
``benchmarks/thousand_bench.py``, docs/running-tasks.md):

* descriptors in this process: 6, 17 with a network (and up to about 26 while it starts);
* one pty (its shell's terminal);
* processes: 4 (bwrap, its init and the init's ``sleep``, the shell), and with a network
  slirp4netns and a thread of this process (the DNS responder); a ``sequester serve``
  session adds a thread (its worker) and a socket;
* namespaces: one of each kind (user, mount, PID, network, IPC, UTS), a second user and
  network namespace with a network (a root caller's router);
* memory: about 2 MB with the kernel's own (namespaces, page tables, the view's tmpfs)
  counted, 2.6 MB with a network; budgeted here at 3 and 4 MB.

The namespaces in use are not counted (that reads every process's descriptors): only that
the limit itself is not below what the episodes would take. Nothing is raised or changed.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

from sequester.sandbox.fdlimit import RAISED_SOFT_LIMIT, open_descriptors
from sequester.sandbox.hostlimits import namespace_limits, pty_limits, task_limits

__all__ = ["EpisodeCost", "IDLE", "IDLE_WITH_NETWORK", "cost", "shortfalls"]


@dataclass(frozen=True)
class EpisodeCost:
    """What one idle episode holds of each limit (see the module)."""

    descriptors: int
    ptys: int
    tasks: int
    user_namespaces: int
    memory_mb: float


IDLE = EpisodeCost(descriptors=6, ptys=1, tasks=4, user_namespaces=1, memory_mb=3.0)
IDLE_WITH_NETWORK = EpisodeCost(descriptors=17, ptys=1, tasks=6, user_namespaces=2, memory_mb=4.0)
# Room kept besides the episodes: one episode starting (its descriptors at their most), and
# as much again for the caller's own work (the same margin Episode.reset keeps).
_DESCRIPTOR_MARGIN = 64
_TASK_MARGIN = 64


def cost(*, network: bool = False, session: bool = False) -> EpisodeCost:
    """One idle episode's share (``session``: a ``sequester serve`` session's, which adds a
    socket and a worker thread)."""
    base = IDLE_WITH_NETWORK if network else IDLE
    if not session:
        return base
    return EpisodeCost(base.descriptors + 1, base.ptys, base.tasks + 1, base.user_namespaces, base.memory_mb)


def _mem_available_mb() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _descriptors(n: int, each: EpisodeCost) -> str | None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # What the first reset raises the soft limit to (sequester.sandbox.fdlimit), and past
    # that as far as the hard limit, when an episode needs it.
    most = hard if hard != resource.RLIM_INFINITY else max(soft, RAISED_SOFT_LIMIT) * 1024
    held = open_descriptors()
    need = n * each.descriptors + _DESCRIPTOR_MARGIN
    if held + need <= most:
        return None
    wanted = 4096
    while wanted < held + need:
        wanted *= 2
    return (
        f"the open-file limit: {n} episodes hold about {n * each.descriptors} descriptors ({each.descriptors} each) "
        f"and starting one needs {_DESCRIPTOR_MARGIN} more; this process holds {held} and may hold at most {most} "
        f"(RLIMIT_NOFILE: soft {soft}, hard {'unlimited' if hard == resource.RLIM_INFINITY else hard}): raise it "
        f"(ulimit -n {wanted} in the shell that starts the process, as root above the hard limit; LimitNOFILE= "
        "in a systemd unit; nofile in /etc/security/limits.conf)"
    )


def shortfalls(n: int, *, network: bool = False, session: bool = False) -> list[str]:
    """Why ``n`` more idle episodes (``network``: each with a network; ``session``: each a
    ``sequester serve`` session) cannot be held here at once: one sentence per limit they
    would pass, naming it and how to raise it; ``[]`` when they fit."""
    each = cost(network=network, session=session)
    found: list[str] = []
    fds = _descriptors(n, each)
    if fds is not None:
        found.append(fds)
    ptys = pty_limits()
    if ptys is not None:
        limit, reserve = ptys
        room = (limit.room or 0) - reserve  # (a container's /dev/pts may not take the reserve)
        if n * each.ptys > room:
            found.append(
                f"ptys: {n} episodes hold {n * each.ptys} (one per shell); kernel.pty.max is {limit.value}, "
                f"{limit.used} are in use and the last {reserve} (kernel.pty.reserve) are only for the host's own "
                f"/dev/pts: raise it as root (sysctl -w kernel.pty.max={max(2 * limit.value, 2 * n * each.ptys)})"
            )
    for limit in task_limits():
        need = n * each.tasks + _TASK_MARGIN
        have = limit.room if limit.room is not None else limit.value
        if need > have:
            used = f", {limit.used} in use" if limit.used is not None else ""
            found.append(
                f"processes and threads: {n} episodes run about {n * each.tasks} ({each.tasks} each); "
                f"{limit.name} is {limit.value}{used}: raise it"
            )
    for limit in namespace_limits():
        need = n * (each.user_namespaces if limit.name == "user.max_user_namespaces" else 1)
        if need > limit.value:
            found.append(
                f"namespaces: {n} episodes make at least {need}; {limit.name} is {limit.value} (not counting those "
                f"in use): raise it as root (sysctl -w {limit.name}={2 * need})"
            )
    available = _mem_available_mb()
    if available is not None and n * each.memory_mb > available:
        found.append(
            f"memory: {n} idle episodes take about {n * each.memory_mb:.0f} MB ({each.memory_mb:g} MB each, the "
            f"kernel's memory for them included); this machine has {available:.0f} MB available"
        )
    return found
