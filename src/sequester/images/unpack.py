"""Unpack one OCI / Docker image layer into a folder used as an overlayfs *lower* layer.

The folder is mounted by bubblewrap with ``userxattr``, so the layer's whiteouts become
what overlayfs reads there: ``.wh.NAME`` a char device 0/0 named ``NAME``,
``.wh..wh..opq`` the xattr ``user.overlay.opaque=y`` on its folder. Everything belongs to
the unpacking user (the sandbox maps it to the image's root) until the owners the layer
gives are applied through the episodes' id map (:mod:`.owners`, before the rename into
place; the list is kept beside the layer); devices are skipped (the sandbox has its own
``/dev``), and no xattr of the tar is ever copied (a layer's ``user.overlay.redirect`` or
``.opaque`` would rewrite what overlayfs shows).

One pass over the blob (its streams: :mod:`._layerstream`): it is hashed as read
(``digest``), decompressed, hashed again (``diff_id``), bounded (``max_bytes``,
``max_entries``: a decompression bomb cannot fill the disk or the memory), and parsed by
:mod:`tarfile` in stream mode; every entry is then made by hand through directory
descriptors (:mod:`._tarsafe`), never with ``tarfile.extract``, which follows links. The
tree is built in a temporary sibling of ``dest`` and renamed into place only once both
digests match: nothing half-unpacked or unverified is ever at ``dest``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import tarfile
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, cast

from sequester.errors import ImageError, SandboxError
from sequester.images._layerstream import (
    CHUNK,
    HEADER_BUDGET,
    MEDIA_TYPES,
    PROGRESS_EVERY,
    Abort,
    Blob,
    LayerStream,
    ZstdError,
    bounded_tarinfo,
    decoder_for,
)
from sequester.images._tarsafe import META, OPAQUE, WHITEOUT, Parts, Tree, split_name
from sequester.images.owners import Owners, own_layer
from sequester.sandbox.idmap import IdMap
from sequester.sandbox.idspace import remove_mapped_tree
from sequester.sandbox.rename import rename_noreplace

__all__ = [
    "UnpackStats",
    "unpack_layer",
    # re-exported from ._layerstream, still importable from here
    "CHUNK",
    "HEADER_BUDGET",
    "MEDIA_TYPES",
    "PROGRESS_EVERY",
]

log = logging.getLogger("sequester.images")

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
    owned: int = 0  # entries another owner than root's was given (:mod:`.owners`)
    unmapped_owners: int = 0  # entries owned by an id above 65,535 (left root's)


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
        view = view[os.write(fd, view) :]


class _Unpacker:
    """Makes each member in ``tree``; counts them; folder modes are applied at the end."""

    def __init__(self, tree: Tree, layer: LayerStream, max_entries: int, max_bytes: int):
        self.tree, self.layer = tree, layer
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.counts = dict.fromkeys(
            ("entries", "files", "dirs", "symlinks", "hardlinks", "whiteouts", "opaque_dirs", "devices_skipped"), 0
        )
        self.dirs: dict[Parts, tuple[int, int | None]] = {}
        self.written = 0
        self.owners = Owners()

    def run(self) -> None:
        tar = tarfile.open(
            fileobj=cast(BinaryIO, self.layer),  # a stream ("r|") only calls read()
            mode="r|",
            tarinfo=bounded_tarinfo(self.layer),
            encoding="utf-8",
            errors="surrogateescape",
        )
        while (member := tar.next()) is not None:
            # stream mode keeps every TarInfo: 2M members would be GBs (members: not in typeshed)
            tar.members.clear()  # type: ignore[attr-defined]
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
            raise Abort("truncated or malformed: the tar stream ends without an end-of-archive block")
        if block.count(0) != tarfile.BLOCKSIZE:
            raise Abort(f"truncated or malformed: invalid tar header at offset {tar.offset}")
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
            tree.whiteout(parent, base[len(WHITEOUT) :], name)
            self.counts["whiteouts"] += 1
        elif m.isreg():
            self.write_file(tar, m, parent, base, mtime)
            self.owners.note(parts, m.uid, m.gid, m.mode)
            self.counts["files"] += 1
        elif m.isdir():
            tree.make_dir(parent, base, m.mode, name)
            self.owners.note(parts, m.uid, m.gid, None)
            self.dirs[parts] = (m.mode, mtime)
            self.counts["dirs"] += 1
        elif m.issym():
            tree.symlink(parent, base, m.linkname, name)
            self.owners.note(parts, m.uid, m.gid, None)
            self.counts["symlinks"] += 1
        elif m.islnk():
            tree.hardlink(parent, base, m.linkname, name)
            self.counts["hardlinks"] += 1
        elif m.isfifo():
            tree.fifo(parent, base, m.mode, name)
            tree.set_time(parent, base, mtime, name)
            self.owners.note(parts, m.uid, m.gid, None)
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

    def write_file(self, tar: tarfile.TarFile, m: tarfile.TarInfo, parent: Parts, base: str, mtime: int | None) -> None:
        source = tar.extractfile(m)
        if source is None:  # cannot happen for a regular member; never write an empty file instead
            raise ImageError(f"member {m.name!r}: no data")
        fd = self.tree.write_file(parent, base, m.name)
        try:
            while chunk := source.read(CHUNK):
                self.written += len(chunk)
                if self.written > self.max_bytes:  # a sparse file's holes count as written
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


def unpack_layer(
    blob: Path,
    dest: Path,
    *,
    media_type: str = "",
    digest: str | None = None,
    diff_id: str | None = None,
    progress: Callable[[int], None] | None = None,
    max_entries: int = 2_000_000,
    max_bytes: int = 64 << 30,
    owners: Path | None = None,
    ids: IdMap | None = None,
) -> UnpackStats:
    """Unpack the layer file ``blob`` into the new folder ``dest`` (which must not exist).

    ``digest`` (of the blob) and ``diff_id`` (of the uncompressed tar), when given, are
    verified while streaming; the compression comes from ``media_type``, else from the
    first bytes. ``progress(n)`` gets the uncompressed bytes read since its last call.
    Raises :class:`ImageError` (naming the layer and why) for a mismatch, a truncated,
    malformed or hostile layer, or a bound exceeded; ``dest`` is then absent and no
    temporary folder is left. If ``dest`` appears meanwhile (a concurrent unpack of the
    same layer), it is kept and ours removed.

    The entries the layer gives another owner are written to ``owners`` (:mod:`.owners`)
    and given their owners through ``ids`` before ``dest`` appears.
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
    listed = tmp.with_name(tmp.name + ".owners")
    try:
        stats, found = _unpack(blob, tmp, label, media_type, digest, diff_id, progress, max_entries, max_bytes)
        found.write(listed)
        try:
            owned = own_layer(tmp, listed, ids)
        except (OSError, SandboxError, ValueError, OverflowError) as exc:
            raise ImageError(f"{label}: cannot give its files their owners: {exc}") from None
        stats = dataclasses.replace(stats, owned=owned, unmapped_owners=found.unmapped)
        if owners is not None:
            os.replace(listed, owners)  # before the folder: a layer in place always has its list
        if not rename_noreplace(tmp, dest):
            log.info("%s: %s appeared meanwhile (a concurrent unpack): keeping it", label, dest)
            remove_mapped_tree(tmp)
    except BaseException:  # KeyboardInterrupt too: never leave a half-made tree behind
        try:
            remove_mapped_tree(tmp)
        except OSError as exc:
            log.warning("%s: could not remove %s: %s", label, tmp, exc)
        raise
    finally:
        listed.unlink(missing_ok=True)
    log.info("%s: unpacked into %s (%d entries, %d bytes)", label, dest, stats.entries, stats.bytes)
    return stats


