"""The plan the native first stage (``kernel/stage0.c``) executes, computed on the host.

The native stage is a dumb executor of system calls; which calls, in which order, with
which arguments is decided here, from the same bootstrap configuration the Python first
stage (:mod:`sequester.kernel.boot`) applies, in the same order (its docstring is the
security argument):

1. the kernel's own mount and network namespaces: the workspace (one ``noexec`` tmpfs
   at ``/tmp`` and ``/dev/shm``, ``/dev`` read-only), loopback up, every port bindable;
   this also covers the native stage's own file, which bwrap bound below ``/tmp``;
2. resource limits;
3. privileges: no nested user namespaces (root flow), the bounding set emptied, nobody
   (root flow), no capabilities, checked;
4. ``no_new_privs``, the write lock (Landlock: nothing writable but the workspace and the
   device nodes, so no ``/proc/<tid>/mem`` of its own threads either) and the seccomp filter;
5. the one ``execve`` the filter allows, into the cell runner.

A kernel started from a view template (``config["template"]``, see
:mod:`sequester.kernel.template`) is born in its own mount and network namespaces (the
keeper's clone), so step 1 makes no namespaces but mounts the ``/proc`` and ``/dev/pts``
bwrap would have; and after it, the kernel takes a user namespace of its own (``USERNS``:
a root caller's as nobody, so nobody is what it maps), so its processes count against its
own limit and it holds no capability over the template's namespaces.

A warm kernel (``config["warm"]``, :mod:`sequester.kernel.fork`) is a template's kernel
that forks kernels: its plan has no write lock (Landlock would refuse its forks every
mount) and covers its ``/proc`` instead (``COVER_PROC``: no ``/proc/<tid>/mem`` to write its
own code through), keeps user namespaces possible (its forks make theirs), allows its
threads and its forks' processes (``RLIMIT_NPROC``, shared by all of its forks) and loads
the ``warm`` filter. :func:`plan_fork` is the plan each fork runs in its new namespaces,
before any Python: a template kernel's, from a read-only view, ending in ``RETURN``.

Landlock (guard-only mode) is not part of it: guard-only kernels run no bwrap and keep
the Python stage. Pure functions: unit-tested without a sandbox.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

__all__ = ["Op", "Step", "plan_stage0", "plan_fork", "encode_plan", "NativePlanError", "WARM_FORKS"]

CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000
MNT_DETACH = 0x2
RLIMIT_FSIZE, RLIMIT_CORE, RLIMIT_NPROC, RLIMIT_AS = 1, 4, 6, 9
_NULL = 0xFFFF_FFFF
MAX_PLAN = 4 << 20  # stage0.c's MAX_FRAME
MOUNT_ATTR_RDONLY = 0x1
# A warm kernel's RLIMIT_NPROC counts its forks' threads too (they are in user namespaces
# below its own): room for this many forks of the policy's thread limit at once.
WARM_FORKS = 256


class Op(enum.IntEnum):
    """Opcodes; the C side's enum has the same numbers."""

    UNSHARE = 1
    MOUNT = 2
    UMOUNT = 3
    MKDIR = 4
    MKDIR_MISSING = 5
    CHDIR = 7  # (6 is unused)
    LOOPBACK_UP = 8
    WRITE = 9
    RLIMIT = 10
    CHOWN = 11
    DROP_BOUNDING = 12
    SETIDS = 13
    CLEAR_CAPS = 14
    CHECK_NO_CAPS = 15
    NO_NEW_PRIVS = 16
    SECCOMP = 17
    ARG = 18
    EXEC = 19
    MOUNTPOINT = 20
    LANDLOCK = 21
    USERNS = 22  # a user namespace of its own, its ids shown as these (template kernels)
    SETATTR = 23  # mount_setattr(path, recursive, set, clear): by the mount tree, not by path
    RETURN = 24  # the end of a fork's plan: back to the warm kernel's code, now confined
    FORK_IDS = 25  # a fork's ids in the user namespace it was born in: the warm kernel's
    COVER_PROC = 26  # a warm kernel's /proc covered (a bare one kept out of its reach for its forks)


Step = tuple[Op, tuple["str | bytes | int | None", ...]]


class NativePlanError(ValueError):
    """The configuration asks for something the native stage does not do."""


