"""Namespace primitives of the namespace helper (see :mod:`._nsexec_server`): entering an
episode's namespaces, the agent's restrictions, the helper's pipes. Loaded before any
namespace change, like everything the helper runs."""

from __future__ import annotations

import ctypes
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


def enter(target: int, *, user: str, pid: bool, cgroup: str | list[str] | None) -> None:
    """Join ``target``'s namespaces. First the parent of the agent's user namespace (the
    one bwrap made, which owns the episode's other namespaces): there we hold every
    capability, as root or as the user who made it, which joining the others needs. Then
    the mount, network, IPC and UTS namespaces (and PID, for children); last, for
    ``user="agent"``, the agent's own user namespace."""
    for procs in [cgroup] if isinstance(cgroup, str) else (cgroup or ()):  # the freezer's, the limits'
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    fds = {name: os.open(f"/proc/{target}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC)
           for name in ("mnt", "net", "ipc", "uts", "pid", "user")}
    try:
        parent = fcntl.ioctl(fds["user"], NS_GET_PARENT)
        try:
            check(libc.setns(parent, CLONE_NEWUSER), "setns(user)")
        finally:
            os.close(parent)
        order = [("mnt", CLONE_NEWNS), ("net", CLONE_NEWNET), ("ipc", CLONE_NEWIPC), ("uts", CLONE_NEWUTS)]
        if pid:
            order.append(("pid", CLONE_NEWPID))
        if user == "agent":
            order.append(("user", CLONE_NEWUSER))
        for name, flag in order:
            check(libc.setns(fds[name], flag), f"setns({name})")
    finally:
        for fd in fds.values():
            os.close(fd)


def restrict(bpf: bytes, nr: int, caps: list[str]) -> None:
    """The agent's restrictions: seccomp (while we may still load it), then capabilities."""
    seccomp.load_filter(bpf, nr)
    privileges.keep_capabilities(caps)


def report(fd: int, message: dict[str, Any]) -> None:
    data = (json.dumps(message) + "\n").encode()
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


