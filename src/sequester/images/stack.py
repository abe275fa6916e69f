"""Reading an image's stack of unpacked layers as the merged tree overlayfs will show.

Only two things are ever read, both bounded: the top level of each layer (to plan one
overlay per top-level folder, since an overlay over ``/`` itself is refused) and one small
file (``/etc/passwd``, ``/etc/group``) to resolve the config's ``User``. Nothing is
followed: a symlink is read as a link, and a file is opened with ``O_NOFOLLOW`` from a
folder opened the same way, so a layer's links never lead outside it.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sequester.errors import ImageError

__all__ = [
    "TopEntry",
    "merge_tops",
    "read_image_file",
    "image_path_kind",
    "image_link",
    "resolve_user",
    "OPAQUE_XATTR",
]

OPAQUE_XATTR = "user.overlay.opaque"
_TOP_LIMIT = 1024  # top-level entries per layer (bwrap takes at most 9000 arguments: ~4 per entry)
_FILE_LIMIT = 1 << 20


@dataclass(frozen=True)
class TopEntry:
    """A top-level entry of the merged image: a folder made of ``lowers`` (lowest first),
    a symlink to ``target``, or a file (``lowers[0]`` is it)."""

    name: str
    kind: str  # "dir" | "symlink" | "file"
    lowers: tuple[Path, ...] = ()
    target: str | None = None


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _opaque(path: Path) -> bool:
    try:
        return os.getxattr(path, OPAQUE_XATTR, follow_symlinks=False) == b"y"
    except OSError:
        return False


def merge_tops(layers: Sequence[Path]) -> list[TopEntry]:
    """The merged top level of ``layers`` (lowest first), as overlayfs resolves it: the
    topmost layer decides an entry's kind; a folder takes the folders below it until a
    layer where the name is not a folder, is whited out, or the folder is opaque."""
    state: dict[str, tuple[str, list[Path], str | None, bool]] = {}  # name -> kind, lowers, target, open
    for layer in reversed(layers):
        try:
            names = os.listdir(layer)
        except OSError as exc:
            raise ImageError(f"layer {layer} cannot be read: {exc}") from None
        if len(names) > _TOP_LIMIT:
            raise ImageError(f"layer {layer} has more than {_TOP_LIMIT} top-level entries")
        for name in sorted(names):
            path = layer / name
            st = os.lstat(path)
            seen = state.get(name)
            if seen is not None:
                kind, lowers, target, is_open = seen
                if is_open and stat.S_ISDIR(st.st_mode):
                    lowers.append(path)
                    state[name] = (kind, lowers, target, not _opaque(path))
                elif is_open:
                    state[name] = (kind, lowers, target, False)
                continue
            if _is_whiteout(st):
                state[name] = ("absent", [], None, False)
            elif stat.S_ISLNK(st.st_mode):
                state[name] = ("symlink", [], os.readlink(path), False)
            elif stat.S_ISDIR(st.st_mode):
                state[name] = ("dir", [path], None, not _opaque(path))
            elif stat.S_ISREG(st.st_mode):
                state[name] = ("file", [path], None, False)
        if _opaque(layer):  # the layer's root is opaque: nothing below it shows
            break
    return [
        TopEntry(name, kind, tuple(reversed(lowers)), target)
        for name, (kind, lowers, target, _) in sorted(state.items())
        if kind != "absent"
    ]


def read_image_file(layers: Sequence[Path], path: str, limit: int = _FILE_LIMIT) -> bytes | None:
    """The content of ``path`` in the merged image (the topmost layer that has it; a
    whiteout or a link on the way means: not there), or ``None``."""
    parts = [p for p in path.strip("/").split("/") if p]
    for layer in reversed(layers):
        fd = os.open(layer, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for i, part in enumerate(parts):
                try:
                    st = os.lstat(part, dir_fd=fd)
                except FileNotFoundError:
                    break
                if _is_whiteout(st) or stat.S_ISLNK(st.st_mode):
                    return None
                last = i == len(parts) - 1
                if last and not stat.S_ISREG(st.st_mode) or not last and not stat.S_ISDIR(st.st_mode):
                    return None
                flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (0 if last else os.O_DIRECTORY)
                try:
                    nfd = os.open(part, flags, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EACCES):
                        return None
                    raise
                os.close(fd)
                fd = nfd
                if last:  # (read what is there: never a buffer of ``limit`` for a small file)
                    data = os.read(fd, min(limit, os.fstat(fd).st_size) + 1)
                    return data[:limit]
        finally:
            os.close(fd)
    return None


def image_path_kind(layers: Sequence[Path], path: str) -> str:
    """``"dir"``, ``"other"`` (a file, or a link on the way: the image decides) or ``"none"``:
    what ``path`` is in the merged image, looked up without following anything."""
    parts = [p for p in path.strip("/").split("/") if p]
    if not parts:
        return "dir"
    for layer in reversed(layers):
        here = layer
        for i, part in enumerate(parts):
            try:
                st = os.lstat(here / part)
            except FileNotFoundError:
                break
            except OSError:
                return "other"
            if _is_whiteout(st):
                return "none"
            if not stat.S_ISDIR(st.st_mode):
                return "other"
            here = here / part
            if i == len(parts) - 1:
                return "dir"
            if _opaque(here) and i < len(parts) - 1:
                # What is below an opaque folder comes from this layer only. Looked up one
                # part at a time, never following a link (attack: a link there made the
                # host answer for a host folder, and a mount point went through it).
                return _kind_in_layer(here, parts[i + 1 :])
    return "none"


def image_link(layers: Sequence[Path], path: str) -> str | None:
    """The target of ``path`` in the merged image when it is a symbolic link, else None
    (absent, whited out, not a link, or a link on the way: nothing is followed)."""
    parts = [p for p in path.strip("/").split("/") if p]
    if not parts:
        return None
    for layer in reversed(layers):
        here, below_opaque = layer, False
        for i, part in enumerate(parts):
            try:
                st = os.lstat(here / part)
            except FileNotFoundError:
                if below_opaque:
                    return None  # (what is below an opaque folder comes from its layer only)
                break
            except OSError:
                return None
            if _is_whiteout(st):
                return None
            if i == len(parts) - 1:
                return os.readlink(here / part) if stat.S_ISLNK(st.st_mode) else None
            if not stat.S_ISDIR(st.st_mode):
                return None
            here = here / part
            below_opaque = below_opaque or _opaque(here)
    return None


def _kind_in_layer(here: Path, parts: Sequence[str]) -> str:
    for part in parts:
        try:
            st = os.lstat(here / part)
        except FileNotFoundError:
            return "none"
        except OSError:
            return "other"
        if _is_whiteout(st):
            return "none"
        if not stat.S_ISDIR(st.st_mode):
            return "other"
        here = here / part
    return "dir"


def _lookup(table: bytes | None, name: str, field: int) -> int | None:
    for line in (table or b"").decode(errors="replace").splitlines():
        parts = line.split(":")
        if len(parts) > 3 and parts[0] == name and parts[field].isdigit():
            return int(parts[field])
    return None


def resolve_user(layers: Sequence[Path], user: str) -> tuple[int, int, str | None]:
    """The config's ``User`` (``name``, ``uid``, ``name:group``, ``uid:gid``) as numbers,
    and the user's home from the image's ``/etc/passwd`` when it names one."""
    if not user:
        return 0, 0, "/root"
    name, _, group = user.partition(":")
    passwd = read_image_file(layers, "/etc/passwd")
    entry = None
    for line in (passwd or b"").decode(errors="replace").splitlines():
        parts = line.split(":")
        if len(parts) >= 7 and (parts[0] == name or (name.isdigit() and parts[2] == name)):
            entry = parts
            break
    if name.isdigit():
        uid = int(name)
    elif entry is not None and entry[2].isdigit():
        uid = int(entry[2])
    else:
        raise ImageError(f"the image's config names User {user!r}, and {name!r} is not in its /etc/passwd")
    if group:
        gid = int(group) if group.isdigit() else _lookup(read_image_file(layers, "/etc/group"), group, 2)
        if gid is None:
            raise ImageError(f"the image's config names User {user!r}, and group {group!r} is not in its /etc/group")
    else:
        gid = int(entry[3]) if entry is not None and entry[3].isdigit() else uid
    home = entry[5] if entry is not None and entry[5].startswith("/") else None
    if uid > 65535 or gid > 65535:
        raise ImageError(f"the image's config names User {user!r}: ids above 65535 are not supported")
    return uid, gid, home
