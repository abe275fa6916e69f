"""Putting a finished folder in place without ever replacing what is there."""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

__all__ = ["rename_noreplace"]

_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def rename_noreplace(src: Path, dst: Path) -> bool:
    """Rename ``src`` to ``dst`` unless something is at ``dst`` (False then). Plain rename
    would silently replace an *empty* folder, e.g. an empty layer a concurrent unpack just
    finished and may have mounted; renameat2(RENAME_NOREPLACE) never replaces anything."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        renameat2 = None
    if renameat2 is not None:
        if renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return True
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            return False
        if err not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise OSError(err, os.strerror(err), str(dst))
    if os.path.lexists(dst):  # no renameat2 here: a small window remains, on empty folders only
        return False
    try:
        os.rename(src, dst)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            return False
        raise
    return True
