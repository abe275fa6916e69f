"""The guards of :mod:`sequester.images.unpack`: member names checked, a folder tree
written only through directory file descriptors, and zstd frames followed to their end.

Every name in a layer is chosen by whoever built the image. What stops each attack:

* ``../x``, ``a/../../x``, ``/abs/../../x``: :func:`split_name` refuses any ``..``
  component (and empty, ``.`` and NUL components), so no name can point above the root;
* a symlink planted by the layer, then written *through* (``evil -> /etc``, then
  ``evil/passwd``; ``up -> ..``, then ``up/x``): :class:`Tree` reaches every parent folder
  by ``openat(O_DIRECTORY | O_NOFOLLOW)`` one component at a time from the root's
  descriptor, so the kernel itself refuses to cross a symlink; such a member is refused;
* a symlink (or anything else) already at a member's name: it is unlinked first and the
  file is made with ``O_CREAT | O_EXCL | O_NOFOLLOW``, so a write never lands on another
  inode;
* a hard link to ``/etc/passwd`` or ``../../x``: its target is a name *inside* this layer,
  checked like any other, reached the same way and required to be a regular file;
* a whiteout named ``.wh...`` or ``.wh..`` (would remove the parent folder, the root's
  parent at the top): the whited-out name may not be empty, ``.`` or ``..``;
* a zstd layer cut short (python-zstandard's readers end quietly mid-frame, so a cut
  layer would pass for a shorter one): :class:`ZstdFrames` requires the whole last frame.

Nothing else writes in the temporary root while we work (it is ours, mode 0700 until the
end), so a folder reached once stays what it was: that is what lets :class:`Tree` cache the
last parent descriptor.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from sequester.errors import ImageError
from sequester.sandbox.remove import remove_tree

__all__ = ["split_name", "show", "Tree", "ZstdFrames", "FrameError", "DIR_FLAGS", "WHITEOUT", "OPAQUE", "META"]

# O_NONBLOCK: a fifo is refused by O_DIRECTORY before any open, but never risk blocking.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
META = ".wh..wh."  # aufs bookkeeping (.wh..wh.plnk, .wh..wh.aufs): never image content
OPAQUE_XATTR = "user.overlay.opaque"  # what overlayfs mounted with userxattr reads

Parts = tuple[str, ...]


def split_name(name: str, *, allow_root: bool = False) -> Parts:
    """The components of a member name, ``()`` for the root entry (only if ``allow_root``).

    Leading ``/`` and ``./`` are dropped (layers are relative to their root whatever they
    say); then a ``..`` component (escapes the root), an empty or ``.`` component (a name
    that is a path trick, ``a//b``, ``a/./b``) or a NUL (C strings would cut it) refuses
    the whole layer: fail closed, nothing is guessed.
    """
    rest = name
    while True:
        if rest.startswith("/"):
            rest = rest[1:]
        elif rest.startswith("./"):
            rest = rest[2:]
        else:
            break
    if rest in ("", ".") and name.strip("/"):
        if allow_root:
            return ()
        raise ImageError(f"member {name!r}: names the layer's root")
    parts = tuple(rest.split("/"))
    for part in parts:
        if part in ("", ".", "..") or "\x00" in part:
            raise ImageError(f"member {name!r}: {part!r} is not an allowed name component")
    return parts


def show(parts: Parts) -> str:
    return "/".join(parts) or "."


class Tree:
    """A folder being filled, reached only through descriptors from its root's."""

    def __init__(self, root: Path):
        self.root = root
        self.root_fd = os.open(root, DIR_FLAGS)
        self._cached: Parts = ()  # the last parent reached, and its descriptor
        self._cached_fd = self.root_fd

    def close(self) -> None:
        self._forget()
        os.close(self.root_fd)

    def _forget(self) -> None:
        if self._cached_fd != self.root_fd:
            os.close(self._cached_fd)
        self._cached, self._cached_fd = (), self.root_fd

    def folder(self, parts: Parts, member: str, *, create: bool = True) -> int:
        """The descriptor of folder ``parts`` (owned by the tree: do not close it), made
        with mode 0755 where missing. A component that is a symlink or not a folder refuses
        the member: this is the guard against writing through a link the layer planted."""
        if parts == self._cached:
            return self._cached_fd
        if parts[: len(self._cached)] == self._cached:
            fd, done = self._cached_fd, len(self._cached)  # go on from the cached folder
        else:
            fd, done = self.root_fd, 0
        try:
            for i in range(done, len(parts)):
                nxt = self._step(fd, parts[i], parts[: i + 1], member, create)
                if fd not in (self.root_fd, self._cached_fd):
                    os.close(fd)
                fd = nxt
        except BaseException:
            if fd not in (self.root_fd, self._cached_fd):
                os.close(fd)
            raise
        if fd != self._cached_fd:
            self._forget()
        self._cached, self._cached_fd = parts, fd
        return fd

    def _step(self, dfd: int, name: str, parts: Parts, member: str, create: bool) -> int:
        made = False
        while True:
            try:
                fd = os.open(name, DIR_FLAGS, dir_fd=dfd)
                break
            except FileNotFoundError:
                if not create or made:
                    raise
                try:
                    os.mkdir(name, 0o700, dir_fd=dfd)
                except FileExistsError:
                    pass
                made = True
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
                raise ImageError(f"member {member!r}: parent {show(parts)} is {what}") from None
        if made:
            os.fchmod(fd, 0o755)  # a folder the layer never listed: what tar and Docker make
        return fd

    def replace(self, parent: Parts, name: str, member: str) -> int:
        """Remove what this layer put at ``parent/name`` before (a later member replaces
        it) and return the parent's descriptor, ready for the new entry."""
        dfd = self.folder(parent, member)
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return dfd
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=dfd)  # unlink never follows: a symlink goes, not its target
            return dfd
        # A folder with children: removed through the descriptor's /proc name, which the
        # kernel resolves to this very folder (no path component is looked up again).
        proc = Path(f"/proc/self/fd/{dfd}")
        remove_tree(proc / name if proc.exists() else Path(self.root, *parent, name))
        return dfd  # still valid: the cache holds ``parent``, which was not removed

    def make_dir(self, parent: Parts, name: str, mode: int, member: str) -> None:
        """An existing folder is reused; anything else there is replaced. Owner rwx is
        kept while unpacking (a 0555 folder must not refuse its own children); the final
        mode comes with :meth:`finish_dir`."""
        dfd = self.folder(parent, member)
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                os.unlink(name, dir_fd=dfd)
                raise FileNotFoundError
        except FileNotFoundError:
            os.mkdir(name, 0o700, dir_fd=dfd)
        fd = os.open(name, DIR_FLAGS, dir_fd=dfd)
        try:
            os.fchmod(fd, (mode & 0o7777) | 0o700)
        finally:
            os.close(fd)

    def write_file(self, parent: Parts, name: str, member: str) -> int:
        """A new, empty regular file (the caller writes, chmods and closes the descriptor)."""
        return os.open(name, FILE_FLAGS, 0o600, dir_fd=self.replace(parent, name, member))

    def symlink(self, parent: Parts, name: str, target: str, member: str) -> None:
        """Any target, as it is: it is only ever resolved inside the sandbox's root."""
        if "\x00" in target:
            raise ImageError(f"member {member!r}: symbolic link target has a NUL")
        os.symlink(target, name, dir_fd=self.replace(parent, name, member))

    def hardlink(self, parent: Parts, name: str, target: str, member: str) -> None:
        """A second name for a regular file this layer already holds. The target is a
        layer name (``/etc/passwd`` means the layer's ``etc/passwd``), reached without
        following links: a link can never reach a host file or one outside the root."""
        try:
            tparts = split_name(target)
        except ImageError as exc:
            raise ImageError(f"member {member!r}: hard link target: {exc}") from None
        if tparts == (*parent, name):
            raise ImageError(f"member {member!r}: hard link to itself")
        try:
            tfd = os.dup(self.folder(tparts[:-1], member, create=False))
        except FileNotFoundError:
            raise ImageError(f"member {member!r}: hard link target {target!r} is not in this layer") from None
        try:
            try:
                st = os.stat(tparts[-1], dir_fd=tfd, follow_symlinks=False)
            except FileNotFoundError:
                raise ImageError(f"member {member!r}: hard link target {target!r} is not in this layer") from None
            if not stat.S_ISREG(st.st_mode):  # a symlink, folder or device: never linked
                raise ImageError(f"member {member!r}: hard link target {target!r} is not a regular file")
            dfd = self.replace(parent, name, member)
            os.link(tparts[-1], name, src_dir_fd=tfd, dst_dir_fd=dfd, follow_symlinks=False)
        finally:
            os.close(tfd)

    def fifo(self, parent: Parts, name: str, mode: int, member: str) -> None:
        dfd = self.replace(parent, name, member)
        os.mkfifo(name, 0o600, dir_fd=dfd)
        # chmod by name follows a symlink, but this name is the fifo we just made in a
        # folder only we write to; fchmodat(AT_SYMLINK_NOFOLLOW) is unsupported on Linux.
        os.chmod(name, mode & 0o7777, dir_fd=dfd)

    def whiteout(self, parent: Parts, name: str, member: str) -> None:
        """Char device 0/0: overlayfs hides ``name`` of the layers below. An unprivileged
        user may make exactly this device (Linux >= 5.8)."""
        if name in ("", ".", ".."):  # ".wh..." names "..": replacing it would remove the parent
            raise ImageError(f"member {member!r}: whiteout of {name!r}")
        os.mknod(name, stat.S_IFCHR, os.makedev(0, 0), dir_fd=self.replace(parent, name, member))

    def opaque(self, folder: Parts, member: str) -> None:
        """overlayfs shows nothing of the layers below in this folder."""
        os.setxattr(self.folder(folder, member), OPAQUE_XATTR, b"y")

    def set_time(self, parent: Parts, name: str, mtime_ns: int | None, member: str) -> None:
        if mtime_ns is not None:
            os.utime(name, ns=(mtime_ns, mtime_ns), dir_fd=self.folder(parent, member), follow_symlinks=False)

    def finish_dir(self, parts: Parts, mode: int, mtime_ns: int | None) -> None:
        """Final mode and mtime of a folder, once nothing more is written in it (callers
        go deepest first, so every folder walked through still has owner rwx). A folder
        replaced later in the layer (now a file or symlink) is skipped: never chmod
        through a link."""
        try:
            if parts:
                dfd = self.folder(parts[:-1], show(parts), create=False)
                fd = os.open(parts[-1], DIR_FLAGS, dir_fd=dfd)
            else:
                fd = os.dup(self.root_fd)
        except ImageError:
            return
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                return
            raise
        try:
            os.fchmod(fd, mode & 0o7777)
            if mtime_ns is not None:
                os.utime(fd, ns=(mtime_ns, mtime_ns))
        finally:
            os.close(fd)


