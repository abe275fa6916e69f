"""The image a build made, recorded in the store like any other image.

Its manifest and config are written as blobs (so its id is the digest of its manifest,
as for a pulled image, and an unchanged rebuild gives the same id); its layers are the
base image's followed by the build's own, each a folder of the store. A built layer has
no blob: its ``digest`` and ``diff_id`` both name its folder, with a media type saying so.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from sequester.images.manifest import ImageConfig, config_document
from sequester.images.records import ImageRecord, LayerRef
from sequester.images.store import ImageStore
from sequester.images.synth import write_json_blob

__all__ = ["BUILT_LAYER", "built_layer", "write_built_image"]

BUILT_LAYER = "application/vnd.sequester.layer.folder"


def built_layer(layer_hex: str, size: int) -> LayerRef:
    return LayerRef(f"sha256:{layer_hex}", f"sha256:{layer_hex}", BUILT_LAYER, size)


def write_built_image(
    store: ImageStore, config: ImageConfig, layers: Sequence[LayerRef], *, name: str | None, source: str
) -> ImageRecord:
    plat = store.platform
    doc = {
        "architecture": plat.architecture,
        "os": plat.os,
        "config": config_document(config),
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
    }
    if plat.variant:
        doc["variant"] = plat.variant
    config_digest, config_size = write_json_blob(store, doc)
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": config_size,
        },
        "layers": [{"mediaType": layer.media_type, "digest": layer.digest, "size": layer.size} for layer in layers],
    }
    manifest_digest, _ = write_json_blob(store, manifest)
    final = ImageConfig(
        **{**config.__dict__, "diff_ids": tuple(layer.diff_id for layer in layers), "platform": config.platform or plat}
    )

    def make(existing: ImageRecord | None, names: tuple[str, ...]) -> ImageRecord:
        return ImageRecord(
            id=manifest_digest,
            names=names,
            source=source,
            source_digest=None,
            config_digest=config_digest,
            config=final,
            layers=tuple(layers),
            size=sum(layer.size for layer in layers),
            created=existing.created if existing else time.time(),
        )

    return store.save_record(manifest_digest, name, make)
