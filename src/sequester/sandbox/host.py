"""Facts about the host that decide a sandbox's view, gathered in one place.

Gathering touches the filesystem; everything downstream (:mod:`.mounts`, :mod:`.argv`)
is a pure function of a :class:`HostFacts` and a policy, so it is unit-tested with
made-up facts.
"""

from __future__ import annotations

import os
import pwd
import stat
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from sequester.sandbox.native import find_ffi_libraries, installation_roots

__all__ = ["DirEntry", "HostFacts", "gather_host_facts", "SCAN_SKIP"]

# Trees that are never scanned for user-owned directories: virtual filesystems and the
# directories the sandbox replaces anyway.
SCAN_SKIP = frozenset({"proc", "sys", "dev", "run", "tmp"})


@dataclass(frozen=True)
class DirEntry:
    """A directory entry near the top of the tree (depth 1 or 2)."""

    path: Path
    owner: int
    is_dir: bool
    is_symlink: bool
    link_target: str | None = None


@dataclass(frozen=True)
class HostFacts:
    uid: int
    gid: int
    home: Path | None
    python_executable: Path
    python_roots: tuple[Path, ...]
    package_root: Path
    entries: tuple[DirEntry, ...]
    sys_cpu: Path | None = Path("/sys/devices/system/cpu")
    var_tmp: bool = False  # /var/tmp is a folder under a visible /var
    # _ctypes, _cffi_backend, ... in the installations the view may show (see .native)
    ffi_libraries: tuple[Path, ...] = ()

    @property
    def is_root(self) -> bool:
        return self.uid == 0


@lru_cache(maxsize=1)
def _python_roots() -> tuple[Path, ...]:
    """The Python installation: prefixes, plus the real interpreter's folder if elsewhere."""
    roots = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    real_exe = Path(sys.executable).resolve()
    if not any(real_exe.is_relative_to(r) for r in roots):
        roots.add(real_exe.parent)
    return tuple(sorted(roots))


@lru_cache(maxsize=1)
def _package_root() -> Path:
    """The sys.path entry that holds the ``sequester`` package (its parent folder)."""
    return Path(__file__).resolve().parent.parent.parent


def _scan(uid: int, deep: bool) -> tuple[DirEntry, ...]:
    """Stat every entry of ``/`` and, if ``deep``, one level more below directories the
    user does not own.

    Depth two finds the usual places of a user's data (``/home/u``, ``/data/u``,
    ``/scratch/u``) without walking the whole tree. Root's rule looks at ``/`` only
    (see :func:`sequester.sandbox.mounts.hidden_paths`).
    """
    found: list[DirEntry] = []

    def entry(path: Path) -> DirEntry | None:
        try:
            st = os.lstat(path)
        except OSError:
            return None
        is_link = stat.S_ISLNK(st.st_mode)
        target = None
        if is_link:
            try:
                target = os.readlink(path)
            except OSError:
                return None
        return DirEntry(path, st.st_uid, stat.S_ISDIR(st.st_mode), is_link, target)

    try:
        top = sorted(os.listdir("/"))
    except OSError:
        top = []
    for name in top:
        first = entry(Path("/") / name)
        if first is None:
            continue
        found.append(first)
        if not deep or name in SCAN_SKIP or not first.is_dir or first.is_symlink or first.owner == uid:
            continue
        try:
            children = sorted(os.listdir(first.path))
        except OSError:
            continue
        for child in children:
            second = entry(first.path / child)
            if second is not None and (second.is_dir or second.owner == uid):
                found.append(second)
    return tuple(found)


@lru_cache(maxsize=8)
def _scan_cached(uid: int, deep: bool, root_key: tuple[int, int, int]) -> tuple[DirEntry, ...]:
    return _scan(uid, deep)


def _entries(uid: int) -> tuple[DirEntry, ...]:
    """Root's rule depends only on the names, kinds and link targets at the top level,
    and any change to those changes the mtime of ``/``: its scan is cached on that.
    Everyone else's depends on ownership two levels deep, so it is redone each time."""
    if uid != 0:
        return _scan(uid, deep=True)
    st = os.stat("/")
    return _scan_cached(uid, False, (st.st_dev, st.st_ino, st.st_mtime_ns))


def gather_host_facts(*, scan_ffi: bool = False, extra_roots: tuple[Path, ...] = ()) -> HostFacts:
    """The facts of this host; with ``scan_ffi``, also the FFI libraries a kernel's view
    must cover (in the usual installation folders and ``extra_roots``)."""
    uid, gid = os.getuid(), os.getgid()
    home_text = os.environ.get("HOME")
    if not home_text:
        try:
            home_text = pwd.getpwuid(uid).pw_dir
        except KeyError:
            home_text = None
    home = Path(home_text).resolve() if home_text and Path(home_text).is_dir() else None
    return HostFacts(
        uid=uid,
        gid=gid,
        home=home if home != Path("/") else None,
        python_executable=Path(sys.executable),
        python_roots=_python_roots(),
        package_root=_package_root(),
        entries=_entries(uid),
        sys_cpu=Path("/sys/devices/system/cpu") if os.path.isdir("/sys/devices/system/cpu") else None,
        var_tmp=os.path.isdir("/var/tmp") and not os.path.islink("/var/tmp") and not os.path.islink("/var"),
        ffi_libraries=find_ffi_libraries(installation_roots(_python_roots(), extra_roots)) if scan_ffi else (),
    )
