"""A COPY/ADD from the build context, checked and fingerprinted on the host.

The context is the task's ``environment/`` folder: task data, but still not to be
followed anywhere. The sources a step names are matched and checked with the rules of
:mod:`sequester.tasks.context` (relative, inside the context with every link resolved,
no special files, no ``.dockerignore``), and every file beneath them enters a digest
(relative path, type, mode, size and content, or a link's target), so that a change to a
copied file changes the step's cache key while a change elsewhere in the context does
not. The copy itself happens in the step's sandbox (:mod:`._copier_main`), from a
read-only mount of the context.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path

from sequester.errors import BuildError, TaskError
from sequester.imagebuild.steps import CopyStep
from sequester.tasks.context import context_matches, inside_context, is_archive, walk_context

__all__ = ["ContextSources", "context_sources"]

_READ = 1 << 20


@dataclass(frozen=True)
class ContextSources:
    root: Path  # the context's real path (mounted read-only for the copier)
    copies: tuple[str, ...]  # absolute paths inside the context mount, to copy
    archives: tuple[str, ...]  # ADD: local tar archives to extract into the destination
    digest: str  # of everything they name


def context_sources(step: CopyStep, context: Path, source: str) -> ContextSources:
    """Match and check ``step``'s sources in ``context``; :class:`BuildError` naming the
    Dockerfile line for anything Docker would refuse or we will not follow."""
    where = f"{source}:{step.line}"
    try:
        real_root = context.resolve(strict=True)
    except OSError:
        raise BuildError(f"{where}: the build context {context} does not exist") from None
    for name in (".dockerignore", f"{Path(source).name}.dockerignore"):
        if (context / name).exists():
            raise BuildError(f"{context / name}: .dockerignore is not supported (it changes which files are copied)")
    digest = hashlib.sha256()
    copies: list[str] = []
    archives: list[str] = []
    try:
        for src in step.sources:
            for path in context_matches(context, src, where):
                real = inside_context(path, real_root, where, src)
                rel = real.relative_to(real_root).as_posix()
                inner = "/" + rel if rel != "." else "/"
                if real.is_dir():
                    walk_context(real, "/", real_root, where, src)  # checks every entry
                    _digest_tree(real, real_root, digest)
                    copies.append(inner)
                elif real.is_file():
                    _digest_file(real, real_root, digest)
                    if step.add and is_archive(real) and _python_reads(real):
                        archives.append(inner)
                    else:
                        copies.append(inner)
                else:
                    raise BuildError(f"{where}: {step.text.split()[0]} source {src!r}: {path} is not a file or folder")
    except TaskError as exc:
        raise BuildError(str(exc)) from None
    return ContextSources(real_root, tuple(copies), tuple(archives), "sha256:" + digest.hexdigest())


def _python_reads(path: Path) -> bool:
    """A zstd tar is an archive Docker extracts, but the copier's Python cannot read it."""
    try:
        with tarfile.open(path, "r:*"):
            return True
    except (tarfile.TarError, OSError):
        raise BuildError(
            f"{path}: ADD of this archive is not supported (zstd-compressed tars cannot be "
            "extracted here; use a gzip or xz tar)"
        ) from None


def _entry(digest: hashlib._Hash, *fields: object) -> None:
    """One entry's header: a JSON line, so that no name or link target (a newline in it)
    can make two different contexts hash alike (attack: a shared cache key)."""
    digest.update(json.dumps(fields).encode() + b"\n")


def _digest_file(path: Path, root: Path, digest: hashlib._Hash) -> None:
    st = path.lstat()
    _entry(digest, "F", path.relative_to(root).as_posix(), stat.S_IMODE(st.st_mode), st.st_size)
    left = st.st_size  # exactly the size the header says: the content cannot run into the next header
    with open(path, "rb") as f:
        while left > 0 and (chunk := f.read(min(_READ, left))):
            digest.update(chunk)
            left -= len(chunk)
    if left:
        raise BuildError(f"{path}: the file changed while it was read")


def _digest_tree(top: Path, root: Path, digest: hashlib._Hash) -> None:
    stack = [top]
    while stack:
        folder = stack.pop()
        st = folder.lstat()
        _entry(digest, "D", folder.relative_to(root).as_posix(), stat.S_IMODE(st.st_mode))
        with os.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            path = Path(entry.path)
            mode = entry.stat(follow_symlinks=False).st_mode
            if stat.S_ISLNK(mode):
                _entry(digest, "L", path.relative_to(root).as_posix(), os.readlink(path))
            elif stat.S_ISDIR(mode):
                stack.append(path)
            else:
                _digest_file(path, root, digest)
