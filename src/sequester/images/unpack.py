"""Unpack one OCI / Docker image layer into a folder used as an overlayfs *lower* layer.

The folder is mounted by bubblewrap with ``userxattr``, so the layer's whiteouts become
what overlayfs reads there: ``.wh.NAME`` a char device 0/0 named ``NAME``,
``.wh..wh..opq`` the xattr ``user.overlay.opaque=y`` on its folder. Everything belongs to
the unpacking user (the sandbox maps it to the image's root): nothing is chowned, devices
are skipped (the sandbox has its own ``/dev``), and no xattr of the tar is ever copied (a
layer's ``user.overlay.redirect`` or ``.opaque`` would rewrite what overlayfs shows).

One pass over the blob: it is hashed as read (``digest``), decompressed, hashed again
(``diff_id``), bounded (``max_bytes``, ``max_entries``: a decompression bomb cannot fill the
disk or the memory), and parsed by :mod:`tarfile` in stream mode; every entry is then
made by hand through directory descriptors (:mod:`._tarsafe`), never with
``tarfile.extract``, which follows links. The tree is built in a temporary sibling of
``dest`` and renamed into place only once both digests match: nothing half-unpacked or
unverified is ever at ``dest``.
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import os
import re
import tarfile
import tempfile
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import zstandard

    _ZstdError: type[Exception] = zstandard.ZstdError
except ImportError:  # only zstd layers need it: a Python without it still runs host-mode episodes
    zstandard = None

    class _ZstdError(Exception):  # type: ignore[no-redef]
        pass

from ..episodes.remove import remove_tree
from ..errors import ImageError
from ._tarsafe import META, OPAQUE, WHITEOUT, FrameError, Parts, Tree, ZstdFrames, rename_noreplace, split_name

__all__ = ["UnpackStats", "unpack_layer"]

log = logging.getLogger("sequester.images")

MEDIA_TYPES = {  # the layer media types of OCI and Docker, and their compression
    "application/vnd.oci.image.layer.v1.tar": "tar",
    "application/vnd.oci.image.layer.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd": "zstd",
    "application/vnd.oci.image.layer.nondistributable.v1.tar": "tar",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd": "zstd",
    "application/vnd.docker.image.rootfs.diff.tar.gzip": "gzip",
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip": "gzip",
}
CHUNK = 1 << 20            # bytes per read of a member's data and of the drained tail
PROGRESS_EVERY = 1 << 20   # progress() is called at most once per this many bytes
# Headers of one member (PAX records, GNU long names, sparse maps) are held in memory by
# tarfile whole: a 10 GiB PAX header of zeros is a 10 MiB gzip. Go's archive/tar allows 1 MiB.
HEADER_BUDGET = 4 << 20
_TAIL = 64 << 10           # decompressed bytes kept to check the end-of-archive block
_DIGEST = re.compile(r"(sha256:[0-9a-f]{64}|sha384:[0-9a-f]{96}|sha512:[0-9a-f]{128})")


@dataclass(frozen=True)
class UnpackStats:
    """What a layer held. ``entries`` counts every tar member (the root entry and skipped
    aufs bookkeeping included); ``files`` counts regular files and fifos; ``bytes`` is
    the uncompressed tar bytes read."""

    entries: int
    files: int
    dirs: int
    symlinks: int
    hardlinks: int
    whiteouts: int
    opaque_dirs: int
    devices_skipped: int
    bytes: int


class _Abort(Exception):
    """Raised from inside tarfile's reads. Deliberately not an OSError or ValueError:
    tarfile turns some of those into a quiet "end of archive", which would accept a
    truncated or bounded-out layer as a shorter one."""


class _Blob:
    """The layer file as read: every byte hashed once (the ``digest``)."""

    def __init__(self, f: Any, algorithm: str):
        self.f, self.hash = f, hashlib.new(algorithm)
        self.head = b""
        self.frames: ZstdFrames | None = None

    def peek(self, n: int) -> bytes:
        self.head = self.read(n)
        return self.head

    def read(self, n: int | None = -1) -> bytes:
        if self.head:
            data, self.head = (self.head, b"") if n is None or n < 0 else (self.head[:n], self.head[n:])
            return data
        try:
            data = self.f.read(n)
        except OSError as exc:
            raise _Abort(f"cannot read the blob: {exc}") from exc
        self.hash.update(data)
        if self.frames is not None:
            try:
                self.frames.feed(data)
            except FrameError as exc:
                raise _Abort(f"truncated or malformed: {exc}") from None
        return data


class _Layer:
    """The uncompressed tar stream, as tarfile reads it: hashed (``diff_id``), counted
    against ``max_bytes``, reported to ``progress``, its last bytes kept."""

    def __init__(self, decoder: Any, blob: _Blob, algorithm: str, max_bytes: int,
                 progress: Callable[[int], None] | None):
        self.decoder, self.blob, self.hash = decoder, blob, hashlib.new(algorithm)
        self.max_bytes, self.progress = max_bytes, progress
        self.total = self._unreported = 0
        self.header_limit: int | None = None   # set while tarfile parses one member's headers
        self._tail: deque[bytes] = deque()
        self._tail_len = 0

    def read(self, n: int | None = -1) -> bytes:
        n = CHUNK if n is None or n < 0 else n
        try:
            data = self.decoder.read(n)
        except (EOFError, OSError, zlib.error, _ZstdError) as exc:  # BadGzipFile is an OSError
            raise _Abort(f"truncated or malformed: {exc}") from exc
        self.total += len(data)
        if self.total > self.max_bytes:
            raise _Abort(f"more than max_bytes={self.max_bytes} uncompressed bytes")
        if self.header_limit is not None and self.total > self.header_limit:
            raise _Abort(f"truncated or malformed: a member's headers exceed {HEADER_BUDGET} bytes")
        self.hash.update(data)
        self._tail.append(data)
        self._tail_len += len(data)
        while self._tail_len - len(self._tail[0]) >= _TAIL:
            self._tail_len -= len(self._tail.popleft())
        self._unreported += len(data)
        if self.progress is not None and self._unreported >= PROGRESS_EVERY:
            self._report()
        return data

    def _report(self) -> None:
        if self.progress is not None and self._unreported:
            n, self._unreported = self._unreported, 0
            self.progress(n)

    def block_at(self, offset: int) -> bytes | None:
        """The (up to) 512 bytes at ``offset`` if still kept."""
        start = self.total - self._tail_len
        if offset < start:
            return None
        return b"".join(self._tail)[offset - start:offset - start + tarfile.BLOCKSIZE]

    def finish(self) -> None:
        """Read to the end of both streams, so the digests cover every byte."""
        while self.read(CHUNK):
            pass
        frames = self.blob.frames
        if frames is not None and not frames.complete:
            raise _Abort("truncated or malformed: the zstd stream ends inside a frame")
        while self.blob.read(CHUNK):   # bytes after the compressed stream are hashed too
            pass
        self._report()


def _bounded_tarinfo(layer: _Layer) -> type[tarfile.TarInfo]:
    """A TarInfo whose header parsing may read at most HEADER_BUDGET bytes per member."""

    class BoundedTarInfo(tarfile.TarInfo):
        __slots__ = ()

        @classmethod
        def fromtarfile(cls, tar: tarfile.TarFile) -> tarfile.TarInfo:
            outer = layer.header_limit is None   # PAX and long-name headers recurse into here
            if outer:
                layer.header_limit = layer.total + HEADER_BUDGET
            try:
                return super().fromtarfile(tar)
            finally:
                if outer:
                    layer.header_limit = None

    return BoundedTarInfo


def _mtime_ns(member: tarfile.TarInfo) -> int | None:
    """The member's mtime in ns, or None when it cannot be set (absurd or malformed)."""
    try:
        mtime = member.mtime
        ns = mtime * 1_000_000_000 if isinstance(mtime, int) else int(mtime * 1_000_000_000)
    except (TypeError, ValueError, OverflowError):
        return None
    return ns if -(1 << 63) <= ns < (1 << 63) else None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class _Unpacker:
    """Makes each member in ``tree``; counts them; folder modes are applied at the end."""

    def __init__(self, tree: Tree, layer: _Layer, max_entries: int, max_bytes: int):
        self.tree, self.layer = tree, layer
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.counts = dict.fromkeys(("entries", "files", "dirs", "symlinks", "hardlinks",
                                     "whiteouts", "opaque_dirs", "devices_skipped"), 0)
        self.dirs: dict[Parts, tuple[int, int | None]] = {}
        self.written = 0

    def run(self) -> None:
        tar = tarfile.open(fileobj=self.layer, mode="r|", tarinfo=_bounded_tarinfo(self.layer),
                           encoding="utf-8", errors="surrogateescape")
        while (member := tar.next()) is not None:
            tar.members.clear()   # stream mode keeps every TarInfo: 2M members would be GBs
            self.counts["entries"] += 1
            if self.counts["entries"] > self.max_entries:
                raise ImageError(f"more than max_entries={self.max_entries} members")
            try:
                self.member(tar, member)
            except ImageError:
                raise
            except OSError as exc:
                raise ImageError(f"member {member.name!r}: {exc.strerror or exc}") from exc
        # tarfile also stops quietly at a missing or garbled header; only a zero block is an end.
        block = self.layer.block_at(tar.offset)
        if block is None or len(block) < tarfile.BLOCKSIZE:
            raise _Abort("truncated or malformed: the tar stream ends without an end-of-archive block")
        if block.count(0) != tarfile.BLOCKSIZE:
            raise _Abort(f"truncated or malformed: invalid tar header at offset {tar.offset}")
        self.layer.finish()
        self.dirs.setdefault((), (0o755, None))
        for parts in sorted(self.dirs, key=lambda p: (-len(p), p)):  # deepest first
            self.tree.finish_dir(parts, *self.dirs[parts])

    def member(self, tar: tarfile.TarFile, m: tarfile.TarInfo) -> None:
        parts = split_name(m.name, allow_root=True)
        mtime, tree, name = _mtime_ns(m), self.tree, m.name
        if not parts:
            if not m.isdir():
                raise ImageError(f"member {name!r}: the layer's root is not a directory")
            self.dirs[()] = (m.mode, mtime)
            self.counts["dirs"] += 1
            return
        parent, base = parts[:-1], parts[-1]
        if base == OPAQUE and not any(p.startswith(WHITEOUT) for p in parent):
            tree.opaque(parent, name)
            self.counts["opaque_dirs"] += 1
        elif any(p.startswith(META) for p in parts):
            log.debug("member %r: aufs bookkeeping, skipped", name)
        elif any(p.startswith(WHITEOUT) for p in parent):
            raise ImageError(f"member {name!r}: a whiteout used as a folder")
        elif base.startswith(WHITEOUT):
            tree.whiteout(parent, base[len(WHITEOUT):], name)
            self.counts["whiteouts"] += 1
        elif m.isreg():
            self.write_file(tar, m, parent, base, mtime)
            self.counts["files"] += 1
        elif m.isdir():
            tree.make_dir(parent, base, m.mode, name)
            self.dirs[parts] = (m.mode, mtime)
            self.counts["dirs"] += 1
        elif m.issym():
            tree.symlink(parent, base, m.linkname, name)
            self.counts["symlinks"] += 1
        elif m.islnk():
            tree.hardlink(parent, base, m.linkname, name)
            self.counts["hardlinks"] += 1
        elif m.isfifo():
            tree.fifo(parent, base, m.mode, name)
            tree.set_time(parent, base, mtime, name)
            self.counts["files"] += 1
        elif m.ischr() and m.devmajor == 0 and m.devminor == 0:  # a whiteout, overlayfs style
            tree.whiteout(parent, base, name)
            self.counts["whiteouts"] += 1
        elif m.ischr() or m.isblk():
            # Never made, even as root: a device node in a lower layer would hand the
            # sandbox a host device (a disk, /dev/mem); the sandbox has its own /dev.
            log.debug("member %r: device %d:%d skipped", name, m.devmajor, m.devminor)
            self.counts["devices_skipped"] += 1
        else:
            raise ImageError(f"member {name!r}: unsupported tar entry type {m.type!r}")

    def write_file(self, tar: tarfile.TarFile, m: tarfile.TarInfo, parent: Parts, base: str,
                   mtime: int | None) -> None:
        source = tar.extractfile(m)
        if source is None:  # cannot happen for a regular member; never write an empty file instead
            raise ImageError(f"member {m.name!r}: no data")
        fd = self.tree.write_file(parent, base, m.name)
        try:
            while chunk := source.read(CHUNK):
                self.written += len(chunk)
                if self.written > self.max_bytes:   # a sparse file's holes count as written
                    raise ImageError(f"member {m.name!r}: more than max_bytes={self.max_bytes} bytes written")
                _write_all(fd, chunk)
            # After the writes: a write by a non-root user clears setuid/setgid bits.
            os.fchmod(fd, m.mode & 0o7777)
            if mtime is not None:
                os.utime(fd, ns=(mtime, mtime))
        finally:
            os.close(fd)


