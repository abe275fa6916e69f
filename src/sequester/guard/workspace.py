"""The kernel side of :mod:`.namespaces`: unshare, then apply a planned workspace.

The host plans the mounts (:func:`.namespaces.plan_workspace`, pure, depends only on the
policy and the view) and hands them to the kernel's first stage as plain tuples
(:func:`steps_for_kernel`), so the first stage imports neither ``dataclasses`` nor
``pathlib`` (milliseconds at every start) and recomputes nothing. Needs ctypes: first
stage only.
"""

from __future__ import annotations

import os
import sys

__all__ = ["apply_workspace", "steps_for_kernel"]

CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000
MNT_DETACH = 0x2
_SYS_MOUNT_SETATTR, _AT_FDCWD, _AT_RECURSIVE = 442, -100, 0x8000  # the same on every architecture
_SIOCSIFFLAGS, _IFF_UP = 0x8914, 0x1
_AF_INET, _SOCK_DGRAM = 2, 2


def steps_for_kernel(steps) -> list[tuple]:
    """``MountStep``-s as ``(op, target, source, fstype, flags, data, mode, parents)`` of
    str and int only (``parents``: a mount point's ancestors, outermost first). A
    ``setattr`` step is ``(op, target, None, None, set, None, clear, ["recursive"] or [])``."""
    out = []
    for s in steps:
        if s.op == "setattr":
            out.append((s.op, str(s.target), None, None, s.flags, None, s.clear, ["recursive"] if s.recursive else []))
            continue
        parents = [str(p) for p in reversed(s.target.parents)] if s.op == "mountpoint" else []
        out.append((s.op, str(s.target), s.source, s.fstype, s.flags, s.data, s.mode, parents))
    return out


def apply_workspace(steps: list[tuple], workspace: str) -> None:
    """Unshare mount and network namespaces, apply ``steps`` (:func:`steps_for_kernel`),
    bring up loopback and let every port be bound. Needs CAP_SYS_ADMIN and CAP_NET_ADMIN
    in the current user namespace; the bootstrap drops both right after."""
    import ctypes
    import errno
    import fcntl
    import struct

    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    check(libc.unshare(CLONE_NEWNS | CLONE_NEWNET), "unshare(mount, network)")
    for op, target, source, fstype, flags, data, mode, parents in steps:
        if op == "mountpoint":
            for parent in parents:
                if not os.path.exists(parent):
                    os.mkdir(parent, 0o755)
                    os.chmod(parent, 0o755)
            if os.path.isdir(source):
                os.mkdir(target, 0o755)
            else:
                open(target, "x").close()
        elif op == "mkdir":
            os.mkdir(target, mode)
            os.chmod(target, mode)  # not narrowed by the umask
        elif op == "umount":
            check(libc.umount2(os.fsencode(target), MNT_DETACH), f"umount {target}")
        elif op == "setattr":
            # struct mount_attr: attr_set, attr_clr, propagation, userns_fd (u64 each).
            attr = struct.pack("=QQQQ", flags, mode, 0, 0)
            done = libc.syscall(
                ctypes.c_long(_SYS_MOUNT_SETATTR),
                ctypes.c_int(_AT_FDCWD),
                ctypes.c_char_p(os.fsencode(target)),
                ctypes.c_uint(_AT_RECURSIVE if parents else 0),
                ctypes.c_char_p(attr),
                ctypes.c_size_t(len(attr)),
            )
            if done != 0 and ctypes.get_errno() != errno.ENOSYS:  # older than 5.12: bwrap's remounts stand
                check(done, f"mount_setattr {target}")
        elif op == "mount":
            check(
                libc.mount(
                    os.fsencode(source) if source else None,
                    os.fsencode(target),
                    fstype.encode() if fstype else None,
                    ctypes.c_ulong(flags),
                    data.encode() if data else None,
                ),
                f"mount {target}",
            )
        else:
            raise ValueError(f"unknown workspace step {op!r}")
    os.chdir(workspace)
    import _socket  # the C module: ``socket`` would import enum, selectors, ...

    s = _socket.socket(_AF_INET, _SOCK_DGRAM)
    try:
        # struct ifreq: the name (16 bytes), then ifr_flags (a short), padded to 40 bytes.
        ifreq = b"lo".ljust(16, b"\0") + _IFF_UP.to_bytes(2, sys.byteorder) + bytes(22)
        fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, ifreq)
    finally:
        s.close()
    with open("/proc/sys/net/ipv4/ip_unprivileged_port_start", "w") as f:
        f.write("0")
