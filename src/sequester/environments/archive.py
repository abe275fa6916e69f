"""A folder of an episode as a tar, whatever the backend made it with. Pure.

Each backend packs a folder its own way (the namespace helper with names below ``/``, a
Docker engine with the folder's own name first); :func:`reroot` gives the one form
:meth:`~sequester.environments.base.Environment.read_dir` promises: names relative to the
folder, only folders, regular files and symlinks (no devices, fifos or hard links).
"""

from __future__ import annotations

import io
import os
import posixpath
import shutil
import tarfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["reroot", "unpack", "DIR_LIMIT", "MEMBER_LIMIT"]

DIR_LIMIT = 256 * 1024 * 1024  # the most of one folder read out of an episode (its tar)
MEMBER_LIMIT = 20_000  # the most entries of one such folder written on the host


def reroot(data: bytes, prefix: str) -> bytes:
    """The members of ``data`` below ``prefix`` (a member name, no leading ``/``), renamed
    relative to it; the ``prefix`` member itself and anything else are dropped."""
    prefix = prefix.strip("/")
    out = io.BytesIO()
    with (
        tarfile.open(fileobj=io.BytesIO(data), mode="r:") as src,
        tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as dst,
    ):
        for member in src:
            name = posixpath.normpath(member.name.lstrip("/"))
            if prefix and not name.startswith(prefix + "/"):
                continue
            rel = name[len(prefix) + 1 :] if prefix else name
            kept = member.isfile() or member.isdir() or member.issym()
            if not kept or not rel or rel == "." or rel.startswith("../"):
                continue
            member.name = rel
            dst.addfile(member, src.extractfile(member) if member.isfile() else None)
    return out.getvalue()


def unpack(
    data: bytes, dest: Path, *, skip: Callable[[str], bool] | None = None, limit: int = MEMBER_LIMIT
) -> list[str]:
    """Write a tar made inside an episode (names and links are the agent's) into the host
    folder ``dest``, by hand rather than by ``tarfile``'s extraction (whose safe ``data``
    filter older 3.11 releases lack): only folders, regular files (mode 0644, or 0755 when
    executable) and symlinks that point downward (no ``..``, not absolute: they cannot leave
    ``dest`` whatever other links it holds); nothing written through a link or
    over an existing entry; nothing whose name's first part ``skip`` says is the host's own
    there; at most ``limit`` entries. Returns notes for what was left out."""
    notes: list[str] = []
    left_out: list[str] = []
    count = 0
    root = os.path.realpath(dest)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        for member in tar:
            name = posixpath.normpath(member.name)
            if skip is not None and skip(name.split("/", 1)[0]):
                left_out.append(member.name)
                continue
            count += 1
            if count > limit:
                notes.append(f"only the first {limit} entries of it were kept")
                break
            why = _write(tar, member, name, Path(root))
            if why:
                left_out.append(f"{member.name} ({why})")
    if left_out:
        shown = ", ".join(left_out[:5]) + (f" and {len(left_out) - 5} more" if len(left_out) > 5 else "")
        notes.append(f"not kept: {shown}")
    return notes


def _write(tar: tarfile.TarFile, member: tarfile.TarInfo, name: str, root: Path) -> str | None:
    """Write one member below ``root`` (resolved); why not, or None."""
    if name.startswith("/") or name == ".." or name.startswith("../") or name == ".":
        return "outside the folder"
    target = root / name
    parent = os.path.realpath(target.parent)
    if parent != str(root) and not parent.startswith(str(root) + "/"):
        return "below a link"
    try:
        root.mkdir(parents=True, exist_ok=True)  # (none for an empty folder)
        target.parent.mkdir(parents=True, exist_ok=True)
        if member.isdir():
            if not target.is_dir() or target.is_symlink():
                target.mkdir(mode=0o755)
        elif member.isfile():
            src = tar.extractfile(member)
            assert src is not None
            mode = 0o755 if member.mode & 0o111 else 0o644
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
            with os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(src, out)
        elif member.issym():
            # Only links that go downward: a ".." part could climb out through another link
            # kept before it (red team: "up -> ." made "up/.." read as the folder itself while
            # it pointed above it; a chain of them reached any host path). Downward links
            # resolve through downward links only, so they stay inside.
            link = member.linkname
            if not link or link.startswith("/") or ".." in link.split("/"):
                return "a link that does not point downward into the folder"
            os.symlink(link, target)
        else:
            return "not a folder, file or link"
    except OSError as exc:
        return exc.strerror or str(exc)
    return None
