"""What the store knows of each image: one JSON record per image, written atomically.

An image's id is the sha256 digest of its manifest as stored. Its record names the
references it is known by, where it came from (with the registry's own digest, the one
``docker pull`` prints), its config and its layers (each by the digest of its blob and of
its uncompressed tar, the ``diff_id`` that names its unpacked folder). When it was last
used is the modification time of a separate ``<id>.used`` file, so that using an image
never rewrites its record.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sequester.caches import write_json_whole
from sequester.errors import ImageError
from sequester.images.manifest import ImageConfig, Platform

__all__ = ["LayerRef", "ImageRecord", "write_record", "read_record", "hex_of"]


@dataclass(frozen=True)
class LayerRef:
    digest: str  # of the blob as fetched (compressed)
    diff_id: str  # of the uncompressed tar: names the unpacked folder
    media_type: str
    size: int  # of the blob


@dataclass(frozen=True)
class ImageRecord:
    id: str
    names: tuple[str, ...]
    source: str  # where it was fetched or imported from (a mirror, a file)
    source_digest: str | None  # the registry's digest for the reference, when pulled
    config_digest: str
    config: ImageConfig
    layers: tuple[LayerRef, ...]
    size: int  # bytes of the unpacked layers (tar bytes)
    created: float

    @property
    def short_id(self) -> str:
        return hex_of(self.id)[:12]

    @property
    def digest(self) -> str:
        """The digest to cite: the registry's for a pulled image, else the stored manifest's."""
        return self.source_digest or self.id

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["names"] = list(self.names)
        return data


def hex_of(digest: str) -> str:
    return digest.split(":", 1)[1] if ":" in digest else digest


def write_record(folder: Path, record: ImageRecord) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    write_json_whole(folder / f"{hex_of(record.id)}.json", record.to_json(), indent=1)


def read_record(path: Path) -> ImageRecord:
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(4 << 20))
        cfg = dict(data["config"])
        plat = cfg.pop("platform", None)
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items()}
        config = ImageConfig(
            **fields,
            platform=Platform(**plat) if plat else None,
        )
        layers = tuple(LayerRef(**layer) for layer in data["layers"])
        return ImageRecord(
            id=data["id"],
            names=tuple(data["names"]),
            source=data["source"],
            source_digest=data.get("source_digest"),
            config_digest=data["config_digest"],
            config=config,
            layers=layers,
            size=int(data["size"]),
            created=float(data["created"]),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ImageError(f"the image store's record {path} is damaged: {exc}") from None
