"""Removing from the image store: an image (never one an episode holds), and whatever no
image needs any more (layers, blobs, temporary folders, use marks). The caller holds the
store's ``gc.lock`` exclusively, so no fetch runs meanwhile (a fetch holds it shared from
its first blob to its record)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from sequester.errors import ImageError
from sequester.images.records import ImageRecord, hex_of
from sequester.sandbox.idspace import remove_mapped_tree

if TYPE_CHECKING:
    from sequester.images.store import ImageStore

__all__ = ["drop_record", "collect_garbage"]


def drop_record(self: ImageStore, record: ImageRecord) -> None:
    """Remove ``record`` (refused while an episode holds a lease on it)."""
    used = self.root / "images" / f"{hex_of(record.id)}.used"
    fd = os.open(used, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ImageError(
                f"image {record.names[0] if record.names else record.short_id} is in use by a running episode"
            ) from None
        with self.lock("lock", fcntl.LOCK_EX):
            (self.root / "images" / f"{hex_of(record.id)}.json").unlink(missing_ok=True)
            used.unlink(missing_ok=True)
    finally:
        os.close(fd)


def collect_garbage(self: ImageStore) -> int:
    """Remove what no record needs; the caller holds gc.lock exclusively."""
    from sequester.images.build_cache import BuildCache

    records = self.records()
    keep_layers = {hex_of(layer.diff_id) for r in records for layer in r.layers} | BuildCache(self.root).layers()
    keep_blobs = {hex_of(d) for r in records for d in (r.id, r.config_digest)}
    freed = 0
    for entry in (self.root / "layers").iterdir():
        name = entry.name.removesuffix(".json").removesuffix(".owners")
        if name not in keep_layers:
            freed += _size(entry)
            remove_mapped_tree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink(missing_ok=True)
    for entry in (self.root / "blobs" / "sha256").iterdir():
        if entry.name not in keep_blobs:
            freed += _size(entry)
            entry.unlink(missing_ok=True)
    for entry in (self.root / "images").glob("*.used"):  # left by a lease of an image since removed
        if not entry.with_suffix(".json").exists():
            entry.unlink(missing_ok=True)
    for entry in (self.root / "tmp").iterdir():
        freed += _size(entry)
        remove_mapped_tree(entry) if entry.is_dir() else entry.unlink(missing_ok=True)
    return freed


def _size(path: Path) -> int:
    """Bytes on disk below ``path``, walked without recursion or links (a layer a build
    wrote can be thousands of folders deep: os.walk's recursion would end every prune)."""
    total = 0
    stack = [str(path)]
    try:
        st = path.lstat()
    except OSError:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        return st.st_blocks * 512
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    with contextlib.suppress(OSError):
                        info = entry.stat(follow_symlinks=False)
                        total += info.st_blocks * 512
                        if stat.S_ISDIR(info.st_mode):
                            stack.append(entry.path)
        except OSError:
            continue
    return total
