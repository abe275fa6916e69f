"""A build step's writable folder, made into a layer of the store.

The folder overlayfs wrote is already in the store's layer format (see
:mod:`.sandbox`); two things are left. The mount points bwrap had to make for the step's
own view (``/proc``, ``/dev``, the runner's folder for a copier) are not the step's
work: they are taken out again when the layers below did not have them. Then the folder
is renamed into ``layers/<key>`` (``renameat2(RENAME_NOREPLACE)``: a concurrent build of
the same step that got there first wins, and ours is dropped) with a small record of its
size.

The folder was written by untrusted code, but by now nothing runs in it (its sandbox is
dead); it is only walked without following links, with a bound on entries.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..episodes.remove import remove_tree
from ..images._tarsafe import rename_noreplace
from ..images.stack import image_path_kind

__all__ = ["drop_mount_stubs", "commit_layer", "layer_size"]

_SCAN_LIMIT = 2_000_000  # entries counted for a layer's size; beyond, the size is a lower bound


def drop_mount_stubs(upper: Path, lowers: Sequence[Path], stubs: Iterable[str]) -> None:
    """Remove from ``upper`` the empty folders bwrap made as mount points (``stubs``,
    relative paths, parents listed too), deepest first, where no lower layer has them."""
    for rel in sorted(set(stubs), key=lambda p: -p.count("/")):
        path = upper / rel
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(st.st_mode):
            continue
        below = image_path_kind(lowers, rel)
        # A folder the layers below have, copied up only because a mount point was made
        # in it, says nothing new: unless the step made it opaque (replaced it).
        if below == "dir" and _opaque(path):
            continue
        if below not in ("none", "dir"):
            continue
        try:
            os.rmdir(path)  # only if empty: something the step wrote there stays
        except OSError:
            pass


def _opaque(path: Path) -> bool:
    try:
        return os.getxattr(path, "user.overlay.opaque", follow_symlinks=False) == b"y"
    except OSError:
        return False


def layer_size(folder: Path) -> tuple[int, int]:
    """(bytes, entries) of ``folder``, walked without following links, bounded."""
    total = entries = 0
    stack = [str(folder)]
    while stack and entries < _SCAN_LIMIT:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    entries += 1
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if stat.S_ISDIR(st.st_mode):
                        stack.append(entry.path)
                    elif stat.S_ISREG(st.st_mode):
                        total += st.st_size
        except OSError:
            continue
    return total, entries


def commit_layer(upper: Path, layers_dir: Path, key_hex: str) -> tuple[Path, int]:
    """Move ``upper`` into ``layers_dir/key_hex``; (the layer's folder, its bytes)."""
    dest = layers_dir / key_hex
    size, entries = layer_size(upper)
    os.chmod(upper, 0o755)
    if rename_noreplace(upper, dest):
        (layers_dir / f"{key_hex}.json").write_text(json.dumps({"bytes": size, "entries": entries, "built": True}))
    else:  # the same step, built concurrently, is there already
        remove_tree(upper)
    return dest, size
