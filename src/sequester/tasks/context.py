"""Which host files a Dockerfile plan's copies take from the build context, and where they land.

Docker's rules: a source is relative to the context; a directory source copies its
*contents* (not the folder itself) into the destination; wildcards match within the
context; a file source becomes the destination, or goes into it when the destination is a
folder or there are several sources. On top of them, one rule of our own, because the
pairs are meant to be copied by a host process: nothing may resolve outside the context.
An absolute source, a ``..`` that climbs out, or a symlink (at any depth) whose target is
outside is a :class:`TaskError` naming the Dockerfile line, as are a missing source and a
special file (a FIFO would hang whoever copies it). A ``.dockerignore`` is refused rather
than ignored: it would silently change which files Docker copies.

Reading only: nothing in the context is created, changed or followed out of it.
"""

from __future__ import annotations

import os
import posixpath
import stat
import tarfile
from pathlib import Path
from typing import TYPE_CHECKING

from sequester.errors import TaskError

if TYPE_CHECKING:  # pragma: no cover
    from sequester.tasks.dockerfile import DockerfilePlan

__all__ = ["context_matches", "inside_context", "is_archive", "resolve_copies", "walk_context"]

_GLOB = frozenset("*?[")
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def resolve_copies(plan: DockerfilePlan, context: Path) -> list[tuple[Path, str]]:
    """Expand each copy of ``plan`` into (host path, absolute container path) pairs, in order.

    One pair per entry: for a directory source, the directory itself (create ``dest``),
    then everything beneath it, parents before children, names sorted. A symlink given as a
    source is followed (as Docker does) and the pair holds its target; a symlink found
    inside a copied directory is listed as itself (Docker copies it as a link) and must
    also resolve inside the context. A later pair for the same destination wins.
    """
    root = Path(context)
    try:
        real_root = root.resolve(strict=True)
    except OSError:
        raise TaskError(f"{root}: the build context does not exist") from None
    if not real_root.is_dir():
        raise TaskError(f"{root}: the build context is not a directory")
    for name in (".dockerignore", f"{Path(plan.source).name}.dockerignore"):
        if (root / name).exists():
            raise TaskError(f"{root / name}: .dockerignore is not supported (it changes which files are copied)")
    pairs: list[tuple[Path, str]] = []
    for step in plan.copies:
        where = f"{plan.source}:{step.line}"
        matches = [(src, path) for src in step.sources for path in context_matches(root, src, where)]
        into = step.dest_is_dir or len(matches) > 1
        for src, path in matches:
            real = inside_context(path, real_root, where, src)
            if real.is_dir():
                pairs += walk_context(real, step.dest, real_root, where, src)
            elif real.is_file():
                if step.instruction == "ADD" and is_archive(real):
                    raise TaskError(
                        f"{where}: ADD {src}: {path.name} is an archive Docker would extract; not supported"
                    )
                pairs.append((real, posixpath.join(step.dest, path.name) if into else step.dest))
            elif not real.exists():
                raise TaskError(f"{where}: {step.instruction} source {src!r}: {path} is a dangling symlink")
            else:
                raise TaskError(f"{where}: {step.instruction} source {src!r}: {path} is not a file or directory")
    return pairs


def context_matches(root: Path, src: str, where: str) -> list[Path]:
    if src.startswith("/"):
        raise TaskError(f"{where}: source {src!r} is an absolute path; sources are relative to the build context")
    norm = posixpath.normpath(src)
    if norm == ".." or norm.startswith("../"):
        raise TaskError(f"{where}: source {src!r} is outside the build context")
    if _GLOB & set(norm):
        found = sorted(root.glob(norm))
        if not found:
            raise TaskError(f"{where}: source {src!r} matches nothing in the build context {root}")
        return found
    path = root if norm == "." else root / norm
    if not path.exists() and not path.is_symlink():
        raise TaskError(f"{where}: source {src!r} does not exist in the build context {root}")
    return [path]


def inside_context(path: Path, real_root: Path, where: str, src: str) -> Path:
    """``path`` with every symlink resolved; a TaskError if that leaves the context."""
    real = Path(os.path.realpath(path))
    if real != real_root and real_root not in real.parents:
        raise TaskError(f"{where}: source {src!r}: {path} resolves to {real}, outside the build context")
    return real


def walk_context(top: Path, dest: str, real_root: Path, where: str, src: str) -> list[tuple[Path, str]]:
    def fail(exc: OSError) -> None:
        raise TaskError(f"{where}: source {src!r}: cannot read {exc.filename}: {exc.strerror}")

    pairs = [(top, dest)]
    for folder, dirnames, filenames in os.walk(top, onerror=fail):
        dirnames.sort()
        base = Path(folder)
        target = posixpath.join(dest, base.relative_to(top).as_posix())
        for name in sorted(dirnames + filenames):
            entry = base / name
            mode = entry.lstat().st_mode
            if stat.S_ISLNK(mode):
                inside_context(entry, real_root, where, src)
            elif not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                raise TaskError(f"{where}: source {src!r}: {entry} is not a file, directory or symlink")
            pairs.append((entry, posixpath.normpath(posixpath.join(target, name))))
    return pairs


def is_archive(path: Path) -> bool:
    """Whether Docker's ADD would unpack this file: a tar, plain or compressed (by content)."""
    try:
        with open(path, "rb") as f:
            if f.read(4) == _ZSTD_MAGIC:
                return True
        return tarfile.is_tarfile(path)
    except OSError:
        return False
