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

from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "MountStep",
    "plan_workspace",
    "plan_own_proc",
    "enter_private_namespaces",
    "STAGING",
    "SELF_MEM",
    "SELF_TASKS",
]

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
MOUNT_ATTR_RDONLY = 0x1

# Where the workspace tmpfs is mounted while its two folders are bound into place; an
# empty folder bwrap made (the view's /run), back to empty once the staging is detached.
STAGING = Path("/run")
_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC
SELF_MEM, SELF_TASKS = Path("/proc/self/mem"), Path("/proc/self/task")


@dataclass(frozen=True)
class MountStep:
    """One ``mount(2)`` (``source`` None: a remount), ``mkdir`` or lazy ``umount``."""

    op: str  # "mount" | "mkdir" | "umount" | "mountpoint" (parents 0755, then a folder or file like ``source``)
    # | "setattr": mount_setattr on ``target`` (with every mount below it if ``recursive``),
    # setting the MOUNT_ATTR_* bits ``flags`` and clearing ``clear``
    target: Path
    source: str | None = None
    fstype: str | None = None
    flags: int = 0
    data: str | None = None
    mode: int = 0o755
    clear: int = 0
    recursive: bool = False


def plan_own_proc(covers: tuple[Path, ...]) -> tuple[MountStep, ...]:
    """What bwrap mounts for each sandbox, for a kernel that enters a view template
    instead (:mod:`sequester.kernel.template`): a ``/proc`` of its own PID namespace with
    bwrap's read-only ``covers`` (``/proc/irq``, ``/proc/bus``), and a ``/dev/pts`` of its
    own. Attack: the template's ``/proc`` lists the keeper and every kernel of the view,
    and its ``/dev/pts`` would let one kernel open another's terminals."""
    steps = [MountStep("mount", Path("/proc"), source="proc", fstype="proc", flags=_FLAGS)]
    for cover in covers:
        steps += [
            MountStep("mount", cover, source=str(cover), flags=MS_BIND | MS_REC),
            MountStep("mount", cover, flags=MS_REMOUNT | MS_BIND | MS_RDONLY | _FLAGS),
        ]
    steps.append(
        MountStep(
            "mount",
            Path("/dev/pts"),
            source="devpts",
            fstype="devpts",
            # read-only, as a bwrap kernel's (its first stage makes the whole view so):
            # terminals still open (devpts makes their nodes itself)
            flags=MS_NOSUID | MS_NOEXEC | MS_RDONLY,
            data="newinstance,ptmxmode=0666,mode=620",
        )
    )
    return tuple(steps)


def plan_workspace(
    size_bytes: int, workspace: Path, keep: tuple[Path, ...] = (), own_proc: tuple[Path, ...] | None = None
) -> tuple[MountStep, ...]:
    """The mounts that give ``/tmp`` and ``/dev/shm`` one ``noexec`` tmpfs of ``size_bytes``.

    ``keep``: what bwrap bound below ``/tmp`` (a ``readonly`` path there, say); carried
    into the new ``/tmp`` (recursive binds keep what is mounted on them, e.g. a covered
    ``_ctypes``) so the view is the same, only the tmpfs beneath is replaced.
    ``own_proc``: the kernel enters a view template, so it mounts its own ``/proc`` (with
    these covers) and ``/dev/pts`` first (:func:`plan_own_proc`).
    """
    tmp, shm = STAGING / "tmp", STAGING / "shm"
    steps = [
        # Nothing we mount may propagate back to bwrap's namespace (or the host's).
        MountStep("mount", Path("/"), flags=MS_REC | MS_PRIVATE),
        # bwrap's view (a kernel with a bwrap of its own; a template's keeper does this for
        # its kernels): every mount read-only by the mount tree. bwrap remounts by path and
        # leaves a mount it cannot reach writable, which a kernel running as another uid may
        # reach (red team: a root caller's kernel is nobody; a folder that refuses root may
        # let nobody through). Then this kernel's own /proc writable again for the writes
        # below (its /proc/sys; the covers bwrap made under it stay read-only).
        *(
            (
                MountStep("setattr", Path("/"), flags=MOUNT_ATTR_RDONLY, recursive=True),
                MountStep("setattr", Path("/proc"), clear=MOUNT_ATTR_RDONLY),
            )
            if own_proc is None
            else ()
        ),
        *(plan_own_proc(own_proc) if own_proc is not None else ()),
        MountStep("mount", STAGING, source="tmpfs", fstype="tmpfs", flags=_FLAGS, data=f"size={size_bytes},mode=755"),
        MountStep("mkdir", tmp, mode=0o1777),
        MountStep("mkdir", shm, mode=0o1777),
    ]
    for path in keep:
        inside = tmp / path.relative_to("/tmp")
        steps += [
            MountStep("mountpoint", inside, source=str(path)),
            MountStep("mount", inside, source=str(path), flags=MS_BIND | MS_REC),
        ]
    steps += [
        MountStep("mount", Path("/tmp"), source=str(tmp), flags=MS_BIND | MS_REC),
        MountStep("mount", Path("/dev/shm"), source=str(shm), flags=MS_BIND),
        MountStep("umount", STAGING),
        # Attack (red team): a process may write its own memory through /proc/self/mem,
        # read-only code pages included (the kernel forces the write), so a cell could
        # patch a C function with code of its own and call it: native code with no
        # ctypes, no library and no audit event. /proc/self resolves to this process's
        # own entry (the same pid after the execve into the cell runner): its mem file
        # becomes /dev/null, and its task folder (every thread's mem, /proc/thread-self)
        # an empty read-only tmpfs.
        MountStep("mount", SELF_MEM, source="/dev/null", flags=MS_BIND),
        MountStep(
            "mount", SELF_TASKS, source="tmpfs", fstype="tmpfs", flags=_FLAGS | MS_RDONLY, data="size=4096,mode=555"
        ),
        # /dev: the device nodes are binds of their own; the tmpfs under them goes read-only.
        MountStep("mount", Path("/dev"), flags=MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV),
        MountStep("mkdir", workspace, mode=0o755),
    ]
    return tuple(steps)


def enter_private_namespaces(size_bytes: int, workspace: Path, keep: tuple[Path, ...] = ()) -> None:
    """Unshare mount and network namespaces, mount the workspace, bring up loopback and
    let every port be bound. Needs CAP_SYS_ADMIN and CAP_NET_ADMIN in the current user
    namespace; the bootstrap drops both right after. (A kernel's first stage gets the
    plan from the host and applies it with :func:`.workspace.apply_workspace` directly.)"""
    from sequester.guard.workspace import apply_workspace, steps_for_kernel

    apply_workspace(steps_for_kernel(plan_workspace(size_bytes, workspace, keep)), str(workspace))
