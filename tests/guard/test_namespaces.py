"""The mounts of a kernel's own namespaces (:mod:`sequester.guard.namespaces`, pure): one
noexec tmpfs behind /tmp and /dev/shm, the process's own memory out of reach, and binds
below /tmp carried into the new one."""

from pathlib import Path

from sequester.guard.namespaces import (
    MS_BIND,
    MS_NOEXEC,
    MS_RDONLY,
    MS_REC,
    MS_REMOUNT,
    SELF_MEM,
    SELF_TASKS,
    STAGING,
    plan_workspace,
)

P = Path


def test_one_noexec_tmpfs_backs_both_tmp_and_dev_shm():
    steps = plan_workspace(8 << 20, P("/tmp/workspace"))
    mounts = [s for s in steps if s.op == "mount"]
    tmpfs = [s for s in mounts if s.fstype == "tmpfs" and s.target != SELF_TASKS]
    assert len(tmpfs) == 1 and tmpfs[0].target == STAGING and tmpfs[0].flags & MS_NOEXEC
    assert "size=8388608" in tmpfs[0].data
    binds = {s.target: s.source for s in mounts if s.flags & MS_BIND and not s.flags & MS_REMOUNT}
    assert binds == {P("/tmp"): str(STAGING / "tmp"), P("/dev/shm"): str(STAGING / "shm"), SELF_MEM: "/dev/null"}
    order = [s.target for s in steps if s.op != "setattr"]
    # The staging mount is detached only after both binds; the workspace is made last, in the new /tmp.
    assert order.index(P("/tmp")) < order.index(STAGING, 2) and order[-1] == P("/tmp/workspace")
    dev = next(s for s in mounts if s.target == P("/dev"))
    assert dev.flags & MS_REMOUNT and dev.flags & MS_RDONLY
    # The process's own memory is not writable through /proc: mem is /dev/null, the
    # threads' folder (their mem files, /proc/thread-self) an empty read-only tmpfs.
    tasks = next(s for s in mounts if s.target == SELF_TASKS)
    assert tasks.fstype == "tmpfs" and tasks.flags & MS_RDONLY


def test_binds_below_tmp_are_carried_into_the_new_tmp():
    steps = plan_workspace(1 << 20, P("/tmp/workspace"), keep=(P("/tmp/a/src"),))
    order = [(s.op, s.target) for s in steps]
    carried = STAGING / "tmp" / "a" / "src"
    assert order.index(("mountpoint", carried)) < order.index(("mount", carried)) < order.index(("mount", P("/tmp")))
    tmp = next(s for s in steps if s.op == "mount" and s.target == P("/tmp"))
    assert tmp.flags & MS_REC  # recursive: the carried bind comes along


def test_a_bwrap_kernels_view_goes_read_only_by_the_mount_tree_first():
    """bwrap remounts by path and leaves a mount it cannot reach writable; a bwrap kernel's
    first stage makes every mount of its view read-only by the mount tree (mount_setattr,
    recursive), before any mount of its own, then only its own /proc writable again. A
    template's kernel does not: its keeper made the view so."""
    steps = plan_workspace(1 << 20, P("/tmp/workspace"))
    first = [s for s in steps if s.op != "mount" or s.target != P("/")][:2]
    assert first[0].op == "setattr" and first[0].target == P("/") and first[0].recursive and first[0].flags == 1
    assert first[1].op == "setattr" and first[1].target == P("/proc") and first[1].clear == 1 and not first[1].recursive
    assert [s.op for s in steps].index("setattr") < [s.op for s in steps].index("mkdir")
    own = plan_workspace(1 << 20, P("/tmp/workspace"), own_proc=())
    assert all(s.op != "setattr" for s in own)
