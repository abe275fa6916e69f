"""The owners of an unpacked layer's files, as the layer says, kept beside it and applied
through the id map episodes use (:mod:`sequester.sandbox.idmap`).

An image's files belong to its users (``_apt`` owns ``/var/cache/apt/archives/partial``,
``www-data`` its folders). A layer is unpacked by the caller, so everything in it first
belongs to the caller, which an episode shows as root. Here each entry the layer gives
another owner is listed while it is unpacked (:class:`Owners`, written as
``layers/<hex>.owners``, one JSON line per entry) and then applied:

* a root caller ``lchown``s each entry to the host id its owner has in the map (inside
  ``u`` -> host ``sub_uid + u - 1``), so the episode shows the image's real owner;
* an ordinary caller cannot give a file to its subordinate ids, so the same code runs as
  root of a user namespace that maps them (:func:`~sequester.sandbox.idspace.run_in_id_space`)
  and ``lchown``s to the inside ids;
* a caller without a range (one id) applies nothing: the list is kept, and applied the day
  the store's map changes (:meth:`~sequester.images.store.ImageStore` re-owns its layers
  when the caller's map is not the one they were made for).

Every entry is reached through folder descriptors opened ``O_NOFOLLOW`` from the layer's
root, so a symlink of the layer can never make this change a file outside it; an entry
that is gone (replaced later in the same layer) is skipped. ``chown`` clears setuid and
setgid bits, so a regular file's mode is set again after it.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from sequester.sandbox.idmap import IDS, IdMap

__all__ = [
    "Owners",
    "read_owners",
    "apply_owners",
    "apply_owners_inside",
    "apply_owners_to_caller",
    "own_layer",
    "map_tag",
]

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK

Entry = tuple[tuple[str, ...], int, int, int | None]  # parts, uid, gid, mode to set again (or None)


class Owners:
    """The non-root owners of a layer's entries, as its tar members give them (the last
    member of a name wins; one owned by root removes the name)."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, ...], tuple[int, int, int | None]] = {}
        self.unmapped = 0  # owners above 65,535: no map of an episode holds them (left root's)

    def note(self, parts: tuple[str, ...], uid: int, gid: int, mode: int | None) -> None:
        # Negative ids too (a pax header's ``uid=-N``, base-256 numbers: tarfile takes
        # them): through the map they would name host ids below the range (red team).
        if not (0 <= uid < IDS and 0 <= gid < IDS):
            self.unmapped += 1
            self.entries.pop(parts, None)
        elif uid == 0 and gid == 0:
            self.entries.pop(parts, None)
        else:
            keep = mode & 0o7777 if mode is not None and mode & 0o6000 else None
            self.entries[parts] = (uid, gid, keep)

    def write(self, path: Path) -> None:
        with open(path, "w", encoding="utf-8", errors="surrogateescape") as f:
            for parts, (uid, gid, mode) in self.entries.items():
                f.write(json.dumps([list(parts), uid, gid, mode]) + "\n")


def read_owners(path: str | os.PathLike[str]) -> Iterator[Entry]:
    """The entries :meth:`Owners.write` wrote (none when the file is missing)."""
    try:
        f = open(path, encoding="utf-8", errors="surrogateescape")
    except FileNotFoundError:
        return
    with f:
        for line in f:
            parts, uid, gid, mode = json.loads(line)
            uid, gid = int(uid), int(gid)
            if not (0 <= uid < IDS and 0 <= gid < IDS):
                raise ValueError(f"{path}: owner {uid}:{gid} is outside the ids an episode maps")
            yield tuple(parts), uid, gid, (None if mode is None else int(mode) & 0o7777)


def map_tag(ids: IdMap | None) -> str:
    """How a store's layers are owned: by the caller alone, or through ``ids``."""
    if ids is None:
        return f"caller {os.getuid()}:{os.getgid()}"
    return f"map {ids.uid}:{ids.gid}:{ids.sub_uid}:{ids.sub_gid}"


def apply_owners(folder: str, owners: str, shift: list[int] | None, to_caller: bool = False) -> int:
    """``lchown`` each entry of the ``owners`` file below ``folder``: to the host ids of
    the map ``shift`` (``[uid, gid, sub_uid, sub_gid]``) or, with ``None``, to the ids
    themselves (in a user namespace that maps them); with ``to_caller``, to this process's
    own ids instead. Returns the entries changed."""
    ids = IdMap(*shift) if shift is not None else None
    root = os.open(folder, _DIR)
    cached: tuple[tuple[str, ...], int] | None = None
    done = 0
    try:
        for parts, uid, gid, mode in read_owners(owners):
            parent = parts[:-1]
            if cached is None or cached[0] != parent:
                if cached is not None and cached[1] not in (root, -1):
                    os.close(cached[1])
                cached = (parent, _open_parent(root, parent))
            pfd = cached[1]
            if pfd < 0:
                continue
            if to_caller:
                uid, gid = os.getuid(), os.getgid()
            elif ids is not None:
                uid, gid = ids.host_uid(uid), ids.host_gid(gid)
            try:
                os.chown(parts[-1], uid, gid, dir_fd=pfd, follow_symlinks=False)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                    continue
                raise
            if mode is not None:
                _set_mode(pfd, parts[-1], mode)
            done += 1
    finally:
        if cached is not None and cached[1] not in (root, -1):
            os.close(cached[1])
        os.close(root)
    return done


def apply_owners_inside(folder: str, owners: str) -> int:
    """:func:`apply_owners` in a user namespace that maps the ids (the worker's entry)."""
    return apply_owners(folder, owners, None)


def apply_owners_to_caller(folder: str, owners: str) -> int:
    """Every listed entry back to the namespace's root, the caller (the worker's entry)."""
    return apply_owners(folder, owners, None, to_caller=True)


def own_layer(folder: Path, owners: Path, target: IdMap | None, *, current: IdMap | None = None) -> int:
    """Give ``folder``'s listed entries their owners under ``target`` (None: the caller's),
    from the map they are owned through now (``current``; None: the caller's, as a layer
    is unpacked). Root changes them directly; an ordinary caller as root of a namespace
    that maps the ids (through the caller first when both maps are ranges)."""
    if target == current or not owners.exists():
        return 0
    if os.geteuid() == 0:
        shift = None if target is None else [target.uid, target.gid, target.sub_uid, target.sub_gid]
        return apply_owners(str(folder), str(owners), shift, to_caller=target is None)
    from sequester.sandbox.idspace import run_in_id_space

    done: object = 0
    if current is not None:
        done = run_in_id_space(current, __name__, "apply_owners_to_caller", str(folder), str(owners))
    if target is not None:
        done = run_in_id_space(target, __name__, "apply_owners_inside", str(folder), str(owners))
    return int(done) if isinstance(done, int) else 0


def _open_parent(root: int, parts: tuple[str, ...]) -> int:
    """A descriptor of ``parts`` below ``root`` (``root`` itself for none), never through a
    symlink; -1 when it is not there (or not a folder any more)."""
    fd = root
    try:
        for name in parts:
            nxt = os.open(name, _DIR, dir_fd=fd)
            if fd != root:
                os.close(fd)
            fd = nxt
    except OSError as exc:
        if fd != root:
            os.close(fd)
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return -1
        raise
    return fd


def _set_mode(pfd: int, name: str, mode: int) -> None:
    """Set ``mode`` again on the regular file ``name`` (its setuid/setgid bits)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=pfd)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENXIO):
            return
        raise
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.fchmod(fd, mode)
    finally:
        os.close(fd)
