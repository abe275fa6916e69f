"""The host's limits a sandbox counts against beyond this process's open-file limit
(:mod:`sequester.sandbox.fdlimit`): read in one place, checked before a sandbox starts where
that is cheap, and named in the error when one is reached (issue #25: a thousand episodes).

* **ptys** (``kernel.pty.max``): an episode's shell holds one of the host's ptys, its
  terminal. A ``/dev/pts`` mounted from the host's initial mount namespace may use all of
  ``kernel.pty.max``; any other (a container's) all but ``kernel.pty.reserve`` of it
  (defaults 4096 and 1024). ``kernel.pty.nr`` counts those in use, machine-wide.
* **tasks**: every process and thread of the machine counts against ``kernel.pid_max``
  and ``kernel.threads-max``, and every one in this process's cgroup (the sandboxes'
  processes start there) against its ``pids.max`` and its parents' (a systemd unit's
  ``TasksMax``); an ordinary user's, against its ``RLIMIT_NPROC`` too.
* **user namespaces** (``user.max_user_namespaces``, and the other ``user.max_*_namespaces``;
  per user namespace, so a container may have its own, lower): counting those in use means
  reading every process's descriptors, so it is never done before a sandbox starts; one
  that cannot be made fails in bwrap with ``ENOSPC``, which :func:`explain` names.

Nothing here raises a limit: a full table is the operator's to raise (``sysctl``), and the
messages say which one and how.
"""

from __future__ import annotations

import errno
import os
import re
import resource
from dataclasses import dataclass
from pathlib import Path

from sequester.errors import SandboxError
from sequester.sandbox.cgroups.hierarchy import find_v1, find_v2, own_cgroup

__all__ = ["Limit", "check_pty_room", "explain", "no_pty_left", "pty_limits", "task_limits", "namespace_limits"]

_PROC = Path("/proc")


@dataclass(frozen=True)
class Limit:
    """One limit: its name as an operator sets it, how much of it is in use (None: not
    counted) and its value."""

    name: str
    used: int | None
    value: int

    @property
    def room(self) -> int | None:
        return None if self.used is None else self.value - self.used


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def pty_limits(proc: Path = _PROC) -> tuple[Limit, int] | None:
    """``kernel.pty.max`` with ``kernel.pty.nr`` in use, and ``kernel.pty.reserve`` (the
    part only the host's own ``/dev/pts`` may use); None where the kernel does not say."""
    used, most = _read_int(proc / "sys/kernel/pty/nr"), _read_int(proc / "sys/kernel/pty/max")
    if used is None or most is None:
        return None
    return Limit("kernel.pty.max", used, most), _read_int(proc / "sys/kernel/pty/reserve") or 0


def _pty_text(limit: Limit, reserve: int) -> str:
    return (
        f"kernel.pty.max is {limit.value} and {limit.used} ptys are in use on this machine (kernel.pty.nr; "
        f"the last {reserve} are only for the host's own /dev/pts, not a container's): every episode's shell "
        f"holds one. Raise it as root (sysctl -w kernel.pty.max={max(2 * limit.value, 8192)}), or run fewer "
        "episodes at once"
    )


def check_pty_room(what: str, proc: Path = _PROC) -> None:
    """Raise :class:`SandboxError` for ``what`` when every pty of the machine is in use
    (before anything of it starts)."""
    found = pty_limits(proc)
    if found is not None and found[0].room is not None and found[0].room <= 0:
        raise SandboxError(f"{what} needs a pty, and none is left: {_pty_text(*found)}")


def no_pty_left(exc: OSError, what: str, proc: Path = _PROC) -> SandboxError | None:
    """The error for ``exc`` from opening a pty when it is the machine's pty limit
    (``ENOSPC``); None for any other error."""
    if exc.errno != errno.ENOSPC:
        return None
    found = pty_limits(proc)
    detail = _pty_text(*found) if found is not None else "kernel.pty.max is reached"
    return SandboxError(f"{what} could not get a pty (the machine's ptys are all in use): {detail}")


def _task_count(proc: Path) -> int | None:
    """Every thread of the machine, from ``/proc/loadavg``'s ``running/total``."""
    try:
        return int((proc / "loadavg").read_text().split()[3].split("/")[1])
    except (OSError, IndexError, ValueError):
        return None


