"""The kernel's own mount and network namespaces, made by its first stage inside the sandbox.

bwrap cannot do two things a kernel needs:

* **a workspace no native code can be loaded from.** bwrap's ``--tmpfs`` has no
  ``noexec`` flag, and ``/dev`` (where ``/dev/shm`` lives) is a tmpfs of its own, not
  size-capped, that an ordinary caller's sandbox owns and can fill. A library written to
  the workspace (the bytes of ``_ctypes``, say) could be ``dlopen``-ed and bring back
  everything the view leaves out. So the first stage mounts **one** tmpfs of
  ``workspace_mb``, ``noexec,nosuid,nodev``, shows it at both ``/tmp`` and ``/dev/shm``
  (binds of two folders of the same tmpfs, so the two together cannot exceed the cap,
  and the binds keep ``noexec``), and makes ``/dev`` itself read-only. ``mmap`` with
  ``PROT_EXEC`` of a file on a ``noexec`` mount fails with ``EPERM``, which is what
  ``dlopen`` does.
* **allowed services on ports below 1024 for an ordinary caller.** Its bwrap ends in a
  nested user namespace that owns neither the mount nor the network namespace, so a
  capability there cannot bind port 443 in bwrap's network namespace. A network
  namespace the kernel makes itself is owned by its own user namespace: there it may set
  ``net.ipv4.ip_unprivileged_port_start = 0`` (the namespace holds nothing but this
  kernel's loopback, so "privileged ports" protect nothing in it), and the bridge can
  then bind any port after every capability is gone.

The same steps run for a root caller (whose bwrap owns its namespaces anyway), so both
flows get the same view. :func:`plan_workspace` is pure; :func:`enter_private_namespaces`
applies it (ctypes: first stage only).
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MountStep", "plan_workspace", "enter_private_namespaces", "STAGING"]

CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
MNT_DETACH = 0x2
_SIOCSIFFLAGS, _IFF_UP = 0x8914, 0x1

# Where the workspace tmpfs is mounted while its two folders are bound into place; an
# empty folder bwrap made (the view's /run), back to empty once the staging is detached.
STAGING = Path("/run")
_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC


@dataclass(frozen=True)
class MountStep:
    """One ``mount(2)`` (``source`` None: a remount), ``mkdir`` or lazy ``umount``."""

    op: str  # "mount" | "mkdir" | "umount" | "mountpoint" (parents 0755, then a folder or file like ``source``)
    target: Path
    source: str | None = None
    fstype: str | None = None
    flags: int = 0
    data: str | None = None
    mode: int = 0o755


def plan_workspace(size_bytes: int, workspace: Path, keep: tuple[Path, ...] = ()) -> tuple[MountStep, ...]:
    """The mounts that give ``/tmp`` and ``/dev/shm`` one ``noexec`` tmpfs of ``size_bytes``.

    ``keep``: what bwrap bound below ``/tmp`` (a ``readonly`` path there, say); carried
    into the new ``/tmp`` (recursive binds keep what is mounted on them, e.g. a covered
    ``_ctypes``) so the view is the same, only the tmpfs beneath is replaced.
    """
    tmp, shm = STAGING / "tmp", STAGING / "shm"
    steps = [
        # Nothing we mount may propagate back to bwrap's namespace (or the host's).
        MountStep("mount", Path("/"), flags=MS_REC | MS_PRIVATE),
        MountStep("mount", STAGING, source="tmpfs", fstype="tmpfs", flags=_FLAGS,
                  data=f"size={size_bytes},mode=755"),
        MountStep("mkdir", tmp, mode=0o1777),
        MountStep("mkdir", shm, mode=0o1777),
    ]
    for path in keep:
        inside = tmp / path.relative_to("/tmp")
        steps += [MountStep("mountpoint", inside, source=str(path)),
                  MountStep("mount", inside, source=str(path), flags=MS_BIND | MS_REC)]
    steps += [
        MountStep("mount", Path("/tmp"), source=str(tmp), flags=MS_BIND | MS_REC),
        MountStep("mount", Path("/dev/shm"), source=str(shm), flags=MS_BIND),
        MountStep("umount", STAGING),
        # /dev: the device nodes are binds of their own; the tmpfs under them goes read-only.
        MountStep("mount", Path("/dev"), flags=MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV),
        MountStep("mkdir", workspace, mode=0o755),
    ]
    return tuple(steps)


def enter_private_namespaces(size_bytes: int, workspace: Path, keep: tuple[Path, ...] = ()) -> None:
    """Unshare mount and network namespaces, mount the workspace, bring up loopback and
    let every port be bound. Needs CAP_SYS_ADMIN and CAP_NET_ADMIN in the current user
    namespace; the bootstrap drops both right after."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    check(libc.unshare(CLONE_NEWNS | CLONE_NEWNET), "unshare(mount, network)")
    for step in plan_workspace(size_bytes, workspace, keep):
        target = os.fsencode(step.target)
        if step.op == "mountpoint":
            for parent in reversed(step.target.parents):
                if not parent.exists():
                    os.mkdir(parent, 0o755)
                    os.chmod(parent, 0o755)
            if os.path.isdir(str(step.source)):
                os.mkdir(step.target, 0o755)
            else:
                open(step.target, "x").close()
        elif step.op == "mkdir":
            os.mkdir(step.target, step.mode)
            os.chmod(step.target, step.mode)  # not narrowed by the umask
        elif step.op == "umount":
            check(libc.umount2(target, MNT_DETACH), f"umount {step.target}")
        else:
            source = os.fsencode(step.source) if step.source else None
            fstype = step.fstype.encode() if step.fstype else None
            data = step.data.encode() if step.data else None
            check(libc.mount(source, target, fstype, ctypes.c_ulong(step.flags), data), f"mount {step.target}")
    os.chdir(workspace)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", _IFF_UP))
    with open("/proc/sys/net/ipv4/ip_unprivileged_port_start", "w") as f:
        f.write("0")
