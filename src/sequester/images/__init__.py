"""OCI images without a daemon: fetch (:mod:`.skopeo`), store (:mod:`.store`), unpack
(:mod:`.unpack`), and the plan of an episode's view on an image (:mod:`sequester.environments.local.image_view`).

    store = ImageStore(ImageSettings())
    record = store.get("python:3.13-slim-bookworm")   # from the store, else pulled
    lease = store.lease(record)                        # the layer folders, held for an episode
"""

from sequester.images.image_settings import IMAGE_SOURCES, ImageSettings
from sequester.images.records import ImageRecord, LayerRef
from sequester.images.reference import Reference, parse_reference
from sequester.images.store import ImageLease, ImageStore

__all__ = [
    "ImageStore",
    "ImageLease",
    "ImageRecord",
    "LayerRef",
    "ImageSettings",
    "IMAGE_SOURCES",
    "Reference",
    "parse_reference",
]
