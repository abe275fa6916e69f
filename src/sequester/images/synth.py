"""An image of one layer made from a root filesystem folder or tarball (``image import``).

The layer is the tarball itself (kept compressed as it came) or a tar of the folder
(:func:`~.sources.tar_rootfs`); the config says only the platform, the layer's
``diff_id`` and Docker's default ``PATH``; the manifest is an OCI one. All three are
written into the store's blobs under their digests, then unpacked and recorded like a
pulled image.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

from sequester.errors import ImageError
from sequester.images.progress import Progress
from sequester.images.sources import Source, SourceKind, compression_of, tar_rootfs

if TYPE_CHECKING:
    from sequester.images.store import ImageStore

__all__ = ["rootfs_image", "write_json_blob", "DEFAULT_PATH"]

DEFAULT_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_MEDIA = {
    "": "application/vnd.oci.image.layer.v1.tar",
    "gzip": "application/vnd.oci.image.layer.v1.tar+gzip",
    "zstd": "application/vnd.oci.image.layer.v1.tar+zstd",
}


def rootfs_image(store: ImageStore, source: Source, tmp: Path, progress: Progress) -> str:
    """Write the image's blobs; return its manifest's digest."""
    progress.phase(f"reading {Path(source.location).name}", None)
    if source.kind is SourceKind.ROOTFS_DIR:
        layer = tmp / "layer.tar"
        digest, size = tar_rootfs(Path(source.location), layer)
        diff_id, compression = digest, ""
    else:
        layer = Path(source.location)
        compression = compression_of(layer)
        digest, diff_id, size = _digests(layer, compression)
    blob = store.blob(digest)
    if not blob.exists():
        _copy_into(layer, blob, move=source.kind is SourceKind.ROOTFS_DIR)
    config = {
        "architecture": store.platform.architecture,
        "os": store.platform.os,
        "config": {"Env": [DEFAULT_PATH]},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }
    if store.platform.variant:
        config["variant"] = store.platform.variant
    config_digest, config_size = write_json_blob(store, config)
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": config_size,
        },
        "layers": [{"mediaType": _MEDIA[compression], "digest": digest, "size": size}],
    }
    progress.done()
    return write_json_blob(store, manifest)[0]


def _digests(path: Path, compression: str) -> tuple[str, str, int]:
    """(blob digest, diff_id, size) in one read of the file."""
    blob, tar = hashlib.sha256(), hashlib.sha256()
    if compression == "gzip":
        d = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        feed = lambda data: tar.update(d.decompress(data))  # noqa: E731
    elif compression == "zstd":
        import zstandard

        zd = zstandard.ZstdDecompressor().decompressobj()
        feed = lambda data: tar.update(zd.decompress(data))  # noqa: E731
    else:
        feed = tar.update
    size = 0
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                size += len(chunk)
                blob.update(chunk)
                feed(chunk)
    except (OSError, zlib.error, Exception) as exc:  # zstandard.ZstdError is an Exception
        raise ImageError(f"{path}: cannot be read as a {compression or 'plain'} tarball: {exc}") from None
    return "sha256:" + blob.hexdigest(), "sha256:" + tar.hexdigest(), size


def _copy_into(src: Path, dest: Path, *, move: bool) -> None:
    tmp = dest.with_name(f".tmp-{dest.name}-{os.getpid()}")
    if move:
        os.replace(src, dest)
        return
    with open(src, "rb") as f, open(tmp, "wb") as out:
        while chunk := f.read(1 << 20):
            out.write(chunk)
    os.replace(tmp, dest)


def write_json_blob(store: ImageStore, doc: dict) -> tuple[str, int]:
    data = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    path = store.blob(digest)
    if not path.exists():
        tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return digest, len(data)
