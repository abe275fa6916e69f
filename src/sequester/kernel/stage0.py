"""The native first stage's program: built once from ``stage0.c`` with the host's C compiler.

A sandboxed kernel confines itself before it runs any cell. The Python first stage
(:mod:`.boot`) needs ctypes for that, and a process that ever loaded ctypes cannot run
cells (see :mod:`sequester.guard.handoff`), so it must ``execve`` a second interpreter:
two Python start-ups per kernel. ``stage0.c`` does the same system calls natively, so
bwrap execs it and it execs the one interpreter that runs cells. The program is small,
decides nothing (:mod:`sequester.guard.native_plan` plans every call) and is compiled
here rather than shipped, because it must match this machine's kernel headers and libc
and because a wheel of sequester stays pure Python.

Where no C compiler exists, or ``SEQUESTER_NATIVE_STAGE=0``, kernels use the Python
stage: the same confinement, slower to start. The build lives in the user's cache
(root's in ``/var/cache/sequester``), in a folder that must belong to the caller and be
writable by nobody else (whoever can replace the program runs code with the kernel's
bootstrap capabilities, before its filter): anything else, and the Python stage is used.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from functools import lru_cache
from pathlib import Path

from sequester.caches import cache_root

__all__ = [
    "SOURCE",
    "SOURCES",
    "FORK_SOURCES",
    "stage0_program",
    "build_stage0",
    "build_fork_module",
    "fork_module",
    "native_stage_enabled",
    "cache_folder",
    "runs_here",
]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("stage0.c")
# Everything the program is built from: the plan executor, its privilege steps, the view
# template's keeper, and their shared header (hashed with the rest).
SOURCES = tuple(Path(__file__).with_name(n) for n in ("stage0.c", "stage0_privileges.c", "stage0_template.c"))
HEADER = Path(__file__).with_name("stage0.h")
# A warm kernel's fork module: the plan executor as a Python extension (stage0_fork.c).
FORK_SOURCES = tuple(Path(__file__).with_name(n) for n in ("stage0_fork.c", "stage0.c", "stage0_privileges.c"))
_FLAGS = ("-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-fno-strict-aliasing")
_BUILD_TIMEOUT = 120.0
_lock = threading.Lock()


def native_stage_enabled() -> bool:
    return os.environ.get("SEQUESTER_NATIVE_STAGE", "1").strip().lower() not in ("0", "false", "no", "off")


def cache_folder() -> Path:
    return cache_root() / "stage0"


def _compiler() -> str | None:
    for name in (os.environ.get("CC") or "", "cc", "gcc", "clang"):
        if name and (found := shutil.which(name)):
            return found
    return None


def _private_folder(path: Path) -> bool:
    """``path`` (made if missing) is ours and ``0700``, and every folder above it belongs
    to us or root and is writable by no one else (or is sticky, as ``/tmp``).

    ``0700``: a root caller's kernel runs as nobody and its view shows ``/var``, so the
    program (and which build it is) stays out of its reach (red team)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        return False
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)  # ours and writable by no one else: an earlier version made it 0755
    for parent in path.parents:
        st = os.stat(parent)
        if st.st_uid not in (0, os.getuid()) or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
            return False
    return True


def _build(
    folder: Path,
    name: str,
    sources: tuple[Path, ...],
    compiler: str,
    flags: tuple[str, ...],
    variants: tuple[tuple[str, ...], ...],
    salt: bytes,
) -> Path:
    """Compile ``sources`` with ``flags`` and the first of ``variants`` the compiler takes
    into ``folder/<hash of sources, header, compiler, flags and salt>/name`` (atomically: a
    temporary name, then a rename); the existing build when there is one."""
    data = [p.read_bytes() for p in (*sources, HEADER)]
    key = hashlib.sha256(b"\0".join([*data, compiler.encode(), *(f.encode() for f in flags), salt])).hexdigest()[:24]
    target = folder / key / name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as scratch:
        out = Path(scratch) / name
        for extra in variants:
            result = subprocess.run(
                [compiler, *flags, *extra, "-o", str(out), *(str(p) for p in sources)],
                capture_output=True,
                text=True,
                timeout=_BUILD_TIMEOUT,
                stdin=subprocess.DEVNULL,
            )
            if result.returncode == 0:
                break
        if result.returncode != 0:
            raise OSError(f"{compiler} failed on {sources[0].name}: {result.stderr.strip()[-2000:]}")
        os.chmod(out, 0o755)
        os.replace(out, target)
    return target


def build_stage0(folder: Path, compiler: str) -> Path:
    """Compile ``stage0.c`` into ``folder/<hash of source, compiler and flags>/stage0``
    (atomically); the existing build when there is one. Static where the C library allows
    it (libc.a): no dynamic loading at every kernel start (about 0.25 ms here), and nothing
    of the view's libraries runs first."""
    target = _build(folder, "stage0", SOURCES, compiler, _FLAGS, (("-static",), ()), b"static-first")
    _drop_old_builds(folder, keep=target.parent)
    return target


