"""The filesystem a kernel sees, planned as an ordered list of mount operations.

Pure: a function of the policy and :class:`~sequester.sandbox.host.HostFacts` only.

The root is assembled, not copied: bwrap starts from an empty tmpfs, and each top-level
entry of the host is either bound read-only, recreated as the same symlink, or (when
hidden) left as an empty directory. A top-level folder that appears on the host later is
simply not there. Then, in words:

* hidden: the caller's home and each top-most directory the caller owns (a non-root
  caller), or every top-level directory that is not part of the operating system (root,
  see :data:`SYSTEM_DIRS`), plus the policy's ``hide`` list. A hidden top-level folder is
  an empty directory; a deeper one is covered by an empty read-only tmpfs; a hidden
  file is covered by ``/dev/null``;
* mounted back read-only on top: the Python installation, sequester's own source and the
  policy's ``readonly`` paths;
* covered by ``/dev/null``: every foreign-function library (``_ctypes``, ``_cffi_backend``)
  the view would otherwise show (see :mod:`.native`);
* replaced: a fresh ``/proc`` (own PID namespace), a minimal ``/dev``, an empty ``/run``
  (host sockets live there), an empty ``/var/tmp``, a ``/sys`` with only the CPU topology, and ``/tmp`` as a
  size-capped tmpfs holding the working directory ``/tmp/workspace``;
* the assembled root itself is made read-only at the end.

Deeper paths are mounted after shallower ones, so a mount-back inside a hidden directory
(the Python prefix inside ``/root``, say) lands on top of whatever hides it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from sequester.policy import Policy
from sequester.sandbox.host import DirEntry, HostFacts

__all__ = [
    "MountKind",
    "MountOp",
    "ROOT_SECRETS",
    "SYSTEM_DIRS",
    "WORKSPACE",
    "hidden_paths",
    "mount_backs",
    "plan_mounts",
]

WORKSPACE = Path("/tmp/workspace")

# What root's rule keeps visible at the top level: the operating system (not /boot:
# kernel images and System.map are no business of a program). Anything else
# at the top (/home, /root, /srv, /mnt, /media, /data, /work, ...) holds somebody's data.
SYSTEM_DIRS = frozenset({"bin", "etc", "lib", "lib32", "lib64", "libx32", "opt", "sbin", "usr", "var", "nix", "snap"})

# Root-only files no sandbox of a root caller may show (a guard-only kernel running as
# uid 0, which Landlock grants the rest of /etc; an episode's view of the host).
ROOT_SECRETS = tuple(
    Path(p)
    for p in (
        "/etc/shadow",
        "/etc/shadow-",
        "/etc/gshadow",
        "/etc/gshadow-",
        "/etc/sudoers",
        "/etc/sudoers.d",
        "/etc/ssh",
        "/etc/ssl/private",
    )
)

# Replaced wholesale by the sandbox; never bound, hidden or scanned.
_REPLACED = frozenset({"dev", "proc", "sys", "tmp", "run"})


class MountKind(enum.Enum):
    READONLY = "readonly"  # read-only bind of a host path on the same path
    BIND = "bind"  # writable bind of a host path
    OVERLAY = "overlay"  # host path read-only beneath a writable upper folder
    HIDE_DIR = "hide-dir"  # empty tmpfs, made read-only at the end
    HIDE_FILE = "hide-file"  # /dev/null bound over a file
    SYMLINK = "symlink"  # a symlink with the host's target
    PROC = "proc"
    DEV = "dev"
    TMPFS = "tmpfs"  # writable tmpfs (size-capped when size is set)
    DIR = "dir"  # a directory created inside the sandbox
    DATA = "data"  # a read-only file whose content comes from the host (fd)
    DEV_BIND = "dev-bind"  # a host device node, usable (a GPU's: see sandbox.gpus)


@dataclass(frozen=True)
class MountOp:
    kind: MountKind
    dest: Path
    source: Path | None = None
    size: int | None = None
    data: str | None = None
    mode: int | None = None
    target: str | None = None
    upper: Path | None = None
    work: Path | None = None
    # OVERLAY of an image's layers: the lower folders, lowest first (``source`` unused).
    lowers: tuple[Path, ...] = ()


def _top(facts: HostFacts) -> list[DirEntry]:
    return [e for e in facts.entries if e.path.parent == Path("/") and e.path.name not in _REPLACED]


def hidden_paths(policy: Policy, facts: HostFacts) -> tuple[tuple[Path, ...], tuple[Path, ...]]:
    """Directories and files to hide: ``(dirs, files)``, shallowest first."""
    dirs: list[Path] = []
    files: list[Path] = []
    if facts.is_root:
        # Root owns the whole system, so "directories the caller owns" would hide the OS.
        # Keep the OS, hide everything else at the top level.
        for e in _top(facts):
            if not e.is_symlink and e.path.name not in SYSTEM_DIRS:
                (dirs if e.is_dir else files).append(e.path)
    else:
        owned = [
            e for e in facts.entries if e.owner == facts.uid and not e.is_symlink and e.path.parts[1] not in _REPLACED
        ]
        owned_dirs = {e.path for e in owned if e.is_dir}
        for e in owned:
            # Only the top-most: a user-owned folder inside another hidden one is covered.
            if not any(p in owned_dirs for p in e.path.parents):
                (dirs if e.is_dir else files).append(e.path)
    if facts.home is not None and facts.home != Path("/"):
        dirs.append(facts.home)
    for path in policy.hide:
        (dirs if path.is_dir() else files).append(path)
    return _unique_sorted(dirs), _unique_sorted(files)


def mount_backs(policy: Policy, facts: HostFacts) -> tuple[Path, ...]:
    """Paths mounted back read-only on top of the hidden ones."""
    return _unique_sorted((*facts.python_roots, facts.package_root, *policy.readonly))


def visible_files(files: Iterable[Path], ops: Iterable[tuple[int, int, MountOp]], hidden_top: set[Path]) -> list[Path]:
    """Those of ``files`` the view shows: the deepest mount that contains each is a
    read-only bind (not a hiding tmpfs or folder). Covering the others would only make
    bwrap create their parents inside hidden folders."""
    covers = [
        (op.dest, op.kind is MountKind.READONLY)
        for _, _, op in ops
        if op.kind in (MountKind.READONLY, MountKind.HIDE_DIR) or (op.kind is MountKind.DIR and op.dest in hidden_top)
    ]
    out = []
    for path in files:
        inside = [c for c in covers if path.is_relative_to(c[0])]
        if inside and max(inside, key=lambda c: len(c[0].parts))[1]:
            out.append(path)
    return out


def _unique_sorted(paths: Iterable[Path]) -> tuple[Path, ...]:
    return tuple(sorted(set(paths), key=lambda p: (len(p.parts), str(p))))


def plan_mounts(policy: Policy, facts: HostFacts, *, data_files: dict[Path, str] | None = None) -> tuple[MountOp, ...]:
    """The ordered mount operations of a kernel's view (on top of bwrap's empty root)."""
    return _plan(policy, facts, tuple(sorted((data_files or {}).items())))


@lru_cache(maxsize=64)
def _plan(policy: Policy, facts: HostFacts, data_files: tuple[tuple[Path, str], ...]) -> tuple[MountOp, ...]:
    # Cached on its inputs (all frozen): a host whose top level did not change since the
    # last launch gets the same plan without recomputing it.
    hide_dirs, hide_files = hidden_paths(policy, facts)
    hidden_top = {p for p in (*hide_dirs, *hide_files) if len(p.parts) == 2}
    workspace_bytes = policy.limits.workspace_mb * 1024 * 1024
    ops: dict[tuple[MountKind, Path], tuple[int, int, MountOp]] = {}

    def add(op: MountOp, rank: int) -> None:
        # Parents before children; at one path, what hides before what mounts back.
        ops.setdefault((op.kind, op.dest), (len(op.dest.parts), rank, op))

    # The top level: bound, symlinked, or an empty folder.
    for e in _top(facts):
        if e.is_symlink:
            add(MountOp(MountKind.SYMLINK, e.path, target=e.link_target), 0)
        elif e.path in hidden_top:
            if e.is_dir:
                add(MountOp(MountKind.DIR, e.path, mode=0o755), 0)
        else:
            add(MountOp(MountKind.READONLY, e.path, source=e.path), 0)
    # Hidden below the top level: covered.
    for path in hide_dirs:
        if path not in hidden_top:
            add(MountOp(MountKind.HIDE_DIR, path, mode=0o755), 0)
    for path in hide_files:
        if path not in hidden_top:
            add(MountOp(MountKind.HIDE_FILE, path, source=Path("/dev/null")), 0)
    add(MountOp(MountKind.PROC, Path("/proc")), 0)
    add(MountOp(MountKind.DEV, Path("/dev")), 0)
    add(MountOp(MountKind.DIR, Path("/run"), mode=0o755), 0)
    if facts.var_tmp:
        # The host's scratch space: anything anyone left there, readable by all.
        add(MountOp(MountKind.HIDE_DIR, Path("/var/tmp"), mode=0o755), 2)
    add(MountOp(MountKind.DIR, Path("/sys"), mode=0o755), 0)
    add(MountOp(MountKind.TMPFS, Path("/tmp"), size=workspace_bytes, mode=0o1777), 0)
    add(MountOp(MountKind.DIR, WORKSPACE, mode=0o755), 1)
    fresh = [Path("/")] + [op.dest for _, _, op in ops.values() if op.kind in (MountKind.HIDE_DIR, MountKind.TMPFS)]
    bound = [op.dest for _, _, op in ops.values() if op.kind is MountKind.READONLY]

    def make_parents(path: Path) -> None:
        # Inside something fresh (the root, a tmpfs), bwrap would create missing parents
        # as 0700, which the kernel could not traverse once it is nobody: make them 0755.
        # Inside a bound host folder the parents exist already.
        base = max(
            (f for f in (*fresh, *bound) if path.is_relative_to(f) and path != f),
            key=lambda f: len(f.parts),
            default=Path("/"),
        )
        if base in bound:
            return
        for parent in reversed(path.parents):
            if parent.is_relative_to(base) and parent != base:
                add(MountOp(MountKind.DIR, parent, mode=0o755), 1)

    if facts.sys_cpu is not None:
        # CPU topology only: os.cpu_count() and BLAS thread pools read it.
        make_parents(facts.sys_cpu)
        add(MountOp(MountKind.READONLY, facts.sys_cpu, source=facts.sys_cpu), 1)
    for path in mount_backs(policy, facts):
        make_parents(path)
        add(MountOp(MountKind.READONLY, path, source=path), 1)
    for path, text in data_files:
        make_parents(path)
        add(MountOp(MountKind.DATA, path, data=text), 2)
    for path in visible_files(facts.ffi_libraries, ops.values(), hidden_top):
        add(MountOp(MountKind.HIDE_FILE, path, source=Path("/dev/null")), 2)
    return tuple(op for _, _, op in sorted(ops.values(), key=lambda t: (t[0], t[1], str(t[2].dest))))
