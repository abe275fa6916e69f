"""A container's processes as the host sees them (an engine on this host): found by the
container's PID namespace, signalled through pidfds.

Attack/accident this guards: pid reuse. A pid read from the engine or from ``/proc`` may
belong to another process by the time it is signalled (the exec exited, the host reused
its number): every process is opened as a pidfd first, then checked to be in the
container's PID namespace, and signalled only through that pidfd -- a pidfd always
refers to the process it was opened on, so a reused number is never hit.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterable, Iterator

from sequester.sandbox.bwrap import descendants

__all__ = ["pid_namespace", "open_pidfd", "kill_tree", "Stopped", "stop_namespace"]


def pid_namespace(pid: int) -> str | None:
    """``pid:[N]`` of ``pid``'s PID namespace, or None when it cannot be seen from here."""
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def open_pidfd(pid: int, namespace: str) -> int | None:
    """A pidfd of ``pid`` if it exists and is in ``namespace`` (checked after opening: the
    fd pins the process, so the check cannot be raced by a reused pid), else None."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return None
    if pid_namespace(pid) != namespace:
        os.close(fd)
        return None
    return fd


def _signal(fd: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, OSError):
        signal.pidfd_send_signal(fd, sig)


def kill_tree(pid: int, namespace: str, rounds: int = 10, pidfd: int | None = None) -> bool:
    """SIGKILL ``pid`` and every descendant, each only if it is in ``namespace``. The tree
    is stopped first (SIGSTOP, round after round until no new process appears) so that a
    process forking as fast as it can does not leave children behind the walk. Whether
    ``pid`` itself could be opened (False: it was already gone or is not ours). ``pidfd``:
    one already open on ``pid`` (used, not closed)."""
    root = os.dup(pidfd) if pidfd is not None else open_pidfd(pid, namespace)
    if root is None:
        return False
    fds = {pid: root}
    try:
        _signal(root, signal.SIGSTOP)
        _stop_rounds(lambda: descendants(pid), namespace, fds, rounds)
        for fd in fds.values():
            _signal(fd, signal.SIGKILL)
    finally:
        for fd in fds.values():
            os.close(fd)
    return True


def _stop_rounds(candidates: Callable[[], Iterable[int]], namespace: str, fds: dict[int, int], rounds: int) -> None:
    """SIGSTOP each of ``candidates()`` in ``namespace`` not yet in ``fds`` (its pidfd is
    added), round after round until a round finds none new: a process forking during the
    first rounds has its children stopped in the next."""
    for _ in range(rounds):
        new = [p for p in candidates() if p not in fds]
        if not new:
            break
        for p in new:
            fd = open_pidfd(p, namespace)
            if fd is not None:
                fds[p] = fd
                _signal(fd, signal.SIGSTOP)


def _in_namespace(namespace: str) -> Iterator[int]:
    for name in os.listdir("/proc"):
        if name.isdigit() and pid_namespace(int(name)) == namespace:
            yield int(name)


class Stopped:
    """Processes stopped by :func:`stop_namespace`; :meth:`resume` sends each SIGCONT."""

    def __init__(self, fds: dict[int, int]):
        self._fds = fds

    def __len__(self) -> int:
        return len(self._fds)

    def resume(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            _signal(fd, signal.SIGCONT)
            os.close(fd)


def stop_namespace(namespace: str, rounds: int = 20) -> Stopped:
    """SIGSTOP every process in the PID namespace ``namespace``, round after round until a
    round finds none not yet stopped (a process forking during the first rounds has its
    children stopped in the next)."""
    fds: dict[int, int] = {}
    _stop_rounds(lambda: _in_namespace(namespace), namespace, fds, rounds)
    return Stopped(fds)


def kill_init(pid: int, namespace: str) -> bool:
    """SIGKILL the container's init (``pid``, checked to be in ``namespace`` through a
    pidfd): the kernel then kills every process of its PID namespace, a fork bomb's too,
    without the engine (which a bombed container slows to minutes). Whether it was sent."""
    fd = open_pidfd(pid, namespace)
    if fd is None:
        return False
    try:
        _signal(fd, signal.SIGKILL)
    finally:
        os.close(fd)
    return True