def _check_digest(value: str | None, what: str) -> None:
    if value is not None and not _DIGEST.fullmatch(value):
        raise ImageError(f"{what} {value!r} is not sha256:<64 hex digits> (or sha384/sha512)")


def _decoder(media_type: str, blob: _Blob) -> Any:
    compression = MEDIA_TYPES.get(media_type.split(";")[0].strip().lower())
    if compression is None:  # empty or unknown: the first bytes tell
        head = blob.peek(4)
        compression = "gzip" if head[:2] == b"\x1f\x8b" else "zstd" if head == b"\x28\xb5\x2f\xfd" else "tar"
        log.debug("layer media type %r: %s, from its first bytes", media_type, compression)
    if compression == "gzip":
        return gzip.GzipFile(fileobj=blob, mode="rb")  # multi-member; CRC and length checked
    if compression == "zstd":
        if zstandard is None:
            raise ImageError("a zstd-compressed layer needs the zstandard package (pip install zstandard)")
        blob.frames = ZstdFrames()
        blob.frames.feed(blob.head)
        # The default window limit (128 MiB) bounds the decoder's memory whatever a frame asks.
        return zstandard.ZstdDecompressor().stream_reader(blob, read_across_frames=True, closefd=False)
    return blob


def unpack_layer(blob: Path, dest: Path, *, media_type: str = "", digest: str | None = None,
                 diff_id: str | None = None, progress: Callable[[int], None] | None = None,
                 max_entries: int = 2_000_000, max_bytes: int = 64 << 30) -> UnpackStats:
    """Unpack the layer file ``blob`` into the new folder ``dest`` (which must not exist).

    ``digest`` (of the blob) and ``diff_id`` (of the uncompressed tar), when given, are
    verified while streaming; the compression comes from ``media_type``, else from the
    first bytes. ``progress(n)`` gets the uncompressed bytes read since its last call.
    Raises :class:`ImageError` (naming the layer and why) for a mismatch, a truncated,
    malformed or hostile layer, or a bound exceeded; ``dest`` is then absent and no
    temporary folder is left. If ``dest`` appears meanwhile (a concurrent unpack of the
    same layer), it is kept and ours removed.
    """
    blob, dest = Path(blob), Path(dest)
    label = f"layer {digest or diff_id or blob.name}"
    _check_digest(digest, f"{label}: digest")
    _check_digest(diff_id, f"{label}: diff_id")
    if os.path.lexists(dest):
        raise ImageError(f"{label}: {dest} already exists")
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{dest.name}-", dir=dest.parent))
    except OSError as exc:
        raise ImageError(f"{label}: cannot make a folder next to {dest}: {exc}") from exc
    try:
        stats = _unpack(blob, tmp, label, media_type, digest, diff_id, progress, max_entries, max_bytes)
        if not rename_noreplace(tmp, dest):
            log.info("%s: %s appeared meanwhile (a concurrent unpack): keeping it", label, dest)
            remove_tree(tmp)
    except BaseException:   # KeyboardInterrupt too: never leave a half-made tree behind
        try:
            remove_tree(tmp)
        except OSError as exc:
            log.warning("%s: could not remove %s: %s", label, tmp, exc)
        raise
    log.info("%s: unpacked into %s (%d entries, %d bytes)", label, dest, stats.entries, stats.bytes)
    return stats


