"""The plans and the filter of warm kernels and their forks, as pure data
(:func:`~sequester.guard.native_plan.plan_fork`, ``plan_stage0`` of a warm kernel,
:func:`~sequester.guard.seccomp.warm_clone_rules`), and the ``warm`` filter loaded in a
child process: it lets through fork()'s clone and a fork's unshare, and nothing else the
kernel's refuses."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from sequester import Policy
from sequester.guard.native_plan import WARM_FORKS, NativePlanError, Op, plan_fork, plan_stage0
from sequester.guard.seccomp import CLONE_THREAD, FORK_CLONE_FLAGS, FORK_NAMESPACES, warm_clone_rules
from sequester.kernel.bootstrap import bootstrap_config
from sequester.policy import Isolation, Limits

RUNNER = ["/usr/bin/python3", "-c", "pass"]
WARM = {"module": "/.sequester/fork.so", "channel_fd": 9, "in_fd": 3, "out_fd": 4}


def warm_config(**kw):
    return bootstrap_config(Policy(**kw), Isolation.SANDBOX, template_ids=(65534, 65534), root_flow=True, warm=WARM)


def codes(steps):
    return [op for op, _ in steps]


def refused(flags: int) -> bool:
    return any(flags & mask == value for mask, value in warm_clone_rules())


def test_the_warm_clone_rules_refuse_exactly_what_is_neither_a_thread_nor_fork():
    assert not refused(FORK_CLONE_FLAGS)
    assert not refused(0x003D0F00)  # glibc's pthread_create flags
    assert refused(0x11)  # a bare SIGCHLD fork of other flags
    assert not refused(FORK_CLONE_FLAGS | FORK_NAMESPACES)  # the fork's own clone (from the single-threaded copy)
    assert not refused(FORK_CLONE_FLAGS | 0x00020000)  # (any of those namespaces)
    assert refused(FORK_CLONE_FLAGS | 0x00000100)  # fork's flags and CLONE_VM
    assert refused(FORK_CLONE_FLAGS | 1 << 40)  # any bit beyond, too
    assert refused(0x4111)  # vfork-like (CLONE_VM | CLONE_VFORK | SIGCHLD)
    rng = random.Random(25)
    for _ in range(20000):
        flags = rng.getrandbits(64)
        assert refused(flags) == (not flags & CLONE_THREAD and flags & ~FORK_NAMESPACES != FORK_CLONE_FLAGS)


def test_a_warm_kernels_plan_covers_proc_has_no_write_lock_and_room_for_its_forks():
    config = warm_config(limits=Limits(max_threads=7))
    steps = plan_stage0(config, RUNNER)
    order = codes(steps)
    assert Op.COVER_PROC in order and Op.LANDLOCK not in order
    # covered after the workspace (its /proc/sys writes) and before its own user namespace
    assert order.index(Op.LOOPBACK_UP) < order.index(Op.COVER_PROC) < order.index(Op.USERNS)
    assert ("/proc/sys/user/max_user_namespaces", "0") not in [a for op, a in steps if op is Op.WRITE]
    nproc = [a[1] for op, a in steps if op is Op.RLIMIT and a[0] == 6]
    assert nproc == [(7 + 1) * (WARM_FORKS + 1)]
    assert [a[0] for op, a in steps if op is Op.SECCOMP] == [config["seccomp"]["bpf"]]
    assert config["seccomp"]["bpf"] != config["fork_seccomp"]


def test_a_forks_plan_remakes_the_view_read_only_maps_its_ids_and_ends_in_the_kernels_filter():
    config = warm_config(limits=Limits(max_threads=7))
    steps = plan_fork(config)
    order = codes(steps)
    assert steps[0] == (Op.SETATTR, ("/", 1, 1, 0, 1))  # every mount it copied read-only first, required
    proc = next(i for i, (op, a) in enumerate(steps) if op is Op.MOUNT and a[1] == "/proc")
    assert steps[proc + 1] == (Op.FORK_IDS, (65534, 65534))
    assert order.index(Op.FORK_IDS) < order.index(Op.MKDIR)  # a new tmpfs needs its ids mapped
    assert Op.USERNS not in order and Op.SETIDS not in order and Op.EXEC not in order
    assert ("/proc/sys/user/max_user_namespaces", "0") in [a for op, a in steps if op is Op.WRITE]
    assert [a[1] for op, a in steps if op is Op.RLIMIT and a[0] == 6] == [8]
    tail = order[order.index(Op.DROP_BOUNDING):]
    assert tail == [Op.DROP_BOUNDING, Op.CLEAR_CAPS, Op.CHECK_NO_CAPS, Op.NO_NEW_PRIVS, Op.LANDLOCK, Op.SECCOMP,
                    Op.RETURN] or tail == [Op.DROP_BOUNDING, Op.CLEAR_CAPS, Op.CHECK_NO_CAPS, Op.NO_NEW_PRIVS,
                                           Op.SECCOMP, Op.RETURN]  # (no Landlock on this host)
    assert steps[-2] == (Op.SECCOMP, (config["fork_seccomp"],))


def test_only_a_warm_template_kernel_has_a_fork_plan():
    plain = bootstrap_config(Policy(), Isolation.SANDBOX, template_ids=(1, 1))
    with pytest.raises(NativePlanError, match="warm"):
        plan_fork(plain)
    with pytest.raises(ValueError, match="template"):
        bootstrap_config(Policy(), Isolation.SANDBOX, warm=WARM)


WARM_PROBES = r'''
import ctypes, errno, json, os, sys
from sequester.guard import seccomp
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(name, *args):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(seccomp.syscall_number(name)), *[ctypes.c_long(a) for a in args])
    if r == 0 and name == "clone":
        os._exit(0)  # the child
    if r > 0 and name == "clone":
        os.waitpid(r, 0)
    return "ok" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
seccomp.load_filter(seccomp.compile_filter("warm"), seccomp.syscall_number("seccomp"))
out = {
    "fork's clone": call("clone", seccomp.FORK_CLONE_FLAGS, 0, 0, 0, 0),
    "plain clone": call("clone", 0x11, 0, 0, 0, 0),
    "clone with CLONE_VM": call("clone", seccomp.FORK_CLONE_FLAGS | 0x100, 0, 0, 0, 0),
    "fork": call("fork"),
    "unshare": call("unshare", seccomp.FORK_NAMESPACES),
    "unshare user": call("unshare", 0x10000000),
    "execve": call("execve", 0, 0, 0),
    "ptrace": call("ptrace", 0, 0, 0, 0),
    "udp": call("socket", 2, 2, 0),
}
print(json.dumps(out))
'''


def test_the_warm_filter_lets_through_forks_clone_and_nothing_else_the_kernels_refuses():
    proc = subprocess.run([sys.executable, "-c", WARM_PROBES], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["fork's clone"] == "ok"
    for name in ("plain clone", "clone with CLONE_VM", "fork", "unshare", "unshare user", "execve", "ptrace", "udp"):
        assert out[name] == "EPERM", (name, out)
    assert FORK_NAMESPACES & 0x10000000  # a fork's clone makes its user namespace
