"""The filesystem a kernel sees, planned as an ordered list of mount operations.

Pure: a function of the policy and :class:`~sequester.sandbox.host.HostFacts` only.

The view, in words:

* the host's root, read-only;
* hidden under empty, read-only tmpfs: the caller's home and each top-most directory the
  caller owns (a non-root caller), or every top-level directory that is not part of the
  operating system (root, see :data:`SYSTEM_DIRS`), plus the policy's ``hide`` list;
  hidden files are covered by ``/dev/null``;
* mounted back read-only on top: the Python installation, sequester's own source and the
  policy's ``readonly`` paths;
* replaced: a fresh ``/proc`` (own PID namespace), a minimal ``/dev``, an empty ``/run``
  (host sockets live there), a ``/sys`` with only the CPU topology, and ``/tmp`` as a
  size-capped tmpfs holding the working directory ``/tmp/workspace``.

Deeper paths are mounted after shallower ones, so a mount-back inside a hidden directory
(the Python prefix inside ``/root``, say) lands on top of the tmpfs that hides it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..policy import Policy
from .host import HostFacts

__all__ = ["MountKind", "MountOp", "SYSTEM_DIRS", "WORKSPACE", "hidden_paths", "mount_backs", "plan_mounts"]

WORKSPACE = Path("/tmp/workspace")

# What root's rule keeps visible at the top level: the operating system. Anything else
# at the top (/home, /root, /srv, /mnt, /media, /data, /work, ...) holds somebody's data.
SYSTEM_DIRS = frozenset({"bin", "boot", "etc", "lib", "lib32", "lib64", "libx32", "opt", "sbin", "usr", "var", "nix", "snap"})

# Replaced wholesale by the sandbox; never hidden or scanned.
_REPLACED = frozenset({"dev", "proc", "sys", "tmp", "run"})


class MountKind(enum.Enum):
    ROOT = "root"            # read-only bind of the host's /
    HIDE_DIR = "hide-dir"    # empty tmpfs, made read-only at the end
    HIDE_FILE = "hide-file"  # /dev/null bound over a file
    READONLY = "readonly"    # read-only bind of a host path on the same path
    PROC = "proc"
    DEV = "dev"
    TMPFS = "tmpfs"          # writable tmpfs (size-capped when size is set)
    DIR = "dir"              # a directory created inside the sandbox
    DATA = "data"            # a read-only file whose content comes from the host (fd)


@dataclass(frozen=True)
class MountOp:
    kind: MountKind
    dest: Path
    source: Path | None = None
    size: int | None = None
    data: str | None = None
    mode: int | None = None


def _hideable(entries: Iterable, keep: object) -> Iterable:
    return (e for e in entries if not e.is_symlink and e.path.name not in _REPLACED and keep(e))


def hidden_paths(policy: Policy, facts: HostFacts) -> tuple[tuple[Path, ...], tuple[Path, ...]]:
    """Directories and files to hide: ``(dirs, files)``, shallowest first."""
    dirs: list[Path] = []
    files: list[Path] = []
    if facts.is_root:
        # Root owns the whole system, so "directories the caller owns" would hide the OS.
        # Keep the OS, hide everything else at the top level.
        top = [e for e in facts.entries if e.path.parent == Path("/")]
        for e in _hideable(top, lambda e: e.path.name not in SYSTEM_DIRS):
            (dirs if e.is_dir else files).append(e.path)
    else:
        owned = [e for e in _hideable(facts.entries, lambda e: e.owner == facts.uid)]
        owned_dirs = {e.path for e in owned if e.is_dir}
        for e in owned:
            # Only the top-most: a user-owned folder inside another hidden one is covered.
            if any(p in owned_dirs for p in e.path.parents):
                continue
            (dirs if e.is_dir else files).append(e.path)
    if facts.home is not None and facts.home != Path("/"):
        dirs.append(facts.home)
    for path in policy.hide:
        (dirs if path.is_dir() else files).append(path)
    return _unique_sorted(dirs), _unique_sorted(files)


def mount_backs(policy: Policy, facts: HostFacts) -> tuple[Path, ...]:
    """Paths mounted back read-only on top of the hidden ones."""
    return _unique_sorted((*facts.python_roots, facts.package_root, *policy.readonly))


def _unique_sorted(paths: Iterable[Path]) -> tuple[Path, ...]:
    return tuple(sorted(set(paths), key=lambda p: (len(p.parts), str(p))))


def plan_mounts(policy: Policy, facts: HostFacts, *, data_files: dict[Path, str] | None = None) -> tuple[MountOp, ...]:
    """The ordered mount operations of a kernel's view."""
    hide_dirs, hide_files = hidden_paths(policy, facts)
    workspace_bytes = policy.limits.workspace_mb * 1024 * 1024
    ops: list[tuple[int, int, MountOp]] = []

    def add(op: MountOp, rank: int) -> None:
        # Parents before children; at one path, what hides before what mounts back.
        ops.append((len(op.dest.parts), rank, op))

    for path in hide_dirs:
        add(MountOp(MountKind.HIDE_DIR, path, mode=0o755), 0)
    for path in hide_files:
        add(MountOp(MountKind.HIDE_FILE, path, source=Path("/dev/null")), 0)
    add(MountOp(MountKind.PROC, Path("/proc")), 0)
    add(MountOp(MountKind.DEV, Path("/dev")), 0)
    add(MountOp(MountKind.TMPFS, Path("/dev/shm"), size=workspace_bytes, mode=0o1777), 0)
    add(MountOp(MountKind.HIDE_DIR, Path("/run"), mode=0o755), 0)
    add(MountOp(MountKind.HIDE_DIR, Path("/sys"), mode=0o755), 0)
    if facts.sys_cpu is not None:
        # CPU topology only: os.cpu_count() and BLAS thread pools read it.
        add(MountOp(MountKind.READONLY, facts.sys_cpu, source=facts.sys_cpu), 1)
    add(MountOp(MountKind.TMPFS, Path("/tmp"), size=workspace_bytes, mode=0o1777), 0)
    add(MountOp(MountKind.DIR, WORKSPACE, mode=0o755), 1)
    fresh = [op.dest for _, _, op in ops if op.kind in (MountKind.HIDE_DIR, MountKind.TMPFS)]

    def make_parents(path: Path) -> None:
        # bwrap would create missing parents inside a fresh tmpfs as 0700, which the
        # kernel (nobody, once it drops root) could not traverse: make them 0755.
        base = max((f for f in fresh if path.is_relative_to(f) and path != f), key=lambda f: len(f.parts), default=None)
        if base is not None:
            for parent in reversed(path.parents):
                if parent.is_relative_to(base) and parent != base:
                    add(MountOp(MountKind.DIR, parent, mode=0o755), 1)

    for path in mount_backs(policy, facts):
        make_parents(path)
        add(MountOp(MountKind.READONLY, path, source=path), 1)
    for path, text in sorted((data_files or {}).items()):
        make_parents(path)
        add(MountOp(MountKind.DATA, path, data=text), 2)
    seen: set[tuple[MountKind, Path]] = set()
    ops = [t for t in ops if (t[2].kind, t[2].dest) not in seen and not seen.add((t[2].kind, t[2].dest))]
    ordered = [op for _, _, op in sorted(ops, key=lambda t: (t[0], t[1], str(t[2].dest)))]
    return (MountOp(MountKind.ROOT, Path("/"), source=Path("/")), *ordered)