class FrameError(ValueError):
    """The bytes are not whole zstd frames."""


class ZstdFrames:
    """Follows zstd frame boundaries (RFC 8878) in the compressed bytes.

    python-zstandard's readers end quietly when the input stops inside a frame, so a
    truncated layer would pass for a shorter one; a whole stream ends exactly at the end
    of a frame. Only headers are parsed, block contents are skipped: cheap."""

    def __init__(self) -> None:
        self.frames = 0
        self._state, self._need, self._skip, self._checksum = "magic", 4, 0, False
        self._buf = bytearray()

    @property
    def complete(self) -> bool:
        return self.frames > 0 and self._state == "magic" and not self._buf and not self._skip

    def feed(self, data: bytes) -> None:
        view, i = memoryview(data), 0
        while i < len(view):
            if self._skip:
                k = min(self._skip, len(view) - i)
                self._skip, i = self._skip - k, i + k
                continue
            k = min(self._need - len(self._buf), len(view) - i)
            self._buf += view[i : i + k]
            i += k
            if len(self._buf) == self._need:
                field = bytes(self._buf)
                self._buf.clear()
                self._advance(field)

    def _go(self, state: str, need: int) -> None:
        self._state, self._need = state, need

    def _advance(self, b: bytes) -> None:
        value = int.from_bytes(b, "little")
        if self._state == "magic":
            if value == 0xFD2FB528:
                self._go("descriptor", 1)
            elif value & 0xFFFFFFF0 == 0x184D2A50:
                self._go("skippable", 4)
            else:
                raise FrameError("not a zstd frame")
        elif self._state == "descriptor":
            if value & 0x08:
                raise FrameError("zstd frame header reserved bit set")
            single = (value >> 5) & 1
            self._checksum = bool(value & 0x04)
            size = (1 - single) + (0, 1, 2, 4)[value & 3] + (single, 2, 4, 8)[value >> 6]
            self._go("header", size) if size else self._go("block", 3)
        elif self._state == "header":
            self._go("block", 3)
        elif self._state == "block":
            kind = (value >> 1) & 3
            if kind == 3:
                raise FrameError("reserved zstd block type")
            self._skip = 1 if kind == 1 else value >> 3  # RLE blocks hold one byte
            if not value & 1:
                self._go("block", 3)
            elif self._checksum:
                self._go("checksum", 4)
            else:
                self.frames += 1
                self._go("magic", 4)
        elif self._state == "checksum":
            self.frames += 1
            self._go("magic", 4)
        else:  # skippable: its length, then its bytes
            self._skip = value
            self._go("magic", 4)
