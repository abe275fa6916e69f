"""Layers made in a test, and unpacked or refused: the shared helpers of
tests/images/test_unpack.py and test_unpack_attacks.py."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import tarfile
from pathlib import Path

import pytest
import zstandard

from sequester.errors import ImageError
from sequester.images.unpack import unpack_layer

T0 = 1_600_000_000


def entry(name: str, kind: str = "file", data: bytes = b"", mode: int = 0o644, link: str = "",
          dev: tuple[int, int] = (0, 0), mtime: int = T0, **pax: str) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "sym": tarfile.SYMTYPE,
                 "link": tarfile.LNKTYPE, "fifo": tarfile.FIFOTYPE, "chr": tarfile.CHRTYPE,
                 "blk": tarfile.BLKTYPE}[kind]
    info.size, info.mode, info.linkname, info.mtime = len(data), mode, link, mtime
    info.devmajor, info.devminor = dev
    info.pax_headers = pax
    return info, data


def tar_bytes(entries: list[tuple[tarfile.TarInfo, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in entries:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buf.getvalue()


def compress(raw: bytes, how: str) -> bytes:
    return {"tar": lambda b: b, "gzip": gzip.compress,
            "zstd": zstandard.ZstdCompressor().compress}[how](raw)


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.startswith(".tmp-")]


def refused(tmp_path: Path, blob_bytes: bytes, match: str, **kw) -> ImageError:
    """Unpack must raise ImageError matching ``match`` and leave nothing behind."""
    blob = tmp_path / "layer"
    blob.write_bytes(blob_bytes)
    dest = tmp_path / "out"
    with pytest.raises(ImageError, match=match) as info:
        unpack_layer(blob, dest, **kw)
    assert not os.path.lexists(dest) and leftovers(tmp_path) == []
    return info.value


def unpack(tmp_path: Path, entries: list, name: str = "out", how: str = "tar", **kw):
    blob = tmp_path / f"{name}.layer"
    blob.write_bytes(compress(tar_bytes(entries), how))
    return unpack_layer(blob, tmp_path / name, **kw), tmp_path / name
