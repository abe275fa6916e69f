"""Fetching an image's blobs into the store through skopeo, one fetch of an image at a time.

skopeo copies into a layout whose blobs are the store's shared ``blobs`` folder. It writes
layer and config blobs atomically (a temporary file renamed into place), but a manifest
with a plain truncate-and-write, so a second fetch of the same image copying while the
first reads the manifest made the first see a half-written file and fail its digest check
(measured: four concurrent pulls of one image, one failed in CI). :func:`skopeo_fetch`
therefore holds ``locks/<key>.lock`` from the copy until the caller has recorded the
image; a fetch that waited for it and finds the image whole skips the copy.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from sequester.errors import ImageError
from sequester.images import skopeo
from sequester.images.credentials import authfile_for
from sequester.images.manifest import DIGEST, INDEX_TYPES, is_index, parse_json, select_platform, sha256_digest
from sequester.images.progress import Progress
from sequester.images.records import hex_of, read_record
from sequester.images.reference import parse_reference
from sequester.images.sources import Source, SourceKind

if TYPE_CHECKING:
    from sequester.images.manifest import Platform
    from sequester.images.store import ImageStore

__all__ = ["skopeo_fetch"]

Fetched = tuple[str, str, "str | None"]  # manifest digest, where it came from, the source's own digest


class _Common(TypedDict):
    """The keyword arguments every skopeo argv of one store takes."""

    policy: Path
    plat: Platform
    tmpdir: Path


@contextlib.contextmanager
def skopeo_fetch(store: ImageStore, source: Source, tmp: Path, progress: Progress, what: str) -> Iterator[Fetched]:
    """Copy ``source``'s blobs into the store; yields while the image's fetch lock is held."""
    program = skopeo.skopeo_path()
    common = _Common(policy=store.root / "policy.json", plat=store.platform, tmpdir=tmp)
    if source.kind is not SourceKind.REGISTRY:
        if source.kind is SourceKind.OCI_LAYOUT:
            _check_layout_platform(store, source, what)
        with store.lock(_lock_name(source.skopeo), fcntl.LOCK_EX):
            progress.phase(f"importing {Path(source.location).name}", None)
            skopeo.run_skopeo(
                skopeo.copy_argv(
                    program,
                    source.skopeo,
                    tmp / "layout",
                    store.root / "blobs",
                    daemon_host=os.environ.get("DOCKER_HOST"),
                    **common,
                ),
                what,
                on_line=skopeo.progress_lines(progress),
            )
            yield _layout_manifest(tmp, what), source.skopeo, None
        return
    ref = parse_reference(source.location)
    fetch = ref.mirrored(store.settings.mirrors)
    tls = fetch.registry not in store.settings.insecure
    with authfile_for(fetch.registry) as authfile:
        # skopeo takes a tag or a digest, not both; the digest is what counts.
        asked = f"{fetch.name}@{ref.digest}" if ref.digest else str(fetch)
        raw = skopeo.run_skopeo(
            skopeo.inspect_argv(program, f"docker://{asked}", tls_verify=tls, authfile=authfile, **common), what
        )
        source_digest = ref.digest or sha256_digest(raw)
        if ref.digest and sha256_digest(raw) != ref.digest:
            raise ImageError(
                f"{what}: the registry's manifest has digest {sha256_digest(raw)}, not the {ref.digest} asked for"
            )
        doc = parse_json(raw, what)
        chosen = select_platform(doc, store.platform, what).digest if is_index(doc) else sha256_digest(raw)
        location = f"docker://{fetch.name}@{chosen}"
        with store.lock(_lock_name(chosen), fcntl.LOCK_EX):
            if _stored_whole(store, chosen):  # a concurrent fetch stored it while this one waited
                yield chosen, location, source_digest
                return
            progress.phase(f"pulling {ref.short}", None)
            skopeo.run_skopeo(
                skopeo.copy_argv(
                    program, location, tmp / "layout", store.root / "blobs", tls_verify=tls, authfile=authfile, **common
                ),
                what,
                on_line=skopeo.progress_lines(progress),
            )
            yield _layout_manifest(tmp, what), location, source_digest


def _lock_name(key: str) -> str:
    return f"locks/{hashlib.sha256(key.encode()).hexdigest()[:32]}.lock"


def _stored_whole(store: ImageStore, manifest_digest: str) -> bool:
    """The image's record, manifest, config and every layer folder are in the store."""
    path = store.root / "images" / f"{hex_of(manifest_digest)}.json"
    if not path.is_file() or not store.blob(manifest_digest).is_file():
        return False
    try:
        record = read_record(path)
    except ImageError:
        return False
    return store.blob(record.config_digest).is_file() and all(
        store.layer_dir(layer.diff_id).is_dir() for layer in record.layers
    )


def _layout_manifest(tmp: Path, what: str) -> str:
    index = parse_json((tmp / "layout" / "index.json").read_bytes(), f"{what}: the fetched layout's index")
    return skopeo.select_manifest(index, what)


def _check_layout_platform(store: ImageStore, source: Source, what: str) -> None:
    """A layout whose index lists only other platforms: say so before skopeo copies anything."""
    path = Path(source.location.rsplit(":", 1)[0] if not Path(source.location).exists() else source.location)
    try:
        index = parse_json((path / "index.json").read_bytes(), f"{what}: index.json")
    except OSError as exc:
        raise ImageError(f"{what}: not an OCI layout ({exc})") from None
    for entry in index.get("manifests") or ():
        digest = entry.get("digest") if isinstance(entry, dict) else None
        if entry.get("mediaType") in INDEX_TYPES and isinstance(digest, str) and DIGEST.match(digest):
            blob = path / "blobs" / "sha256" / hex_of(digest)
            if blob.is_file():
                select_platform(parse_json(blob.read_bytes(), what), store.platform, what)
