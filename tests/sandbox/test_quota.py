"""The storage cap (:mod:`sequester.sandbox.quota`): when a project quota can cap an
episode's writable layers, the kernel structures it writes, and the host's answer here.
No filesystem of this machine kind enforces project quotas (its ext4 root is mounted
without ``prjquota``, and loop mounts fail), so the real cap is tested only where a mount
with ``prjquota`` exists."""

from __future__ import annotations

import errno
import os
import struct
from pathlib import Path

import pytest

from sequester.sandbox import quota
from sequester.sandbox.quota import QuotaUnavailable, cap_folder, dqblk_limit, fsxattr_with_project, mount_of, quota_refusal

MOUNTINFO = """\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw,discard
30 22 0:26 / /tmp rw,nosuid,nodev shared:5 - tmpfs tmpfs rw,size=1024k
31 22 259:1 / /var/lib/sequester rw,relatime shared:6 - xfs /dev/nvme0n1p2 rw,attr2,inode64,logbufs=8,prjquota
32 31 259:1 /x /var/lib/sequester/with\\040space rw - xfs /dev/nvme0n1p2 rw,noquota
"""


def test_the_mount_of_a_folder_is_the_longest_that_holds_it():
    assert mount_of(Path("/var/lib/sequester/episodes/1-abc"), MOUNTINFO).fstype == "xfs"
    assert "prjquota" in mount_of(Path("/var/lib/sequester"), MOUNTINFO).options
    assert mount_of(Path("/var/lib/sequesterx"), MOUNTINFO).point == Path("/")
    assert mount_of(Path("/tmp/a"), MOUNTINFO).fstype == "tmpfs"
    assert mount_of(Path("/var/lib/sequester/with space/y"), MOUNTINFO).options >= {"noquota"}


@pytest.mark.parametrize(("fstype", "options", "root", "enforced", "said"), [
    ("xfs", {"prjquota"}, True, True, None),
    ("xfs", {"pquota"}, True, None, None),
    ("ext4", {"prjquota"}, True, True, None),
    ("ext4", set(), True, True, None),  # the quota feature, enforced with quotaon: the kernel's word
    ("ext4", {"rw", "relatime"}, True, None, "not mounted with prjquota and the project and quota features"),
    ("ext4", {"rw"}, True, False, "not mounted with prjquota"),
    ("xfs", {"pqnoenforce"}, True, False, "accounts project quotas but does not enforce them"),
    ("xfs", {"prjquota"}, False, True, "set by root only"),
    ("tmpfs", {"prjquota"}, True, True, "in memory (tmpfs)"),  # never a RAM-backed layer
    ("ramfs", set(), True, None, "in memory (ramfs)"),
    ("btrfs", set(), True, None, "filesystem is btrfs"),
    ("overlay", set(), True, None, "filesystem is overlay"),
])
def test_where_a_project_quota_can_cap_the_writable_layer(fstype, options, root, enforced, said):
    why = quota_refusal(fstype, frozenset(options), root=root, enforced=enforced)
    assert (why is None) if said is None else (said in why), why


def test_the_kernel_structures():
    raw = struct.pack("=IIIII8s", 0x8, 4096, 3, 0, 0, b"\0" * 8)
    xflags, extsize, nextents, projid, _, _ = struct.unpack("=IIIII8s", fsxattr_with_project(raw, 0x5EC00001))
    assert (xflags, extsize, nextents, projid) == (0x8 | 0x200, 4096, 3, 0x5EC00001)  # PROJINHERIT added, rest kept
    fields = struct.unpack("=QQQQQQQQI4x", dqblk_limit(100 << 20))
    assert fields[:2] == (102400, 102400) and fields[-1] == 1  # 1 KiB blocks, QIF_BLIMITS
    assert struct.unpack("=QQQQQQQQI4x", dqblk_limit(1))[0] == 1  # rounded up
    assert len(dqblk_limit(0)) == 72
    assert quota.qcmd(quota.Q_SETQUOTA, quota.PRJQUOTA) == 0x80000802


def test_this_host_says_why_it_cannot_cap_a_folder(tmp_path):
    """Asked for real: the reason names the filesystem (this machine kind: ext4 without prjquota)."""
    mount = mount_of(tmp_path.resolve(), Path("/proc/self/mountinfo").read_text())
    if mount is not None and {"prjquota", "pquota"} & mount.options:
        pytest.skip(f"{mount.point} enforces project quotas: the real cap is tested below")
    with pytest.raises(QuotaUnavailable) as caught:
        cap_folder(tmp_path, 1 << 20)
    assert mount.fstype in str(caught.value) or "root" in str(caught.value), caught.value


def _prjquota_mount() -> Path | None:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        head, _, tail = line.partition(" - ")
        options = set(head.split()[5].split(",")) | set(tail.split()[2].split(",")) if tail else set()
        if tail.split()[:1] in (["xfs"], ["ext4"]) and {"prjquota", "pquota"} & options:
            point = Path(head.split()[4])
            if os.access(point, os.W_OK):
                return point
    return None


PRJ = _prjquota_mount() if os.geteuid() == 0 else None


@pytest.mark.skipif(PRJ is None, reason="no XFS or ext4 mount with prjquota writable by root here (this machine "
                    "kind has none, and its loop mounts fail)")
def test_a_capped_folder_refuses_writes_past_its_limit(tmp_path):
    folder = Path(PRJ) / f"sequester-quota-test-{os.getpid()}"
    folder.mkdir()
    try:
        cap = cap_folder(folder, 1 << 20)
        (folder / "deep").mkdir()  # inherits the project
        with pytest.raises(OSError) as caught, open(folder / "deep" / "big", "wb") as f:
            for _ in range(4):
                f.write(b"x" * (1 << 20))
                f.flush()
                os.fsync(f.fileno())
        assert caught.value.errno == errno.EDQUOT
        cap.remove()
    finally:
        for p in sorted(folder.rglob("*"), reverse=True):
            p.rmdir() if p.is_dir() else p.unlink()
        folder.rmdir()