def _workspace_steps(workspace: dict[str, Any], template: bool) -> list[Step]:
    # A template's kernel is born in its own mount and network namespaces (the keeper's clone).
    steps: list[Step] = [] if template else [(Op.UNSHARE, (CLONE_NEWNS | CLONE_NEWNET,))]
    for op, target, source, fstype, flags, data, mode, parents in workspace["steps"]:
        if op == "mountpoint":
            steps += [(Op.MKDIR_MISSING, (parent, 0o755)) for parent in parents]
            steps.append((Op.MOUNTPOINT, (target, source)))
        elif op == "mkdir":
            steps.append((Op.MKDIR, (target, mode)))
        elif op == "umount":
            steps.append((Op.UMOUNT, (target, MNT_DETACH)))
        elif op == "mount":
            steps.append((Op.MOUNT, (source, target, fstype, flags, data)))
        elif op == "setattr":
            steps.append((Op.SETATTR, (target, int(bool(parents)), flags, mode)))
        else:
            raise NativePlanError(f"unknown workspace step {op!r}")
    return [
        *steps,
        (Op.CHDIR, (workspace["path"],)),
        (Op.LOOPBACK_UP, ()),
        (Op.WRITE, ("/proc/sys/net/ipv4/ip_unprivileged_port_start", "0")),
    ]


def plan_stage0(config: dict[str, Any], command: Sequence[str], *, timing: bool = True) -> list[Step]:
    """The native stage's steps for ``config`` (what
    :func:`sequester.kernel.bootstrap.bootstrap_config` made for a sandboxed kernel), ending in the ``execve`` of
    ``command`` (the cell runner's, with its stage-two configuration; ``timing``: the
    stage's timestamps appended as its last argument, which a plain command must not get)."""
    if config.get("mode") != "sandbox":
        raise NativePlanError("the native first stage confines sandboxed kernels only")
    if config.get("landlock") or config.get("ctypes_fd") is not None:
        raise NativePlanError("Landlock and a ctypes library are the Python first stage's")
    if not command:
        raise NativePlanError("no command for the cell runner")
    limits = config["limits"]
    template = bool(config.get("template"))
    warm = bool(config.get("warm"))
    if warm and not template:
        raise NativePlanError("a warm kernel is a view template's kernel")
    steps: list[Step] = []
    if config.get("workspace"):
        steps += _workspace_steps(config["workspace"], template)
    if warm:
        steps.append((Op.COVER_PROC, ()))
    to_uid = config.get("drop_to_uid")
    if template:
        # Every mount is made: the kernel's own user namespace now, as the uid it ends as
        # (so that is what it maps), and its processes count against its own limit below,
        # not against every kernel of the view. Its mount and network namespaces stay the
        # template's: it holds no capability over them from here on.
        if to_uid is not None:
            steps += [(Op.CHOWN, (path, to_uid, to_uid)) for path in config.get("chown", ())]
            steps.append((Op.SETIDS, (to_uid, to_uid)))
        uid, gid = config["template_ids"]
        steps.append((Op.USERNS, (uid, gid)))
    # The stage is one thread; the cell runner adds the bridge's (see boot.confine).
    threads = limits["max_threads"] + bool(config.get("bridge")) + 1
    if warm:
        threads *= WARM_FORKS + 1
    steps += [
        (Op.RLIMIT, (RLIMIT_AS, limits["memory_bytes"])),
        (Op.RLIMIT, (RLIMIT_NPROC, threads)),
        (Op.RLIMIT, (RLIMIT_FSIZE, limits["file_bytes"])),
        (Op.RLIMIT, (RLIMIT_CORE, 0)),
    ]
    if (config.get("root_flow") or template) and not warm:
        steps.append((Op.WRITE, ("/proc/sys/user/max_user_namespaces", "0")))
    if to_uid is not None and not template:
        steps += [(Op.CHOWN, (path, to_uid, to_uid)) for path in config.get("chown", ())]
    steps.append((Op.DROP_BOUNDING, ()))
    if to_uid is not None:
        steps.append((Op.SETIDS, (to_uid, to_uid)))
    steps += [(Op.CLEAR_CAPS, ()), (Op.CHECK_NO_CAPS, ())]
    seccomp = config["seccomp"]["bpf"]
    if not isinstance(seccomp, bytes) or not seccomp or len(seccomp) % 8:
        raise NativePlanError("the seccomp program is not whole 8-byte instructions")
    steps.append((Op.NO_NEW_PRIVS, ()))
    lock = config.get("write_lock")
    if lock and not warm:
        steps.append((Op.LANDLOCK, (lock["handled"], *lock["paths"])))
    steps.append((Op.SECCOMP, (seccomp,)))
    steps += [(Op.ARG, (arg,)) for arg in command]
    steps.append((Op.EXEC, (command[0],) if timing else (command[0], 0)))
    return steps


