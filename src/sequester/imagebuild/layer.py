"""A build step's writable folder, made into a layer of the store.

The folder overlayfs wrote is already in the store's layer format (see
:mod:`.step_sandbox`); two things are left. The mount points bwrap had to make for the step's
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

from sequester.images.stack import image_path_kind
from sequester.sandbox.idspace import remove_mapped_tree
from sequester.sandbox.rename import rename_noreplace

__all__ = ["drop_mount_stubs", "commit_layer", "layer_size"]

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_SCAN_LIMIT = 2_000_000  # entries counted for a layer's size; beyond, the size is a lower bound


def drop_mount_stubs(upper: Path, lowers: Sequence[Path], stubs: Iterable[str]) -> None:
    """Remove from ``upper`` the empty folders bwrap made as mount points (``stubs``,
    relative paths, parents listed too), deepest first, where no lower layer has them.

    Attack: the step replaced ``/opt`` with a link to a host folder; a path-based rmdir of
    ``opt/sequester-verifier`` would then remove the host's. Every part is opened with
    ``O_NOFOLLOW`` from the layer's own folder, and the rmdir is relative to its parent."""
    for rel in sorted(set(stubs), key=lambda p: -p.count("/")):
        *parents, name = rel.split("/")
        parent = _open_parent(upper, parents)
        if parent is None:
            continue
        try:
            st = os.lstat(name, dir_fd=parent)
            if not stat.S_ISDIR(st.st_mode):
                continue
            below = image_path_kind(lowers, rel)
            # A folder the layers below have, copied up only because a mount point was
            # made in it, says nothing new: unless the step made it opaque (replaced it).
            if below not in ("none", "dir") or below == "dir" and _opaque(parent, name):
                continue
            os.rmdir(name, dir_fd=parent)  # only if empty: something the step wrote there stays
        except OSError:
            pass
        finally:
            os.close(parent)


def _open_parent(upper: Path, parts: Sequence[str]) -> int | None:
    try:
        fd = os.open(upper, _DIR)
    except OSError:
        return None
    for part in parts:
        try:
            nfd = os.open(part, _DIR, dir_fd=fd)
        except OSError:  # missing, or a link: nothing of ours is below it
            os.close(fd)
            return None
        os.close(fd)
        fd = nfd
    return fd


def _opaque(parent: int, name: str) -> bool:
    try:
        fd = os.open(name, _DIR, dir_fd=parent)
    except OSError:
        return False
    try:
        return os.getxattr(fd, "user.overlay.opaque") == b"y"
    except OSError:
        return False
    finally:
        os.close(fd)


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
        remove_mapped_tree(upper)
    return dest, size
