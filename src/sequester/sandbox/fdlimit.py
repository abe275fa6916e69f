"""The calling process's open-file limit (``RLIMIT_NOFILE``): raised once, and checked
before a sandbox that holds descriptors starts.

Every running episode holds descriptors in the process that started it (its shell's pipes
and pty, pidfds, its network's sockets: docs/running-tasks.md counts them). The soft limit
is 1024 on most systems, for the sake of programs that wait with ``select``; sequester's
host side waits with ``poll`` and epoll only (:mod:`sequester.sandbox.readiness`), so, as
Ray's ``ray.init`` does, the first sandbox that needs room raises the soft limit to the
hard one, capped at :data:`RAISED_SOFT_LIMIT` (a program that closes every descriptor up to
its limit stays quick). Never lowered. The agent's and the verifier's processes get a
container's limits whatever this process has (``CONTAINER_RLIMITS``).

When the room asked for is still not there (the hard limit is low, or the process holds
that many already), :func:`ensure_room` raises it as far as the hard limit allows, and
otherwise fails before anything starts, with the numbers and the way to raise the limit,
rather than a sandbox failing half-made on ``EMFILE``.
"""

from __future__ import annotations

import os
import resource
import threading

from sequester.errors import SandboxError

__all__ = ["RAISED_SOFT_LIMIT", "ensure_room", "open_descriptors"]

# The soft limit the first use raises to (when the hard limit allows): room for about
# three thousand episodes with a network, and still a bounded loop for a program that
# closes every descriptor up to its limit (Ray's ray.init picks the same).
RAISED_SOFT_LIMIT = 65536

_lock = threading.Lock()
_raised = False


def open_descriptors() -> int:
    """How many descriptors this process holds now (its own count, from ``/proc``)."""
    return len(os.listdir("/proc/self/fd")) - 1  # less the one listdir held while it read


def _table_size() -> int | None:
    """The size of this process's descriptor table (``FDSize``): no descriptor it holds is
    numbered at or above it, so at most that many are open. A cheap upper bound: reading
    ``/proc/self/fd`` takes tens of milliseconds with tens of thousands open."""
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"FDSize:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _can_open(needed: int) -> bool:
    """Whether ``needed`` more descriptors can be opened now: they are (one of ``/dev/null``
    and duplicates of it, close-on-exec) and closed again at once, microseconds where
    counting the open ones (listing ``/proc/self/fd``) took 100 ms with 17,000 open, a
    thousand episodes with a network (issue #25). The kernel gives the lowest free
    numbers, so this is the count's answer (``held + needed <= soft``), without the count."""
    held: list[int] = []
    try:
        held.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
        while len(held) < needed:
            held.append(os.dup(held[0]))  # (os.dup's copies are close-on-exec too)
    except OSError:  # EMFILE; ENFILE, the machine's table full, is no room either
        return False
    finally:
        for fd in held:
            os.close(fd)
    return True


def _set_soft(soft: int, hard: int) -> bool:
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    except (OSError, ValueError):
        return False
    return True


def ensure_room(needed: int, what: str) -> None:
    """Make sure this process can open ``needed`` more descriptors for ``what`` (e.g.
    "another episode"): the soft limit raised first (once per process, see the module),
    then as far as the hard limit when that is what it takes; else
    :class:`~sequester.errors.SandboxError`, naming the limit and how to raise it."""
    global _raised
    with _lock:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if not _raised:
            _raised = True
            target = RAISED_SOFT_LIMIT if hard == resource.RLIM_INFINITY else min(hard, RAISED_SOFT_LIMIT)
            if soft != resource.RLIM_INFINITY and soft < target and _set_soft(target, hard):
                soft = target
        if soft == resource.RLIM_INFINITY:
            return
        size = _table_size()
        if size is not None and size + needed <= soft:
            return  # fewer than that are open: no need to count
        if _can_open(needed):
            return  # (counting is left for the refusal's message)
        try:
            held = open_descriptors()
        except OSError:  # EMFILE: not even one more
            held = soft
        if held + needed <= soft:
            return
        if hard == resource.RLIM_INFINITY or hard > soft:
            wanted = max(2 * soft, held + needed)
            raised = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
            if _set_soft(raised, hard):
                soft = raised
                if held + needed <= soft:
                    return
    raise SandboxError(
        f"{what} needs {needed} free file descriptors, and this process holds {held} of the "
        f"{soft} its open-file limit allows (RLIMIT_NOFILE: soft {soft}, hard "
        f"{'unlimited' if hard == resource.RLIM_INFINITY else hard}): raise the limit of the process that runs "
        f"sequester (in its shell `ulimit -n {_suggest(held + needed)}` before starting it, as root if above the hard "
        "limit; LimitNOFILE= in a systemd unit; nofile in /etc/security/limits.conf), or close some of what it holds"
    )


def _suggest(at_least: int) -> int:
    """A round number to suggest: the next power of two, at least 4096."""
    value = 4096
    while value < at_least:
        value *= 2
    return value
