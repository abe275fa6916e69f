"""Remove a folder tree whatever the agent left in it: iterative, bounded, never following
a symlink, never stopping at the first thing that resists.

What this stops (each measured against ``shutil.rmtree`` / ``os.walk``):

* a chain of folders 1,000+ deep: ``shutil.rmtree`` recurses (``RecursionError``) and left
  the layers on disk, so every later job failed in ``remove_stale``; here the walk is a
  loop over a :class:`~.fdwalk.Cursor` (one descriptor open at a time, no path over
  ``PATH_MAX`` is ever built);
* folders at mode 000 or 500 (the agent's ``chmod``, overlayfs' ``work/work``): a folder
  we cannot open or empty is given ``u+rwx`` (never group or other rights) and retried;
* symlinks (to ``/``, to the host's files): unlinked, never followed; fifos, sockets and
  devices (overlay whiteouts are char 0:0) are unlinked, never opened;
* a folder with millions of entries: names are read in batches of :data:`BATCH`, so
  memory stays bounded by the batch times the depth;
* something that truly cannot go (a mount point still mounted, an immutable file): it is
  skipped, everything else is removed, and :class:`RemovalError` names what is left.

Every loop ends: each pass over a folder removes an entry or records it as failed (a
failed name is never retried), and passes per folder are capped.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from pathlib import Path

from sequester.sandbox.fdwalk import Cursor, OtherFilesystem, open_root, show_path

__all__ = ["RemovalError", "remove_tree", "remove_tree_at", "BATCH"]

BATCH = 4096  # names read from one folder before working on them
_MAX_PASSES = 100_000  # passes over one folder (BATCH names each): a writer racing us cannot keep us forever
_MAX_LISTED = 20  # leftover paths named in the error


class RemovalError(OSError):
    """Some paths could not be removed (everything else was). ``left`` names them."""

    def __init__(self, root: Path, left: list[str], count: int):
        self.root, self.left, self.count = root, left, count
        more = f" and {count - len(left)} more" if count > len(left) else ""
        super().__init__(f"could not remove everything under {root}: {'; '.join(left)}{more}")


@dataclass
class _Level:
    """A folder being emptied: sub-folders still to enter, names that resisted."""

    pending: list[str] = field(default_factory=list)
    failed: set[str] = field(default_factory=set)
    passes: int = 0


class _Remover:
    def __init__(self, root: Path, root_fd: int):
        self.root = root
        self.cursor = Cursor(root_fd, _Level())
        self.left: list[str] = []
        self.count = 0

    def fail(self, name: str, why: str) -> None:
        self.cursor.top.data.failed.add(name)
        self.count += 1
        if len(self.left) < _MAX_LISTED:
            where = show_path(self.cursor.names() + [name]).encode(errors="surrogateescape")
            self.left.append(f"{where.decode(errors='backslashreplace')!r}: {why}")

    def run(self) -> None:
        cursor = self.cursor
        while True:
            level: _Level = cursor.top.data
            if level.pending:
                self.descend(level.pending.pop())
            elif level.passes < _MAX_PASSES and self.read_batch(level):
                continue
            elif cursor.depth == 0:
                return
            else:
                name = cursor.top.name
                if not cursor.leave():  # the tree moved (nothing should be running): start the parent over
                    cursor.top.data.passes = 0
                self.remove_entry(name, is_dir=True)

    def read_batch(self, level: _Level) -> bool:
        """Unlink what is not a folder and queue up to BATCH sub-folders; False when the
        folder holds nothing but names that resisted."""
        level.passes += 1
        names = []
        fd = self.cursor.fd
        self.open_up(fd)
        try:
            with os.scandir(fd) as entries:
                for entry in entries:
                    if entry.name not in level.failed:
                        names.append(entry.name)
                        if len(names) >= BATCH:
                            break
        except OSError as exc:
            self.fail(".", f"cannot list: {exc.strerror}")
            return False
        for name in names:
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            except OSError as exc:
                self.fail(name, exc.strerror or str(exc))
                continue
            if (st.st_mode & 0o170000) == 0o040000:
                level.pending.append(name)
            else:
                self.remove_entry(name, is_dir=False)
        return bool(names)

    def descend(self, name: str) -> None:
        cursor = self.cursor
        for attempt in range(2):
            try:
                cursor.enter(name, _Level())
                return
            except OtherFilesystem:
                self.fail(name, "a mount point (still mounted)")
                return
            except PermissionError:
                if attempt == 0:
                    # mode 000 (agent chmod, overlayfs work/work): open it up for us only
                    self.chmod_child(name)
                    continue
                self.fail(name, "permission denied")
                return
            except (NotADirectoryError, OSError) as exc:
                if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                    self.remove_entry(name, is_dir=False)  # it changed into a file or symlink
                elif exc.errno != errno.ENOENT:
                    self.fail(name, exc.strerror or str(exc))
                return

    def remove_entry(self, name: str, *, is_dir: bool) -> None:
        fd = self.cursor.fd
        for attempt in range(2):
            try:
                if is_dir:
                    os.rmdir(name, dir_fd=fd)
                else:
                    os.unlink(name, dir_fd=fd)
                return
            except FileNotFoundError:
                return
            except PermissionError:
                if attempt == 0 and self.open_up(fd, force=True):
                    continue
                self.fail(name, "permission denied")
                return
            except OSError as exc:
                if exc.errno == errno.ENOTEMPTY and is_dir:
                    why = "not empty (something in it could not be removed)"
                else:
                    why = exc.strerror or str(exc)
                self.fail(name, why)
                return

    def open_up(self, fd: int, force: bool = False) -> bool:
        """Give the current folder ``u+rwx`` when it lacks it (we must list it, search it
        and unlink in it). Only the owner's bits: nothing becomes reachable by others."""
        try:
            mode = os.fstat(fd).st_mode
            if force or (mode & 0o700) != 0o700:
                os.fchmod(fd, (mode & 0o7777) | 0o700)
            return True
        except OSError:
            return False

    def chmod_child(self, name: str) -> None:
        try:
            st = os.stat(name, dir_fd=self.cursor.fd, follow_symlinks=False)
            if (st.st_mode & 0o170000) == 0o040000:  # a folder: chmod never touches a symlink's target
                os.chmod(name, (st.st_mode & 0o7777) | 0o700, dir_fd=self.cursor.fd)
        except OSError:
            pass


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Remove ``path`` and everything in it; nothing there is followed or opened but
    folders. Returns when all is gone; raises :class:`RemovalError` naming what could not be
    removed, after removing everything else. A missing path is not an error; a symlink or a
    file at ``path`` is unlinked."""
    root = Path(path)
    try:
        root_fd = open_root(root)
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP):
            os.unlink(root)
            return
        if exc.errno != errno.EACCES:
            raise
        os.chmod(root, 0o700)  # our own folder at mode 000 (a tree left by a crash)
        root_fd = open_root(root)
    remover = _Remover(root, root_fd)
    try:
        remover.run()
    finally:
        remover.cursor.close()
        os.close(root_fd)
    if remover.count:
        raise RemovalError(root, remover.left, remover.count)
    try:
        os.rmdir(root)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise RemovalError(root, [f"{str(root)!r}: {exc.strerror}"], 1) from None


def remove_tree_at(dir_fd: int, name: str) -> None:
    """:func:`remove_tree` of the folder ``name`` in the folder ``dir_fd``: no path is built
    (a tree below a path longer than ``PATH_MAX`` goes too). The entry must be a folder."""
    from sequester.sandbox.fdwalk import DIR_FLAGS

    fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    remover = _Remover(Path(name), fd)
    try:
        remover.run()
    finally:
        remover.cursor.close()
        os.close(fd)
    if remover.count:
        raise RemovalError(Path(name), remover.left, remover.count)
    os.rmdir(name, dir_fd=dir_fd)
