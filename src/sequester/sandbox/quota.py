"""A cap on the disk space of a folder tree: an XFS or ext4 *project quota*, as Docker's
overlay2 driver applies ``--storage-opt size`` on XFS.

The folder (an episode's writable layers) gets a project id of its own with the
``PROJINHERIT`` flag (``FS_IOC_FSSETXATTR``), so that every file and folder made below it,
by overlayfs for the agent too, is counted in that project; the project's hard block
limit (``Q_SETQUOTA`` through ``quotactl_fd``, Linux >= 5.14) is the cap: a write past it
fails with ``EDQUOT`` ("Disk quota exceeded"). The limit is lifted when the episode ends.

Only where root may do it and the filesystem enforces project quotas: XFS mounted with
``prjquota`` (or ``pquota``), ext4 with the ``project`` and ``quota`` features mounted
with ``prjquota``. Never a RAM-backed layer (tmpfs, ramfs: that is memory, which the
memory limit counts). Elsewhere :func:`quota_refusal` says why not, for the trial's notes.

:func:`quota_refusal` and the ``struct`` layouts (:func:`fsxattr_with_project`,
:func:`dqblk_limit`) are pure; :func:`cap_folder` and :class:`ProjectQuota` act on the host.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import platform
import random
import struct
from dataclasses import dataclass
from pathlib import Path

from sequester.errors import SandboxError
from sequester.sandbox.cgroups.hierarchy import unescape_mountinfo

__all__ = [
    "ProjectQuota",
    "QuotaUnavailable",
    "cap_folder",
    "dqblk_limit",
    "fsxattr_with_project",
    "mount_of",
    "quota_refusal",
]

# <linux/fs.h>: struct fsxattr (28 bytes) and its ioctls.
_FSXATTR = struct.Struct("=IIIII8s")
FS_IOC_FSGETXATTR = 0x801C581F
FS_IOC_FSSETXATTR = 0x401C5820
FS_XFLAG_PROJINHERIT = 0x00000200
# <linux/quota.h>, <linux/dqblk_xfs.h>
PRJQUOTA = 2
Q_GETQUOTA = 0x800007
Q_SETQUOTA = 0x800008
Q_XGETQSTAT = (ord("X") << 8) + 5
QIF_BLIMITS = 1
_DQBLK = struct.Struct("=QQQQQQQQI4x")  # struct if_dqblk (72 bytes, padded); limits in 1 KiB blocks
FS_QUOTA_PDQ_ENFD = 1 << 5  # fs_quota_stat.qs_flags: project quota enforced
_QUOTACTL_FD = {"x86_64": 443, "aarch64": 443, "riscv64": 443, "ppc64le": 443, "s390x": 443}
# Project ids sequester takes: a high range no distribution's /etc/projid uses.
PROJECT_IDS = range(0x5EC00000, 0x5EC00000 + 0x100000)

_RAM = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"})


class QuotaUnavailable(SandboxError):
    """No project quota can cap this folder (the message says why)."""


def qcmd(cmd: int, kind: int) -> int:
    return (cmd << 8) | (kind & 0xFF)


def quota_refusal(fstype: str, options: frozenset[str], *, root: bool, enforced: bool | None) -> str | None:
    """Why a project quota cannot cap a folder on this filesystem, or None when it can.
    ``options``: the mount's (and superblock's) options; ``enforced``: what the kernel
    says of the filesystem's project quota (None: it could not be asked). Pure."""
    if fstype in _RAM:
        return f"the writable layer is in memory ({fstype}), which a storage limit must never be"
    if fstype not in ("xfs", "ext4"):
        return f"the writable layer's filesystem is {fstype}: project quotas are XFS's and ext4's"
    if not root:
        return "a project quota is set by root only"
    if not ({"prjquota", "pquota", "pqnoenforce"} & options) and not enforced:
        how = "prjquota" if fstype == "ext4" else "prjquota (or pquota)"
        extra = " and the project and quota features (tune2fs -O project,quota)" if fstype == "ext4" else ""
        return f"the writable layer's {fstype} filesystem is not mounted with {how}{extra}"
    if enforced is False or "pqnoenforce" in options:
        return f"the writable layer's {fstype} filesystem accounts project quotas but does not enforce them"
    return None


def fsxattr_with_project(raw: bytes, project: int) -> bytes:
    """A ``struct fsxattr`` as read (``raw``) with ``project`` and ``PROJINHERIT`` set. Pure."""
    xflags, extsize, nextents, _, cowextsize, pad = _FSXATTR.unpack(raw)
    return _FSXATTR.pack(xflags | FS_XFLAG_PROJINHERIT, extsize, nextents, project, cowextsize, pad)