def _own_pids_cgroups() -> list[Path]:
    """This process's cgroups that hold a ``pids.max``, itself and its parents (v2, and v1's
    ``pids`` hierarchy)."""
    found: list[Path] = []
    for mount, own in ((find_v2(), own_cgroup(None)), (find_v1("pids"), own_cgroup("pids"))):
        if mount is None or own is None:
            continue
        relative = own[len(mount.root) :] if own.startswith(mount.root) else None
        if relative is None:
            continue
        here = mount.mount / relative.lstrip("/")
        while True:
            if (here / "pids.max").exists():
                found.append(here)
            if here == mount.mount or here.parent == here:
                break
            here = here.parent
    return found


def task_limits(proc: Path = _PROC) -> list[Limit]:
    """The limits a new process or thread counts against, with what is in use: the
    machine's ``kernel.pid_max`` and ``kernel.threads-max``, this process's cgroups'
    ``pids.max``, and for an ordinary user ``RLIMIT_NPROC`` (its use not counted: that
    takes a walk of every process)."""
    found: list[Limit] = []
    tasks = _task_count(proc)
    for name, path in (("kernel.pid_max", "sys/kernel/pid_max"), ("kernel.threads-max", "sys/kernel/threads-max")):
        value = _read_int(proc / path)
        if value is not None:
            found.append(Limit(name, tasks, value))
    for group in _own_pids_cgroups():
        value = _read_int(group / "pids.max")
        if value is not None:
            found.append(Limit(f"pids.max of the cgroup {group}", _read_int(group / "pids.current"), value))
    if os.geteuid() != 0:
        soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
        if soft != resource.RLIM_INFINITY:
            found.append(Limit("RLIMIT_NPROC (ulimit -u)", None, soft))
    return found


def namespace_limits(proc: Path = _PROC) -> list[Limit]:
    """``user.max_*_namespaces`` as this process's user namespace has them (in use: not counted)."""
    found = []
    for kind in ("user", "mnt", "pid", "net", "ipc", "uts", "cgroup"):
        value = _read_int(proc / f"sys/user/max_{kind}_namespaces")
        if value is not None:
            found.append(Limit(f"user.max_{kind}_namespaces", None, value))
    return found


_NAMESPACE_FULL = re.compile(r"(namespace|unshare|clone).*(No space left on device|ENOSPC)", re.IGNORECASE)
_TASKS_FULL = re.compile(r"Resource temporarily unavailable|EAGAIN", re.IGNORECASE)


def explain(message: str, proc: Path = _PROC) -> str:
    """``message`` (a sandbox's failure, bwrap's words) with the host's limit it hit named,
    when it says a namespace could not be made for lack of room (``ENOSPC``) or a process
    could not be started (``EAGAIN``); else ``message`` as it is."""
    if _NAMESPACE_FULL.search(message):
        limits = namespace_limits(proc)
        user = next((limit.value for limit in limits if limit.name == "user.max_user_namespaces"), None)
        # user.max_user_namespaces, and any other kind's limit set lower than it
        shown = [limit for limit in limits if user is None or limit.value < user or "_user_" in limit.name]
        values = ", ".join(f"{limit.name} = {limit.value}" for limit in shown) or "user.max_user_namespaces"
        lowest = min(shown, key=lambda limit: limit.value).name if shown else "user.max_user_namespaces"
        return (
            f"{message} -- the host's limit on namespaces is reached ({values}; per user namespace: a "
            "container may have lower ones): every episode makes a user, mount, PID, network, IPC and UTS "
            f"namespace, two of some with a network. Raise the limit as root (sysctl -w {lowest}=N, where "
            "the sandbox's user namespace is made), or run fewer episodes at once"
        )
    if _TASKS_FULL.search(message):
        tasks = [
            f"{limit.name} = {limit.value}" + (f" ({limit.used} in use)" if limit.used is not None else "")
            for limit in task_limits(proc)
        ]
        return (
            f"{message} -- no process could be started: a limit on processes and threads may be reached "
            f"({'; '.join(tasks) or 'kernel.pid_max, kernel.threads-max'}): every idle episode runs 4 "
            "processes (bwrap, its init and the init's sleep, the shell), 5 and a thread with a network. "
            "Raise the one that is full, or run fewer episodes at once"
        )
    return message
