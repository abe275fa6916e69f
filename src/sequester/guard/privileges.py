"""Resource limits and the final drop of privileges, done by the kernel on itself.

Runs inside the kernel process during its bootstrap, before any model code.
"""

from __future__ import annotations

import os
import resource

TYPE_CHECKING = False  # not ``typing``: this module is imported by every kernel at start-up
if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Mapping

__all__ = [
    "become",
    "NOBODY",
    "KERNEL_HOST_ID",
    "CAPABILITIES",
    "keep_capabilities",
    "apply_rlimits",
    "capability_sets",
    "disable_nested_userns",
    "drop_privileges",
]

NOBODY = 65534
# The host uid and gid a root caller's kernel (nobody inside) runs as: an id no host
# process or file has (beyond the subordinate ranges rootless containers use).
KERNEL_HOST_ID = 0x7FFF_0000
_PR_CAPBSET_DROP = 24
_PR_SET_PDEATHSIG, _SIGKILL = 1, 9
_CAP_SETS = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")


def apply_rlimits(*, memory_bytes: int, max_threads: int, file_bytes: int, threads_now: int) -> None:
    """Lower soft and hard limits: address space, tasks (threads), file size, no core dumps.

    ``RLIMIT_NPROC`` counts threads: ``max_threads`` beyond the ``threads_now`` the caller
    counted (before the workspace hides /proc/self/task, see :mod:`.namespaces`). In the
    sandbox each kernel has a user namespace of its own, so the count is this kernel's alone.
    """
    for limit, value in (
        (resource.RLIMIT_AS, memory_bytes),
        (resource.RLIMIT_NPROC, max_threads + threads_now),
        (resource.RLIMIT_FSIZE, file_bytes),
        (resource.RLIMIT_CORE, 0),
    ):
        soft, hard = resource.getrlimit(limit)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(limit, (value, value))


def disable_nested_userns() -> None:
    """Forbid new user namespaces inside this one (what ``bwrap --disable-userns`` does)."""
    with open("/proc/sys/user/max_user_namespaces", "w") as f:
        f.write("0")


def capability_sets() -> Mapping[str, int]:
    """This process's capability sets from ``/proc/self/status``."""
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in _CAP_SETS:
                out[key] = int(value.strip(), 16)
    return out


def drop_privileges(*, to_uid: int | None, chown: tuple[str, ...] = ()) -> None:
    """Give up every capability for good, and (root flow) become ``to_uid``.

    Order: chown what the new user must own, empty the bounding set (needs CAP_SETPCAP),
    switch gid then uid (switching away from uid 0 clears the permitted and effective
    sets), clear whatever remains with capset. Then check: any non-zero set is an error.
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if to_uid is not None:
        for path in chown:
            os.chown(path, to_uid, to_uid)
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last_cap = int(f.read())
    bounding = capability_sets().get("CapBnd", 0)
    for cap in range(last_cap + 1):
        if bounding >> cap & 1 and libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), f"cannot drop capability {cap} from the bounding set")
    if to_uid is not None:
        if os.getgroups():
            os.setgroups([])
        os.setresgid(to_uid, to_uid, to_uid)
        os.setresuid(to_uid, to_uid, to_uid)
        # A uid change clears the parent-death signal bwrap set (--die-with-parent), and the
        # kernel is its namespace's pid 1: set it again, or a kernel busy in a cell would
        # outlive its host process.
        if libc.prctl(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    _capset(libc, 0)
    left = {k: v for k, v in capability_sets().items() if v}
    if left:
        raise PermissionError(f"capabilities remain after the drop: {left}")


# Linux capability numbers (include/uapi/linux/capability.h).
CAPABILITIES = {
    name: number
    for number, name in enumerate(
        (
            "CAP_CHOWN",
            "CAP_DAC_OVERRIDE",
            "CAP_DAC_READ_SEARCH",
            "CAP_FOWNER",
            "CAP_FSETID",
            "CAP_KILL",
            "CAP_SETGID",
            "CAP_SETUID",
            "CAP_SETPCAP",
            "CAP_LINUX_IMMUTABLE",
            "CAP_NET_BIND_SERVICE",
            "CAP_NET_BROADCAST",
            "CAP_NET_ADMIN",
            "CAP_NET_RAW",
            "CAP_IPC_LOCK",
            "CAP_IPC_OWNER",
            "CAP_SYS_MODULE",
            "CAP_SYS_RAWIO",
            "CAP_SYS_CHROOT",
            "CAP_SYS_PTRACE",
            "CAP_SYS_PACCT",
            "CAP_SYS_ADMIN",
            "CAP_SYS_BOOT",
            "CAP_SYS_NICE",
            "CAP_SYS_RESOURCE",
            "CAP_SYS_TIME",
            "CAP_SYS_TTY_CONFIG",
            "CAP_MKNOD",
            "CAP_LEASE",
            "CAP_AUDIT_WRITE",
            "CAP_AUDIT_CONTROL",
            "CAP_SETFCAP",
            "CAP_MAC_OVERRIDE",
            "CAP_MAC_ADMIN",
            "CAP_SYSLOG",
            "CAP_WAKE_ALARM",
            "CAP_BLOCK_SUSPEND",
            "CAP_AUDIT_READ",
            "CAP_PERFMON",
            "CAP_BPF",
            "CAP_CHECKPOINT_RESTORE",
        )
    )
}


def become(uid: int, gid: int) -> None:
    """Switch every id to ``uid``/``gid`` (supplementary groups: ``gid`` alone), from root of
    the current user namespace: an image's non-root ``User``. The kernel clears the
    capability sets on the way out of uid 0; the bounding set stays what it was."""
    os.setgroups([gid])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)


def keep_capabilities(names: list[str] | tuple[str, ...]) -> None:
    """Keep exactly ``names`` (a container's set) in every capability set, bounding included.

    A root process exec'd afterwards gets its permitted set from the bounding set, so
    this is what the next program runs with.
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    keep = {CAPABILITIES[n] for n in names}
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last_cap = int(f.read())
    for cap in range(last_cap + 1):
        if cap not in keep and libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            if err != 22:  # EINVAL: not a capability of this kernel
                raise OSError(err, f"cannot drop capability {cap} from the bounding set")
    _capset(libc, sum(1 << c for c in keep))


def _capset(libc, mask: int) -> None:
    """Set effective, permitted and inheritable to ``mask``; clear the ambient set."""
    import ctypes

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    header = Header(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (Data * 2)()
    for i in (0, 1):
        word = (mask >> (32 * i)) & 0xFFFFFFFF
        data[i].effective = data[i].permitted = data[i].inheritable = word
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")
    # Ambient capabilities: PR_CAP_AMBIENT(47), PR_CAP_AMBIENT_CLEAR_ALL(4).
    libc.prctl(47, 4, 0, 0, 0)
