"""Walk a folder tree the agent wrote, by directory file descriptors, with no recursion.

The episode's layers are host folders whose every byte the agent chose. Walking them with
paths or recursion fails on what an agent can make at no cost: a chain 10,000 folders deep
(absolute paths over ``PATH_MAX``; Python's recursion limit in ``os.walk`` users and
``shutil.rmtree``), symlinks pointing out of the tree, fifos that block an ``open``.
:class:`Cursor` stands in one folder at a time and moves by ``openat``:

* one folder descriptor is open at a time (plus the root's), whatever the depth, so a deep
  tree cannot exhaust the process's descriptors;
* every ``openat`` has ``O_DIRECTORY | O_NOFOLLOW``: a symlink (out of the tree or anywhere)
  is never entered, and a fifo or device is never opened (``O_DIRECTORY`` refuses it before
  any open happens);
* a folder on another filesystem (a mount point) is never entered (:class:`OtherFilesystem`);
* going back up opens ``..`` and checks that it is the folder we came from (device and
  inode): if the agent moved folders while we walk, we re-walk from the root by name,
  checking each step, and stop at the deepest ancestor that is still where it was, so a
  moved folder can never lead the walk out of the tree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

__all__ = ["Cursor", "Frame", "OtherFilesystem", "DIR_FLAGS", "open_root", "show_path"]

# O_NONBLOCK: belt and braces for O_DIRECTORY (a fifo is refused with ENOTDIR anyway).
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class OtherFilesystem(OSError):
    """The folder is a mount point (another device): we do not walk into it."""


@dataclass
class Frame:
    """One folder on the way from the root to where the cursor stands; ``data`` is the
    walker's own state for that folder."""

    name: str
    dev: int
    ino: int
    data: Any = None


def open_root(path: str | os.PathLike[str]) -> int:
    """Open a trusted host folder (ours, e.g. the state folder) as the root of a walk; its
    last component must not be a symlink."""
    return os.open(path, DIR_FLAGS)


class Cursor:
    """Stands in one folder of a tree; ``frames[0]`` is the root, ``frames[-1]`` the
    folder whose descriptor is :attr:`fd`. The caller owns ``root_fd`` and closes it after
    :meth:`close`."""

    def __init__(self, root_fd: int, data: Any = None):
        st = os.fstat(root_fd)
        self._root_fd = root_fd
        self.fd = root_fd
        self.dev = st.st_dev
        self.frames: list[Frame] = [Frame("", st.st_dev, st.st_ino, data)]
        self.rewalks = 0  # how often the tree moved under us (a running agent renaming)

    @property
    def top(self) -> Frame:
        return self.frames[-1]

    @property
    def depth(self) -> int:
        return len(self.frames) - 1

    def names(self) -> list[str]:
        """The names from the root (excluded) to the current folder."""
        return [f.name for f in self.frames[1:]]

    def enter(self, name: str, data: Any = None) -> os.stat_result:
        """Move into the sub-folder ``name``. Raises :class:`OSError` (``ENOTDIR`` or
        ``ELOOP`` for anything that is not a real folder, ``EACCES`` when unreadable) or
        :class:`OtherFilesystem`; the cursor then stays where it was."""
        fd = os.open(name, DIR_FLAGS, dir_fd=self.fd)
        try:
            st = os.fstat(fd)
            if st.st_dev != self.dev:
                raise OtherFilesystem(f"{name!r} is a mount point")
        except BaseException:
            os.close(fd)
            raise
        self._replace(fd)
        self.frames.append(Frame(name, st.st_dev, st.st_ino, data))
        return st

    def leave(self) -> bool:
        """Move to the parent folder. True when the parent is the one we came from; False
        when the tree moved: the cursor then stands at the deepest ancestor it could
        reach again by name from the root (``frames`` is cut to it)."""
        if len(self.frames) == 1:
            raise ValueError("the cursor is at the root")
        self.frames.pop()
        if len(self.frames) == 1:
            self._replace(self._root_fd)
            return True
        want = self.frames[-1]
        try:
            fd = os.open("..", DIR_FLAGS, dir_fd=self.fd)
        except OSError:
            fd = -1
        if fd >= 0:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) == (want.dev, want.ino):
                self._replace(fd)
                return True
            os.close(fd)
        return self._rewalk()

    def _rewalk(self) -> bool:
        """Walk from the root again by name, checking each folder is the one recorded."""
        self.rewalks += 1
        self._replace(self._root_fd)
        kept = 1
        for frame in self.frames[1:]:
            try:
                fd = os.open(frame.name, DIR_FLAGS, dir_fd=self.fd)
            except OSError:
                break
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (frame.dev, frame.ino):
                os.close(fd)
                break
            self._replace(fd)
            kept += 1
        complete = kept == len(self.frames)
        del self.frames[kept:]
        return complete

    def _replace(self, fd: int) -> None:
        if self.fd != self._root_fd and self.fd != fd:
            os.close(self.fd)
        self.fd = fd

    def close(self) -> None:
        self._replace(self._root_fd)


def show_path(parts: list[str], limit: int = 240) -> str:
    """A path for a message: joined, and its middle elided when it is very long (a deep
    chain would make one message megabytes long)."""
    text = "/".join(parts)
    if len(text) <= limit:
        return text
    return f"{text[: limit // 2]}/...[{len(parts)} levels]/{text[-limit // 2 :]}"
