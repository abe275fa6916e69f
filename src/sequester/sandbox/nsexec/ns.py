"""Namespace primitives of the namespace helper (see :mod:`.server`): entering an
episode's namespaces, the agent's restrictions, the helper's pipes. Loaded before any
namespace change, like everything the helper runs."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import signal
from typing import Any

from sequester.guard import privileges, seccomp

libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_REC, MS_PRIVATE, MNT_DETACH = 0x4000, 1 << 18, 2
NS_GET_PARENT = 0xB702
PR_SET_PDEATHSIG = 1
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
# statvfs's flags -> mount(2)'s: a remount must repeat the flags a mount was locked with.
_KEPT_FLAGS = (
    (os.ST_NOSUID, MS_NOSUID),
    (os.ST_NODEV, MS_NODEV),
    (os.ST_NOEXEC, MS_NOEXEC),
    (os.ST_NOATIME, MS_NOATIME),
    (os.ST_NODIRATIME, MS_NODIRATIME),
    (os.ST_RELATIME, MS_RELATIME),
)
# Attack: a root caller's agent (and every program its tests run) is host uid 0, and
# procfs lets host uid 0 write the kernel's global settings whatever its capabilities
# (kernel.core_pattern = "|/path" runs a program as host root at the next crash;
# sysrq-trigger reboots the host). These are bound read-only over themselves, as Docker does.
PROC_READONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs")
# Attack: bwrap binds the host's own device nodes into /dev; host uid 0 could chmod, chown
# or touch the host's /dev/null itself. On a read-only mount those are refused, while the
# devices still read and write.
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")


def remount_readonly(path: str) -> None:
    """``path`` (a mount point) read-only, its other flags kept."""
    flags = MS_BIND | MS_REMOUNT | MS_RDONLY
    current = os.statvfs(path).f_flag
    for st_flag, ms_flag in _KEPT_FLAGS:
        if current & st_flag:
            flags |= ms_flag
    check(libc.mount(None, path.encode(), None, flags, None), f"remount {path} read-only")


def harden_proc(proc: str = "/proc") -> None:
    """The parts of a fresh procfs that reach beyond its namespaces, read-only."""
    for name in PROC_READONLY:
        path = f"{proc}/{name}"
        if os.path.lexists(path):
            check(libc.mount(path.encode(), path.encode(), None, MS_BIND | MS_REC, None), f"bind {path}")
            remount_readonly(path)


def harden_dev(dev: str = "/dev") -> None:
    """The host's device nodes of the view's /dev, read-only mounts (see DEV_NODES)."""
    for name in DEV_NODES:
        path = f"{dev}/{name}"
        if os.path.lexists(path) and os.path.ismount(path):
            remount_readonly(path)


def check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def die_with_parent(parent: int | None) -> None:
    """SIGKILL when the parent dies. ``parent``: its pid as we see it, to catch a parent
    that died before the signal was armed (None for a PID namespace's init, whose parent
    is outside it and shows as 0)."""
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def _procs_files(cgroup: str | list[str] | None) -> list[str]:
    return [cgroup] if isinstance(cgroup, str) else list(cgroup or ())


def join_cgroups(cgroup: str | list[str] | None, pid: int = 0) -> None:
    """``pid`` (0: this process) into each ``cgroup.procs`` file of ``cgroup``. This
    process itself into a cgroup v1 hierarchy: see :func:`_join_v1_self`."""
    for procs in _procs_files(cgroup):
        if not pid and _join_v1_self(procs):
            continue
        with open(procs, "w") as f:
            f.write(str(pid or os.getpid()))


def _join_v1_self(procs: str) -> bool:
    """Move the calling thread into the v1 cgroup of ``procs`` by writing 0 to the
    ``tasks`` file beside it; False where there is none (cgroup v2). The namespace
    helper's workers are single-threaded (forked from a single-threaded server), so the
    thread is the process. Why: writing a pid to ``cgroup.procs`` takes the kernel's
    global threadgroup lock, which waits for an RCU grace period (measured 5-11 ms on
    this machine kind when the previous move was not just before); moving the current
    single thread does not take it (``cgroup_procs_write_start``: 1.2-1.7 ms with the
    fork, measured side by side)."""
    tasks = os.path.join(os.path.dirname(procs), "tasks")
    try:
        fd = os.open(tasks, os.O_WRONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        os.write(fd, b"0")
    finally:
        os.close(fd)
    return True


def start_joining(cgroup: str | list[str] | None) -> int | None:
    """A child that moves this process into ``cgroup`` while this one goes on: on cgroup
    v2 a move waits for an RCU grace period (the threadgroup lock), which set-up that
    forks nothing can overlap. :func:`finish_joining` (before this process forks
    anything that must be counted there) waits for it; its pid, or None. On cgroup v1
    this process joins at once, without the lock (:func:`_join_v1_self`), and None."""
    files = _procs_files(cgroup)
    if not files:
        return None
    if all(os.path.exists(os.path.join(os.path.dirname(p), "tasks")) for p in files):
        join_cgroups(files)
        return None
    parent = os.getpid()
    child = os.fork()
    if child == 0:  # pragma: no cover - its status is the report
        code = 1
        try:
            # Never a pid the parent no longer holds: dead with it, and checked alive first
            # (its callers wait for this child even when they fail; see finish_joining).
            check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
            if os.getppid() == parent:
                join_cgroups(cgroup, parent)
                code = 0
        finally:
            os._exit(code)
    return child


def finish_joining(child: int | None) -> None:
    """Wait for :func:`start_joining`'s child; raises if the move failed."""
    if child is None:
        return
    _, status = os.waitpid(child, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise OSError(errno.EIO, "could not join the episode's cgroups")


def enter(target: int, *, user: str, pid: bool, cgroup: str | list[str] | None, harden: bool = False) -> None:
    """Join ``target``'s namespaces. First the parent of the agent's user namespace (the
    one bwrap made, which owns the episode's other namespaces): there we hold every
    capability, as root or as the user who made it, which joining the others needs. Then
    the mount, network, IPC and UTS namespaces (and PID, for children); last, for
    ``user="agent"``, the agent's own user namespace. ``harden``: in the mount namespace,
    while we still hold those capabilities, make its /proc and /dev safe first."""
    join_cgroups(cgroup)  # the freezer's, the limits'
    fds = {
        name: os.open(f"/proc/{target}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC)
        for name in ("mnt", "net", "ipc", "uts", "pid", "user")
    }
    try:
        parent = fcntl.ioctl(fds["user"], NS_GET_PARENT)
        one_level = False
        try:
            if libc.setns(parent, CLONE_NEWUSER) != 0:
                if ctypes.get_errno() != errno.EINVAL:
                    check(-1, "setns(user)")
                # EINVAL: the parent is ours, so the target is in the first user namespace
                # bwrap made (a build step's bwrap, held before its command nests one; an
                # episode whose map the launcher wrote, sandbox.idmap, where bwrap nests
                # none): that namespace is the one that owns the others.
                check(libc.setns(fds["user"], CLONE_NEWUSER), "setns(user)")
                one_level = True
        finally:
            os.close(parent)
        order = [("mnt", CLONE_NEWNS), ("net", CLONE_NEWNET), ("ipc", CLONE_NEWIPC), ("uts", CLONE_NEWUTS)]
        if pid:
            order.append(("pid", CLONE_NEWPID))
        if user == "agent" and not one_level:
            order.append(("user", CLONE_NEWUSER))
        for name, flag in order:
            if name == "user" and harden:
                harden_proc("/proc")
                harden_dev("/dev")
            check(libc.setns(fds[name], flag), f"setns({name})")
        if harden and one_level:
            # bwrap nests no user namespace under a map the launcher wrote, so it cannot
            # forbid nested ones (--disable-userns): no process of the episode may make one.
            # (Before /proc/sys goes read-only below.)
            with open("/proc/sys/user/max_user_namespaces", "w") as f:
                f.write("0")
        if harden and (user != "agent" or one_level):
            harden_proc("/proc")
            harden_dev("/dev")
    finally:
        for fd in fds.values():
            os.close(fd)


def restrict(bpf: bytes, nr: int, caps: list[str], ids: list[int] | None = None) -> None:
    """The agent's restrictions: seccomp (while we may still load it), then capabilities,
    then ``ids`` (an image's non-root ``User`` in a namespace whose root is the caller):
    who the process becomes, which clears what capabilities it kept."""
    seccomp.load_filter(bpf, nr)
    privileges.keep_capabilities(caps if ids is None else [*caps, "CAP_SETUID", "CAP_SETGID"])
    if ids is not None:
        privileges.become(ids[0], ids[1])


def report(fd: int, message: dict[str, Any]) -> None:
    data = (json.dumps(message) + "\n").encode()
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)
