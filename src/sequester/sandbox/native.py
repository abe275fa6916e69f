"""Foreign-function libraries a kernel's view must not contain.

``_ctypes`` (and cffi's ``_cffi_backend``) let Python code call any C function and write
any memory: with either loaded, the audit hook is just data to overwrite. The hook
refuses ``import ctypes``, but a cell can switch the hook off (its frame is in the
traceback of every refusal). So the view covers these libraries with ``/dev/null``, in
every Python installation the view shows, and the kernel's writable mounts are
``noexec`` (a copy written there cannot be loaded either; see
:mod:`sequester.guard.namespaces`). The kernel's first stage, which needs ctypes to
confine itself, gets ``_ctypes`` as a file the host opened (see :mod:`sequester.kernel.boot`).

:func:`package_dir_patterns` and :func:`is_ffi_library` are pure; :func:`find_ffi_libraries`
looks for them in the package folders of the usual
places of Python installations (not a walk of the whole tree: a library deep inside some
unrelated bundle is not found; it would also have to match this interpreter's ABI).
"""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

__all__ = [
    "FFI_MODULES",
    "package_dir_patterns",
    "is_ffi_library",
    "find_ffi_libraries",
    "ctypes_library",
    "installation_roots",
]

# The foreign-function interfaces and ctypes' own test helper.
FFI_MODULES = ("_ctypes", "_ctypes_test", "_cffi_backend")
_PACKAGE_DIRS = ("lib-dynload", "site-packages", "dist-packages")


def package_dir_patterns(root: Path) -> tuple[str, ...]:
    """Glob patterns, below one installation root, of the folders that can hold an
    extension module; the root itself counts (it may be a folder on ``sys.path``)."""
    out = [str(root)]
    for lib in ("lib", "lib64", "local/lib"):
        out += [str(root / lib / "python3*" / sub) for sub in _PACKAGE_DIRS]
    out.append(str(root / "lib" / "python3" / "dist-packages"))
    return tuple(out)


def is_ffi_library(name: str) -> bool:
    """``_ctypes.cpython-311-x86_64-linux-gnu.so``, ``_cffi_backend.abi3.so``, ``_ctypes.so``, ..."""
    module, dot, _ = name.partition(".")
    return bool(dot) and module in FFI_MODULES and name.endswith(".so")


def installation_roots(python_roots: Iterable[Path], extra: Iterable[Path] = ()) -> tuple[Path, ...]:
    """Where Python installations usually are: this interpreter's prefixes, ``/usr``,
    ``/usr/local``, ``/opt/*`` and ``/opt/*/*`` (conda, deadsnakes, ...), the folders on
    ``sys.path`` and ``PYTHONPATH``, and ``extra`` (the policy's read-only paths)."""
    roots: list[Path] = [*python_roots, Path("/usr"), Path("/usr/local")]
    for pattern in ("/opt/*", "/opt/*/*"):
        roots += [Path(p) for p in glob.glob(pattern) if os.path.isdir(p)]
    roots += [Path(p) for p in sys.path if p and os.path.isdir(p)]
    roots += [Path(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.isdir(p)]
    roots += list(extra)
    return tuple(dict.fromkeys(roots))


def find_ffi_libraries(roots: Iterable[Path]) -> tuple[Path, ...]:
    """Every FFI library (:func:`is_ffi_library`) in the package folders below ``roots``,
    by real path. Cached on modification times (a launch must not glob the installations
    every time): of the roots and their ``lib`` folders for the folder list, of each
    package folder for its listing."""
    roots = tuple(roots)
    folders = _package_folders(roots, tuple(_mtime(p) for p in _stamp_paths(roots)))
    found: set[Path] = set()
    for folder in folders:
        found.update(_ffi_in(folder, _mtime(folder)))
    return tuple(sorted(found))


@lru_cache(maxsize=16)
def _stamp_paths(roots: tuple[Path, ...]) -> tuple[str, ...]:
    """The folders whose mtimes date the folder list (strings: this runs at every launch)."""
    return tuple(
        os.path.join(str(r), sub) if sub else str(r) for r in roots for sub in ("", "lib", "lib64", "local/lib")
    )


def _mtime(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return -1


@lru_cache(maxsize=16)
def _package_folders(roots: tuple[Path, ...], stamps: tuple[int, ...]) -> tuple[str, ...]:
    return tuple(sorted({d for root in roots for pattern in package_dir_patterns(root) for d in glob.glob(pattern)}))


@lru_cache(maxsize=256)
def _ffi_in(folder: str, stamp: int) -> tuple[Path, ...]:
    try:
        names = os.listdir(folder)
    except OSError:
        return ()
    return tuple(
        Path(os.path.realpath(os.path.join(folder, n)))
        for n in names
        if is_ffi_library(n) and os.path.isfile(os.path.join(folder, n))
    )


def ctypes_library() -> Path:
    """This interpreter's ``_ctypes`` library (the host opens it for the first stage)."""
    import _ctypes

    return Path(_ctypes.__file__).resolve()