def _unpack(blob: Path, tmp: Path, label: str, media_type: str, digest: str | None,
            diff_id: str | None, progress: Callable[[int], None] | None, max_entries: int,
            max_bytes: int) -> UnpackStats:
    try:
        f = open(blob, "rb")
    except OSError as exc:
        raise ImageError(f"{label}: cannot open {blob}: {exc}") from exc
    with f:
        raw = _Blob(f, (digest or "sha256:").split(":")[0])
        layer = _Layer(None, raw, (diff_id or "sha256:").split(":")[0], max_bytes, progress)
        tree = Tree(tmp)
        try:
            layer.decoder = _decoder(media_type, raw)
            unpacker = _Unpacker(tree, layer, max_entries, max_bytes)
            unpacker.run()
        except _Abort as exc:
            raise ImageError(f"{label}: {exc}") from None
        except ImageError as exc:
            raise ImageError(f"{label}: {exc}") from None
        except (tarfile.TarError, EOFError, zlib.error, _ZstdError, RecursionError) as exc:
            raise ImageError(f"{label}: truncated or malformed: {exc}") from None
        finally:
            tree.close()
    for what, want, got in (("digest", digest, raw.hash), ("diff_id", diff_id, layer.hash)):
        if want is not None and want.split(":")[1] != got.hexdigest():
            raise ImageError(f"{label}: {what} mismatch: expected {want}, got {got.name}:{got.hexdigest()}")
    return UnpackStats(**unpacker.counts, bytes=layer.total)
