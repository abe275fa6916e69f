"""The byte streams of a layer being unpacked (for :mod:`.unpack`): read once, hashed, bounded.

The layer file (:class:`Blob`) is hashed as read (the ``digest``); its decompression
(:func:`decoder_for`: gzip, zstd, or none, from the media type or the first bytes) is
read as :class:`LayerStream`, hashed again (the ``diff_id``), counted against
``max_bytes``, reported to ``progress``, and its last bytes kept to check the tar's end.
Kept apart from the member handling of :mod:`.unpack`: nothing here knows what a tar
member is, except the per-member header budget (:func:`bounded_tarinfo`), which is a
bound on bytes read. Errors inside tarfile's reads are :class:`Abort`.
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import tarfile
import zlib
from collections import deque
from collections.abc import Callable
from typing import Any, BinaryIO, cast

try:
    import zstandard

    ZstdError: type[Exception] = zstandard.ZstdError
except ImportError:  # only zstd layers need it: a Python without it still runs host-mode episodes
    zstandard = None  # type: ignore[assignment]  # an optional module: mypy cannot type module-or-None

    class ZstdError(Exception):  # type: ignore[no-redef]
        pass


from sequester.errors import ImageError
from sequester.images._tarsafe import FrameError, ZstdFrames

__all__ = [
    "Abort",
    "Blob",
    "CHUNK",
    "HEADER_BUDGET",
    "LayerStream",
    "MEDIA_TYPES",
    "PROGRESS_EVERY",
    "ZstdError",
    "bounded_tarinfo",
    "decoder_for",
]

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
CHUNK = 1 << 20  # bytes per read of a member's data and of the drained tail
PROGRESS_EVERY = 1 << 20  # progress() is called at most once per this many bytes
# Headers of one member (PAX records, GNU long names, sparse maps) are held in memory by
# tarfile whole: a 10 GiB PAX header of zeros is a 10 MiB gzip. Go's archive/tar allows 1 MiB.
HEADER_BUDGET = 4 << 20
_TAIL = 64 << 10  # decompressed bytes kept to check the end-of-archive block


class Abort(Exception):
    """Raised from inside tarfile's reads. Deliberately not an OSError or ValueError:
    tarfile turns some of those into a quiet "end of archive", which would accept a
    truncated or bounded-out layer as a shorter one."""


class Blob:
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
            raise Abort(f"cannot read the blob: {exc}") from exc
        self.hash.update(data)
        if self.frames is not None:
            try:
                self.frames.feed(data)
            except FrameError as exc:
                raise Abort(f"truncated or malformed: {exc}") from None
        return data


class LayerStream:
    """The uncompressed tar stream, as tarfile reads it: hashed (``diff_id``), counted
    against ``max_bytes``, reported to ``progress``, its last bytes kept."""

    def __init__(
        self, decoder: Any, blob: Blob, algorithm: str, max_bytes: int, progress: Callable[[int], None] | None
    ):
        self.decoder, self.blob, self.hash = decoder, blob, hashlib.new(algorithm)
        self.max_bytes, self.progress = max_bytes, progress
        self.total = self._unreported = 0
        self.header_limit: int | None = None  # set while tarfile parses one member's headers
        self._tail: deque[bytes] = deque()
        self._tail_len = 0

    def read(self, n: int | None = -1) -> bytes:
        n = CHUNK if n is None or n < 0 else n
        try:
            data = self.decoder.read(n)
        except (EOFError, OSError, zlib.error, ZstdError) as exc:  # BadGzipFile is an OSError
            raise Abort(f"truncated or malformed: {exc}") from exc
        self.total += len(data)
        if self.total > self.max_bytes:
            raise Abort(f"more than max_bytes={self.max_bytes} uncompressed bytes")
        if self.header_limit is not None and self.total > self.header_limit:
            raise Abort(f"truncated or malformed: a member's headers exceed {HEADER_BUDGET} bytes")
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
        return b"".join(self._tail)[offset - start : offset - start + tarfile.BLOCKSIZE]

    def finish(self) -> None:
        """Read to the end of both streams, so the digests cover every byte."""
        while self.read(CHUNK):
            pass
        frames = self.blob.frames
        if frames is not None and not frames.complete:
            raise Abort("truncated or malformed: the zstd stream ends inside a frame")
        while self.blob.read(CHUNK):  # bytes after the compressed stream are hashed too
            pass
        self._report()


def bounded_tarinfo(layer: LayerStream) -> type[tarfile.TarInfo]:
    """A TarInfo whose header parsing may read at most HEADER_BUDGET bytes per member."""

    class BoundedTarInfo(tarfile.TarInfo):
        __slots__ = ()

        @classmethod
        def fromtarfile(cls, tar: tarfile.TarFile) -> BoundedTarInfo:
            outer = layer.header_limit is None  # PAX and long-name headers recurse into here
            if outer:
                layer.header_limit = layer.total + HEADER_BUDGET
            try:
                return super().fromtarfile(tar)
            finally:
                if outer:
                    layer.header_limit = None

    return BoundedTarInfo


def decoder_for(media_type: str, blob: Blob) -> Any:
    compression = MEDIA_TYPES.get(media_type.split(";")[0].strip().lower())
    if compression is None:  # empty or unknown: the first bytes tell
        head = blob.peek(4)
        compression = "gzip" if head[:2] == b"\x1f\x8b" else "zstd" if head == b"\x28\xb5\x2f\xfd" else "tar"
        log.debug("layer media type %r: %s, from its first bytes", media_type, compression)
    if compression == "gzip":
        # read forward only: typeshed's file object protocol also asks for seek()
        return gzip.GzipFile(fileobj=cast(BinaryIO, blob), mode="rb")  # multi-member; CRC and length checked
    if compression == "zstd":
        if zstandard is None:
            raise ImageError("a zstd-compressed layer needs the zstandard package (pip install zstandard)")
        blob.frames = ZstdFrames()
        blob.frames.feed(blob.head)
        # The default window limit (128 MiB) bounds the decoder's memory whatever a frame asks.
        source = cast(BinaryIO, blob)  # stream_reader only calls read()
        return zstandard.ZstdDecompressor().stream_reader(source, read_across_frames=True, closefd=False)
    return blob
