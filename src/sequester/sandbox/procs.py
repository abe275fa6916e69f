"""The processes of one PID namespace, as the host's ``/proc`` shows them.

Everything here is chosen so that an agent cannot steer it:

* **Membership is by namespace, not by tree**: a process belongs to the episode iff its
  ``/proc/PID/ns/pid`` is the episode init's namespace (same device and inode). A walk of
  ``children`` from the init misses a process whose parent exited between two reads (it
  is re-parented while we look) and is slow; the namespace test is complete by
  construction. The namespace is pinned by an open descriptor (:class:`Namespace`), so
  its inode number cannot be reused by another namespace while we compare.
* **One process, one handle**: each process is opened as a ``/proc/PID`` directory
  descriptor (:class:`Proc`); every later read *and every signal* goes through that
  descriptor (``pidfd_send_signal`` accepts a ``/proc/PID`` directory), so a pid that is
  recycled between our look and our signal (``pid_max`` is 32768 here: an agent can
  cycle it in seconds) never makes us stop or kill a host process.
* **Nothing agent-written is parsed loosely**: ``comm`` (in ``stat`` and ``status``) is
  the only text an agent chooses; ``stat`` is split after its *last* ``)`` (a ``comm``
  may hold spaces and parentheses), and ``status`` is read by exact ``Key:`` prefixes,
  skipping ``Name:`` (the kernel escapes newlines there, so it cannot fake a line).
  ``cmdline`` and ``comm`` themselves are never read.

Signals by pid go through pidfds (:func:`open_pidfd`): a pidfd always refers to the
process it was opened on, and membership of the namespace is checked after opening, so a
number the host reused is never hit. The docker backend uses the same helpers on a
container's processes when its engine runs on this host.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import signal
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

__all__ = [
    "Namespace",
    "Proc",
    "Thread",
    "Identity",
    "parse_stat",
    "reopen",
    "SIGSTOP_BIT",
    "pid_namespace",
    "open_pidfd",
    "kill_tree",
    "kill_init",
    "signal_group_in",
    "signal_in",
    "descendants",
]

_GONE = (errno.ENOENT, errno.ESRCH)
SIGSTOP_BIT = 1 << (signal.SIGSTOP - 1)


@dataclass(frozen=True)
class Identity:
    """A process for the whole of its life: its pid and its start time (clock ticks after
    boot; a recycled pid has a later one)."""

    pid: int
    start: int


@dataclass(frozen=True)
class Thread:
    """One look at one thread: its state letter and how often it has been switched out
    (``voluntary`` + ``nonvoluntary``: a thread that ran at all since the last look has a
    larger count, even if it is stopped again), and whether SIGSTOP is pending for it."""

    tid: int
    state: str
    switches: int
    stop_pending: bool


def parse_stat(data: bytes) -> tuple[str, int, int]:
    """``(state, ppid, starttime)`` from a ``stat`` line. The fields after ``comm`` start
    after the last ``)``: a ``comm`` of ``x) R 1 (`` cannot shift them."""
    rest = data[data.rindex(b")") + 2 :].split()
    return rest[0].decode("ascii"), int(rest[1]), int(rest[19])


def _status_fields(data: bytes) -> dict[str, str]:
    fields = {}
    for line in data.decode("ascii", "replace").splitlines():
        if line.startswith("Name:"):
            continue  # the one agent-chosen value; never used
        key, sep, value = line.partition(":")
        if sep:
            fields[key] = value.strip()
    return fields


class Namespace:
    """An episode's PID namespace, pinned by a descriptor of its ``ns/pid`` file."""

    def __init__(self, init_pid: int):
        self.init_pid = init_pid
        self._fd = os.open(f"/proc/{init_pid}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        st = os.fstat(self._fd)
        self.key = (st.st_dev, st.st_ino)
        with open(f"/proc/{init_pid}/stat", "rb") as f:
            self.init = Identity(init_pid, parse_stat(f.read())[2])

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def members(self) -> Iterator[Proc]:
        """Every process of the namespace (opened; the caller closes each). Processes we
        may not inspect are skipped: as root there are none; as an ordinary user they
        are other users' (the episode's processes are ours, and we own their user
        namespace, so even a non-dumpable one stays readable to us)."""
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            proc = Proc.open(int(name))
            if proc is None:
                continue
            if proc.namespace() == self.key:
                yield proc
            else:
                proc.close()


class Proc:
    """A ``/proc/PID`` directory descriptor: reads and signals reach this process or fail."""

    def __init__(self, pid: int, fd: int):
        self.pid, self.fd = pid, fd
        self._identity: Identity | None = None

    @classmethod
    def open(cls, pid: int) -> Proc | None:
        try:
            return cls(pid, os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
        except OSError:
            return None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Proc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read(self, rel: str) -> bytes | None:
        """A file below ``/proc/PID`` (None once the process is gone or unreadable)."""
        try:
            fd = os.open(rel, os.O_RDONLY | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError:
            return None
        try:
            return os.read(fd, 1 << 16)
        except OSError:
            return None
        finally:
            os.close(fd)

    def namespace(self) -> tuple[int, int] | None:
        """The process's PID namespace. A thread-group leader that exited while its other
        threads run is a zombie whose own link may be gone: then ask a live thread (an
        agent must not hide a running thread behind a dead leader)."""
        for rel in ("ns/pid", *(f"task/{tid}/ns/pid" for tid in self.tids())):
            try:
                st = os.stat(rel, dir_fd=self.fd)
            except OSError:
                continue
            return st.st_dev, st.st_ino
        return None

    def identity(self) -> Identity | None:
        if self._identity is None:
            data = self.read("stat")
            if data is None:
                return None
            self._identity = Identity(self.pid, parse_stat(data)[2])
        return self._identity

    def tids(self) -> list[int]:
        try:
            fd = os.open("task", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError:
            return []
        try:
            return sorted(int(t) for t in os.listdir(fd) if t.isdigit())
        except OSError:
            return []
        finally:
            os.close(fd)

    def children(self) -> set[int]:
        """Host pids of the children of every thread (``task/TID/children``)."""
        out: set[int] = set()
        for tid in self.tids():
            data = self.read(f"task/{tid}/children")
            if data:
                out.update(int(c) for c in data.split())
        return out

    def threads(self) -> list[Thread]:
        """One look at every thread. A thread that vanished between the listing and the
        read is left out (it is gone, or the caller's next pass sees what replaced it)."""
        out = []
        shared = 0
        for tid in self.tids():
            stat, status = self.read(f"task/{tid}/stat"), self.read(f"task/{tid}/status")
            if stat is None or status is None:
                continue
            fields = _status_fields(status)
            try:
                pending = int(fields.get("SigPnd", "0"), 16)
                shared = int(fields.get("ShdPnd", "0"), 16)
                switches = int(fields["voluntary_ctxt_switches"]) + int(fields["nonvoluntary_ctxt_switches"])
            except (KeyError, ValueError):
                continue
            out.append(Thread(tid, parse_stat(stat)[0], switches, bool((pending | shared) & SIGSTOP_BIT)))
        return out

    def signal(self, sig: int) -> bool:
        """Send ``sig`` to this process (never to a successor of its pid); False if gone."""
        try:
            signal.pidfd_send_signal(self.fd, sig)
            return True
        except OSError as exc:
            if exc.errno in _GONE:
                return False
            raise

    def alive(self) -> bool:
        """Not yet reaped (a zombie still holds its pid, so nothing else can have it)."""
        return self.signal(0)


def reopen(ident: Identity) -> Proc | None:
    """The process ``ident`` names, if it still exists (its pid not recycled)."""
    proc = Proc.open(ident.pid)
    if proc is not None and proc.identity() != ident:
        proc.close()
        return None
    return proc


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (breadth first), from ``/proc/PID/task/*/children``.
    A walk with a queue, not recursion: a chain of thousands of nested processes (a
    sandbox's) would overflow Python's stack."""
    seen: set[int] = set()
    out: list[int] = []
    queue = collections.deque([pid])
    while queue:
        for child in _children(queue.popleft()):
            if child not in seen:
                seen.add(child)
                out.append(child)
                queue.append(child)
    return out


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
    return found


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


def signal_in(pid: int, namespace: str | None, sig: int) -> bool:
    """Send ``sig`` to ``pid`` through a pidfd, only if it is in the PID namespace
    ``namespace`` (see :func:`open_pidfd`); whether it was sent."""
    fd = open_pidfd(pid, namespace) if namespace is not None else None
    if fd is None:
        return False
    try:
        signal.pidfd_send_signal(fd, sig)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


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


def signal_group_in(
    pid_ns: str | None, group: int, sig: int, *, session: bool = False, spare: int | None = None
) -> int:
    """Send ``sig`` to the processes of process group ``group`` (``session``: of the
    session ``group``) that are in the PID namespace ``pid_ns``, each through a pidfd;
    ``spare``: but not to that (host) pid. Returns how many were signalled; none when
    the namespace is unknown."""
    if pid_ns is None:
        return 0
    index = 3 if session else 2  # /proc/PID/stat after the command: state ppid pgrp session
    candidates = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or entry == str(spare):
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if len(fields) > index and fields[index] == str(group).encode():
            candidates.append(int(entry))
    sent = 0
    for pid in candidates:
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            if pid_namespace(pid) == pid_ns:  # checked after the pidfd holds the process
                signal.pidfd_send_signal(fd, sig)
                sent += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return sent