def build_fork_module(folder: Path, compiler: str, include: Path) -> Path:
    """Compile the fork module (``stage0_fork.c`` with the plan executor) against the
    Python headers in ``include``, into ``folder/<hash>/fork.so`` (atomically); the
    existing build when there is one."""
    flags = (*_FLAGS, "-shared", "-fPIC", "-DSTAGE0_LIBRARY", f"-I{include}")
    return _build(folder, "fork.so", FORK_SOURCES, compiler, flags, ((),), b"fork")


@lru_cache(maxsize=1)
def _cached_fork_module() -> Path | str:
    import sysconfig

    compiler = _compiler()
    if compiler is None:
        return "no C compiler here"
    include = Path(sysconfig.get_paths()["include"])
    if not (include / "Python.h").is_file():
        return f"no Python headers at {include} (Debian: apt-get install python3-dev)"
    folder = cache_folder()
    try:
        if not _private_folder(folder):
            return f"{folder} is not private to this user"
        return build_fork_module(folder, compiler, include)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"the fork module did not build: {exc}"


def fork_module() -> Path:
    """The fork module for this Python (built on first use), checked as the native stage
    is at every use; :class:`~sequester.errors.SandboxError` saying why where it cannot be
    had (warm kernels need it: a C compiler and this Python's headers)."""
    from sequester.errors import SandboxError

    with _lock:
        built = _cached_fork_module()
    if isinstance(built, str):
        raise SandboxError(f"warm kernels need the native fork module: {built}")
    try:
        st, folder = os.lstat(built), os.lstat(built.parent)
    except OSError:
        _cached_fork_module.cache_clear()
        raise SandboxError("warm kernels need the native fork module: its build went missing") from None
    if (
        not stat.S_ISREG(st.st_mode)
        or st.st_uid != os.getuid()
        or st.st_mode & 0o022
        or folder.st_uid != os.getuid()
        or folder.st_mode & 0o022
    ):
        raise SandboxError(f"warm kernels need the native fork module: {built} changed owner or mode")
    return built


def _drop_old_builds(folder: Path, keep: Path, age: float = 86400.0) -> None:
    """Builds of earlier sources (an upgrade) a day unused: a running sequester of the
    old version may still bind its own, so only old ones go."""
    for entry in folder.iterdir():
        try:
            if (
                entry != keep
                and entry.is_dir()
                and not entry.is_symlink()
                and time.time() - entry.stat().st_mtime > age
            ):
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            continue


def runs_here(program: Path) -> bool:
    """``program`` executes on this host and is the native stage (its usage line, status 2).
    bwrap binds it into the view with its mount's flags, so a ``noexec`` cache folder
    would fail every kernel's start: better the Python stage."""
    try:
        result = subprocess.run([str(program)], capture_output=True, timeout=10, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return False
    return result.returncode == 2 and b"sequester's kernel first stage" in result.stderr


@lru_cache(maxsize=1)
def _cached_program() -> Path | None:
    compiler = _compiler()
    if compiler is None:
        log.info("no C compiler: kernels start through the Python first stage (two interpreter starts)")
        return None
    folder = cache_folder()
    try:
        if not _private_folder(folder):
            log.warning("%s is not private to this user: kernels use the Python first stage", folder)
            return None
        program = build_stage0(folder, compiler)
        if not runs_here(program):
            log.warning("%s does not run here (a noexec mount?): kernels use the Python first stage", program)
            return None
        return program
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("could not build the native first stage (%s): kernels use the Python first stage", exc)
        return None


def stage0_program() -> Path | None:
    """The native first stage's program, built on first use; ``None``: use the Python stage."""
    if not native_stage_enabled():
        return None
    with _lock:
        program = _cached_program()
    if program is not None:
        # Re-checked at every start, cheaply: the file and its folder must still be ours,
        # writable by no one else, and the file executable (a program swapped for
        # another would run before the kernel's filter; one that cannot run would fail
        # every start instead of falling back).
        try:
            st, folder = os.lstat(program), os.lstat(program.parent)
        except OSError:
            _cached_program.cache_clear()
            return None
        if (
            not stat.S_ISREG(st.st_mode)
            or st.st_uid != os.getuid()
            or st.st_mode & 0o022
            or not st.st_mode & stat.S_IXUSR
            or not stat.S_ISDIR(folder.st_mode)
            or folder.st_uid != os.getuid()
            or folder.st_mode & 0o022
        ):
            log.warning("%s changed owner or mode: kernels use the Python first stage", program)
            return None
    return program
