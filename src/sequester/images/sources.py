"""What a path or reference given to ``sequester image import`` / ``pull`` is.

* a folder holding ``oci-layout``: an OCI image layout (``oci:PATH``; ``PATH:REF`` picks
  one of several images in it);
* a plain tar holding ``oci-layout``: an OCI archive (``oci-archive:``);
* a plain tar holding ``manifest.json``: a ``docker save`` archive (``docker-archive:``);
* any other folder: a root filesystem; any other tar (plain, gzip or zstd): a root
  filesystem tarball. Either becomes an image of one layer;
* ``docker-daemon:NAME``: the image of a Docker-API engine (``$DOCKER_HOST``), exported;
* anything else: a registry reference.
"""

from __future__ import annotations

import enum
import hashlib
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, cast

from sequester.errors import ImageError

__all__ = ["SourceKind", "Source", "classify", "tar_rootfs", "compression_of"]

_SCAN_LIMIT = 100_000  # tar headers read to find an archive's index (each is a seek, no data read)


class SourceKind(enum.Enum):
    REGISTRY = "registry"
    OCI_LAYOUT = "oci"
    OCI_ARCHIVE = "oci-archive"
    DOCKER_ARCHIVE = "docker-archive"
    ENGINE = "docker-daemon"
    ROOTFS_DIR = "rootfs"
    ROOTFS_TAR = "rootfs-tar"


@dataclass(frozen=True)
class Source:
    kind: SourceKind
    location: str  # a path, a reference, or an engine's image name

    @property
    def skopeo(self) -> str:
        """The source as skopeo names it (only for the kinds skopeo copies)."""
        return f"{self.kind.value}:{self.location}"


def compression_of(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(4)
    if head[:2] == b"\x1f\x8b":
        return "gzip"
    if head == b"\x28\xb5\x2f\xfd":
        return "zstd"
    return ""


def classify(text: str) -> Source:
    """Which kind of source ``text`` is (a path that exists, or else a reference)."""
    if text.startswith("docker-daemon:"):
        return Source(SourceKind.ENGINE, text[len("docker-daemon:") :])
    for prefix, kind in (
        ("oci:", SourceKind.OCI_LAYOUT),
        ("oci-archive:", SourceKind.OCI_ARCHIVE),
        ("docker-archive:", SourceKind.DOCKER_ARCHIVE),
    ):
        if text.startswith(prefix):
            return Source(
                kind,
                str(Path(text[len(prefix) :]).resolve()) if ":" not in text[len(prefix) :] else text[len(prefix) :],
            )
    path, ref = Path(text), None
    if not path.exists() and ":" in text and Path(text.rsplit(":", 1)[0]).is_dir():
        path, ref = Path(text.rsplit(":", 1)[0]), text.rsplit(":", 1)[1]
    if path.is_dir():
        if (path / "oci-layout").is_file():
            return Source(SourceKind.OCI_LAYOUT, str(path.resolve()) + (f":{ref}" if ref else ""))
        return Source(SourceKind.ROOTFS_DIR, str(path.resolve()))
    if path.is_file():
        if compression_of(path):
            return Source(SourceKind.ROOTFS_TAR, str(path.resolve()))
        top = _top_names(path)
        if "oci-layout" in top:
            return Source(SourceKind.OCI_ARCHIVE, str(path.resolve()))
        if "manifest.json" in top:
            return Source(SourceKind.DOCKER_ARCHIVE, str(path.resolve()))
        return Source(SourceKind.ROOTFS_TAR, str(path.resolve()))
    if text.startswith(("/", "./", "../")):
        raise ImageError(f"{text}: no such file or folder")
    return Source(SourceKind.REGISTRY, text)


def _top_names(path: Path) -> set[str]:
    names: set[str] = set()
    try:
        with tarfile.open(path, "r:") as tar:
            for i, member in enumerate(tar):
                if i >= _SCAN_LIMIT:
                    break
                name = member.name.removeprefix("./")
                if "/" not in name.rstrip("/"):
                    names.add(name)
    except (tarfile.TarError, OSError) as exc:
        raise ImageError(f"{path}: not a tar archive, OCI archive or docker save archive ({exc})") from None
    return names


def tar_rootfs(folder: Path, out: Path) -> tuple[str, int]:
    """A layer tar of a root filesystem folder (links kept and never followed, ownership
    folded to root). Returns its sha256 digest (also its diff_id) and its size."""
    digest = hashlib.sha256()

    class _Hashing:
        def __init__(self, f):
            self.f = f

        def write(self, data: bytes) -> int:
            digest.update(data)
            return self.f.write(data)

    def fold(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        if info.isdev():
            return None  # the sandbox has its own /dev; device nodes are never needed
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    try:
        with open(out, "wb") as raw:
            # a stream ("w|") only writes to its file object; typeshed asks for a whole file
            hashing = cast(BinaryIO, _Hashing(raw))
            with tarfile.open(fileobj=hashing, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                for entry in sorted(os.listdir(folder)):
                    tar.add(folder / entry, arcname=entry, recursive=True, filter=fold)
    except OSError as exc:
        raise ImageError(f"{folder}: cannot be read as a root filesystem: {exc}") from None
    return "sha256:" + digest.hexdigest(), out.stat().st_size