def _unpack(
    blob: Path,
    tmp: Path,
    label: str,
    media_type: str,
    digest: str | None,
    diff_id: str | None,
    progress: Callable[[int], None] | None,
    max_entries: int,
    max_bytes: int,
) -> tuple[UnpackStats, Owners]:
    try:
        f = open(blob, "rb")
    except OSError as exc:
        raise ImageError(f"{label}: cannot open {blob}: {exc}") from exc
    with f:
        raw = Blob(f, (digest or "sha256:").split(":")[0])
        layer = LayerStream(None, raw, (diff_id or "sha256:").split(":")[0], max_bytes, progress)
        tree = Tree(tmp)
        try:
            layer.decoder = decoder_for(media_type, raw)
            unpacker = _Unpacker(tree, layer, max_entries, max_bytes)
            unpacker.run()
        except Abort as exc:
            raise ImageError(f"{label}: {exc}") from None
        except ImageError as exc:
            raise ImageError(f"{label}: {exc}") from None
        except (tarfile.TarError, EOFError, zlib.error, ZstdError, RecursionError) as exc:
            raise ImageError(f"{label}: truncated or malformed: {exc}") from None
        finally:
            tree.close()
    for what, want, got in (("digest", digest, raw.hash), ("diff_id", diff_id, layer.hash)):
        if want is not None and want.split(":")[1] != got.hexdigest():
            raise ImageError(f"{label}: {what} mismatch: expected {want}, got {got.name}:{got.hexdigest()}")
    return UnpackStats(**unpacker.counts, bytes=layer.total), unpacker.owners