def plan_fork(config: dict[str, Any]) -> list[Step]:
    """What a fork of the warm kernel of ``config`` runs, in the namespaces it was born in
    (user, mount, PID, network, IPC, UTS: :mod:`sequester.kernel.fork`), before any of its
    Python: every mount of the copied view read-only (a writable one the warm kernel
    reached would be shared by every fork), then a template kernel's steps (its /proc,
    with its ids mapped as soon as that is mounted; workspace; loopback), its limits, no
    nested user namespaces, no capabilities, the write lock and the kernel's filter
    (stacked on the warm kernel's), and back (``RETURN``)."""
    if not config.get("warm") or not config.get("workspace"):
        raise NativePlanError("a fork's plan is a warm kernel's")
    uid, gid = config["template_ids"]
    # (required: on a Linux without mount_setattr the fork fails rather than share a mount)
    steps: list[Step] = [(Op.SETATTR, ("/", 1, MOUNT_ATTR_RDONLY, 0, 1))]
    mapped = False
    for step in _workspace_steps(config["workspace"], template=True):
        steps.append(step)
        if not mapped and step[0] is Op.MOUNT and step[1][1] == "/proc":
            steps.append((Op.FORK_IDS, (uid, gid)))  # a new tmpfs needs ids mapped to make folders
            mapped = True
    if not mapped:
        raise NativePlanError("a fork's workspace mounts no /proc of its own")
    limits = config["limits"]
    threads = limits["max_threads"] + bool(config.get("bridge")) + 1
    steps += [
        (Op.RLIMIT, (RLIMIT_AS, limits["memory_bytes"])),
        (Op.RLIMIT, (RLIMIT_NPROC, threads)),
        (Op.RLIMIT, (RLIMIT_FSIZE, limits["file_bytes"])),
        (Op.RLIMIT, (RLIMIT_CORE, 0)),
        (Op.WRITE, ("/proc/sys/user/max_user_namespaces", "0")),
        (Op.DROP_BOUNDING, ()),
        (Op.CLEAR_CAPS, ()),
        (Op.CHECK_NO_CAPS, ()),
        (Op.NO_NEW_PRIVS, ()),
    ]
    lock = config.get("write_lock")
    if lock:
        steps.append((Op.LANDLOCK, (lock["handled"], *lock["paths"])))
    seccomp = config["fork_seccomp"]
    if not isinstance(seccomp, bytes) or not seccomp or len(seccomp) % 8:
        raise NativePlanError("the seccomp program is not whole 8-byte instructions")
    steps += [(Op.SECCOMP, (seccomp,)), (Op.RETURN, ())]
    return steps


def _field(value: str | bytes | int | None) -> bytes:
    if value is None:
        return _NULL.to_bytes(4, "little")
    if isinstance(value, bool):
        raise NativePlanError("a flag is not a number")
    if isinstance(value, int):
        if value < 0:
            raise NativePlanError(f"negative number {value} in the plan")
        value = str(value)
    data = value.encode("utf-8", "surrogateescape") if isinstance(value, str) else bytes(value)
    if isinstance(value, str) and "\0" in value:
        raise NativePlanError(f"a NUL byte in {value!r}")
    if len(data) >= _NULL:
        raise NativePlanError("a field is too long")
    return len(data).to_bytes(4, "little") + data


def encode_plan(steps: Sequence[Step]) -> bytes:
    """The frame the native stage reads: 4-byte big-endian length, then each op as u32
    opcode, u32 argument count and the arguments (u32 length, bytes; integers in decimal)."""
    body = b"".join(
        int(op).to_bytes(4, "little") + len(args).to_bytes(4, "little") + b"".join(_field(a) for a in args)
        for op, args in steps
    )
    if len(body) > MAX_PLAN:
        raise NativePlanError(f"the plan is {len(body)} bytes, over the native stage's {MAX_PLAN}")
    return len(body).to_bytes(4, "big") + body
