"""Compiled bytecode for the modules a kernel imports at start-up, written by the host.

A kernel runs with ``-B`` on a read-only view of the installation, so it can never write
a ``.pyc``; without one on disk, every kernel compiles sequester's start-up modules from
source (10-15 ms of each start with an editable install, or wherever ``.pyc`` writing is
off). The host writes them once per process into the usual ``__pycache__`` folders, next
to the sources, where the kernel's interpreter looks. They are trusted the way the
sources are: whoever can write them can write the ``.py`` beside them, and the kernel's
view of both is read-only. An installation the host cannot write (a system package
installed with its bytecode) is left as it is.
"""

from __future__ import annotations

import logging
import os
import py_compile
import sys
from functools import lru_cache
from pathlib import Path

__all__ = ["KERNEL_PACKAGES", "ensure_kernel_bytecode", "is_fresh"]

log = logging.getLogger(__name__)

# What a kernel imports (both stages): the package's own __init__ and these subpackages.
KERNEL_PACKAGES = ("kernel", "guard", "net")


def _cache_path(source: Path) -> Path:
    """Where an interpreter with no ``pycache_prefix`` looks (the kernel's never has one)."""
    return source.parent / "__pycache__" / f"{source.stem}.{sys.implementation.cache_tag}.pyc"


def is_fresh(source: Path, cached: Path) -> bool:
    """The ``.pyc`` header's source mtime and size match ``source`` (what import checks)."""
    try:
        st = source.stat()
        with open(cached, "rb") as f:
            header = f.read(16)
    except OSError:
        return False
    if len(header) < 16 or int.from_bytes(header[4:8], "little") & 0b1:  # hash-based: let import decide
        return len(header) == 16
    mtime = int.from_bytes(header[8:12], "little")
    size = int.from_bytes(header[12:16], "little")
    return mtime == (int(st.st_mtime) & 0xFFFFFFFF) and size == (st.st_size & 0xFFFFFFFF)


@lru_cache(maxsize=4)
def ensure_kernel_bytecode(package_root: Path) -> int:
    """Compile the kernel's modules below ``package_root`` whose ``.pyc`` is missing or
    stale; returns how many were written. Once per process and root."""
    package = package_root / "sequester"
    sources = [package / "__init__.py"]
    for sub in KERNEL_PACKAGES:
        sources += sorted((package / sub).glob("*.py"))
    written = 0
    for source in sources:
        cached = _cache_path(source)
        if is_fresh(source, cached):
            continue
        try:
            py_compile.compile(
                str(source), cfile=str(cached), doraise=True, invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP
            )
            written += 1
        except (OSError, py_compile.PyCompileError) as exc:
            log.debug("no bytecode for %s: %s", source, exc)
            if isinstance(exc, PermissionError) or not os.access(source.parent, os.W_OK):
                break  # a read-only installation: nothing else will be writable either
    return written
