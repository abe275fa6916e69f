"""Variants of the test images: multi-platform indexes, archives, zstd copies (real
tools: umoci-built manifests, skopeo's copies). See :mod:`images` for the images."""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Sequence
from pathlib import Path

from images import (INDEX_TYPE, PLATFORM_FILE, REF_NAME, _files_image, _index, _write_blob, descriptor, host_arch,
                    manifest, other_arch, read_blob)
from registry import skip_unless_tools, skopeo

__all__ = ["multi_platform_index", "other_platform_only", "layer_members", "zstd_copy", "oci_archive", "docker_archive"]


def _platform_index(layout: Path, tag: str, arches: Sequence[str], base: Path | None) -> str:
    manifests = []
    for arch in arches:
        part = f"{tag}--{arch}"
        _files_image(layout, part, {PLATFORM_FILE: f"{arch}\n".encode()}, base, arch=arch,
                     cmd=["/bin/sh"] if base else None)
        entry = {k: v for k, v in descriptor(layout, part).items() if k != "annotations"}
        manifests.append({**entry, "platform": {"architecture": arch, "os": "linux"}})
    digest, size = _write_blob(layout, json.dumps({"schemaVersion": 2, "mediaType": INDEX_TYPE,
                                                   "manifests": manifests}).encode())
    index = _index(layout)
    parts = {f"{tag}--{arch}" for arch in arches} | {tag}
    index["manifests"] = [entry for entry in index["manifests"]
                          if entry.get("annotations", {}).get(REF_NAME) not in parts]
    index["manifests"].append({"mediaType": INDEX_TYPE, "digest": digest, "size": size,
                               "annotations": {REF_NAME: tag}})
    (layout / "index.json").write_text(json.dumps(index))
    return f"oci:{layout}:{tag}"


def multi_platform_index(layout: Path, tag: str, *, base: Path | None = None) -> str:
    """``layout:tag`` is an OCI index of two images, for :func:`host_arch` and
    :func:`other_arch`; each has /platform holding its architecture in a layer of its own
    (over ``base``, if given, in both: a wrong choice then still runs, and says so).
    ``oci:LAYOUT:TAG``."""
    return _platform_index(layout, tag, [host_arch(), other_arch()], base)


def other_platform_only(layout: Path, tag: str, *, base: Path | None = None) -> str:
    """An index whose only image is for :func:`other_arch`: nothing for this machine."""
    return _platform_index(layout, tag, [other_arch()], base)


def layer_members(layout: Path, tag: str, index: int) -> list[str]:
    """The member names of layer ``index`` of ``layout:tag``, read with tarfile."""
    digest = manifest(layout, tag)["layers"][index]["digest"]
    with tarfile.open(fileobj=io.BytesIO(read_blob(layout, digest))) as tar:
        return tar.getnames()


def zstd_copy(src: str, dst: Path, tag: str = "latest") -> str:
    """``src`` copied to the OCI layout ``dst`` with zstd-compressed layers; ``oci:DST:TAG``."""
    skip_unless_tools("skopeo")
    skopeo("copy", "--dest-compress-format=zstd", src, f"oci:{dst}:{tag}")
    return f"oci:{dst}:{tag}"


def oci_archive(layout_ref: str, path: Path, tag: str | None = None) -> str:
    """``layout_ref`` as a single-file OCI layout tar; ``oci-archive:PATH[:TAG]``."""
    skip_unless_tools("skopeo")
    ref = f"oci-archive:{path}" + (f":{tag}" if tag else "")
    skopeo("copy", layout_ref, ref)
    return ref


def docker_archive(layout_ref: str, path: Path, ref: str) -> str:
    """``layout_ref`` as a ``docker save`` tar naming it ``ref``; ``docker-archive:PATH``."""
    skip_unless_tools("skopeo")
    skopeo("copy", layout_ref, f"docker-archive:{path}:{ref}")
    return f"docker-archive:{path}"