def dqblk_limit(limit_bytes: int) -> bytes:
    """A ``struct if_dqblk`` that sets the hard (and soft) block limit to ``limit_bytes``
    rounded up to 1 KiB blocks; 0 lifts it. Pure."""
    blocks = -(-limit_bytes // 1024)
    return _DQBLK.pack(blocks, blocks, 0, 0, 0, 0, 0, 0, QIF_BLIMITS)


@dataclass(frozen=True)
class Mount:
    point: Path
    fstype: str
    options: frozenset[str]


def mount_of(path: Path, mountinfo: str) -> Mount | None:
    """The mount ``path`` is on, from a ``/proc/self/mountinfo`` text (the longest mount
    point that contains it, the last one mounted there). Pure."""
    best: Mount | None = None
    target = str(path)
    for line in mountinfo.splitlines():
        head, sep, tail = line.partition(" - ")
        if not sep:
            continue
        fields, rest = head.split(), tail.split()
        if len(fields) < 6 or len(rest) < 3:
            continue
        point = unescape_mountinfo(fields[4])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(str(best.point))):
            options = frozenset(fields[5].split(",")) | frozenset(rest[2].split(","))
            best = Mount(Path(point), rest[0], options)
    return best


def _quotactl_fd(fd: int, cmd: int, qid: int, buf: ctypes.Array[ctypes.c_char] | None) -> None:
    number = _QUOTACTL_FD.get(platform.machine())
    if number is None:
        raise OSError(errno.ENOSYS, f"quotactl_fd is not known on {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, fd, ctypes.c_uint(cmd), ctypes.c_int(qid), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _enforced(fd: int) -> bool | None:
    buf = ctypes.create_string_buffer(128)
    try:
        _quotactl_fd(fd, qcmd(Q_XGETQSTAT, PRJQUOTA), 0, buf)
    except OSError:
        return None
    return bool(struct.unpack_from("=bxH", buf.raw)[1] & FS_QUOTA_PDQ_ENFD)


@dataclass
class ProjectQuota:
    """A folder capped by a project quota (lifted by :meth:`remove`)."""

    folder: Path
    project: int
    limit_bytes: int
    mount: Path

    def remove(self) -> None:
        """Lift the project's limit (its files are the caller's to remove). Never raises."""
        try:
            fd = os.open(self.mount, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return
        try:
            _quotactl_fd(fd, qcmd(Q_SETQUOTA, PRJQUOTA), self.project, ctypes.create_string_buffer(dqblk_limit(0)))
        except OSError:
            pass
        finally:
            os.close(fd)


def _project_free(fd: int, project: int) -> bool:
    buf = ctypes.create_string_buffer(_DQBLK.size)
    try:
        _quotactl_fd(fd, qcmd(Q_GETQUOTA, PRJQUOTA), project, buf)
    except OSError as exc:
        return exc.errno in (errno.ENOENT, errno.ESRCH)
    bhard, bsoft, space, ihard, isoft, inodes = _DQBLK.unpack(buf.raw)[:6]
    return not (bhard or bsoft or space or ihard or isoft or inodes)


def cap_folder(folder: Path, limit_bytes: int) -> ProjectQuota:
    """Cap ``folder`` (empty, just made) at ``limit_bytes`` with a project quota of its own,
    or raise :class:`QuotaUnavailable` saying why this host cannot."""
    try:
        mount = mount_of(folder.resolve(), Path("/proc/self/mountinfo").read_text())
    except OSError as exc:
        raise QuotaUnavailable(f"the mounts cannot be read ({exc.strerror})") from None
    if mount is None:
        raise QuotaUnavailable(f"no mount holds {folder}")
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        why = quota_refusal(mount.fstype, mount.options, root=os.geteuid() == 0, enforced=_enforced(fd))
        if why:
            raise QuotaUnavailable(why)
        for _ in range(16):
            project = random.choice(PROJECT_IDS)
            if _project_free(fd, project):
                break
        else:
            raise QuotaUnavailable("no free project id in sequester's range")
        try:
            raw = fcntl.ioctl(fd, FS_IOC_FSGETXATTR, bytes(_FSXATTR.size))
            fcntl.ioctl(fd, FS_IOC_FSSETXATTR, fsxattr_with_project(raw, project))
            _quotactl_fd(fd, qcmd(Q_SETQUOTA, PRJQUOTA), project, ctypes.create_string_buffer(dqblk_limit(limit_bytes)))
        except OSError as exc:
            raise QuotaUnavailable(f"the project quota could not be set on {mount.point} ({exc.strerror})") from None
        return ProjectQuota(folder, project, limit_bytes, mount.point)
    finally:
        os.close(fd)
