"""A task folder's checksum (Harbor's ``task_checksum`` field; the calibration key's)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = ["task_checksum"]


def task_checksum(task_dir: Path) -> str:
    """A SHA-256 over the task folder: every file's and link's relative path, kind and
    content, in sorted order (stable across machines; not Harbor's dirhash bytes, which
    Harbor never recomputes from a result)."""
    digest = hashlib.sha256()
    root = Path(task_dir)
    for current, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files) + [d for d in dirs if Path(current, d).is_symlink()]:
            path = Path(current, name)
            rel = path.relative_to(root).as_posix().encode()
            if path.is_symlink():
                digest.update(b"L\0" + rel + b"\0" + os.readlink(path).encode() + b"\0")
            elif path.is_file():
                digest.update(b"F\0" + rel + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()
