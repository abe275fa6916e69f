"""The image store: content-addressed, one copy of each layer, shared read-only by episodes.

    STORE/
      blobs/sha256/<hex>     manifests, configs (and layer blobs while they are unpacked)
      layers/<diff-id hex>/  each layer unpacked once: an overlayfs lower folder
                             (or a build step's layer, named by its cache key: sequester.imagebuild)
      layers/<hex>.json      what unpacking (or the build step) found (sizes, counts)
      build-cache/<key>      the layer a build step made (sequester.images.build_cache)
      images/<id hex>.json   one record per image (:mod:`.records`); <hex>.used: last use
      tmp/                   skopeo's layouts and temporary files, removed after each fetch
      gc.lock, lock          fetches and builds hold gc.lock shared, prune exclusive; lock: record writes
      locks/<hex>.lock       one fetch of an image at a time (:mod:`.fetch`)

The store folder is 0700: an image's setuid programs and its files are nobody else's
to run or read (a root caller's store would otherwise hand every local user the image's
setuid-root binaries).

Fetching (:meth:`ImageStore.pull`, :meth:`ImageStore.import_source`) goes through skopeo
(:mod:`.skopeo`) into ``blobs``; this module checks each manifest and config against its
digest, and :func:`~.unpack.unpack_layer` checks each layer against both of its digests
while it unpacks it into a temporary folder renamed into place only when complete.
Episodes hold :meth:`ImageStore.lease` while they run; ``rm`` and ``prune`` never remove
an image that is leased.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from sequester.errors import ImageError
from sequester.images import skopeo
from sequester.images.cleanup import collect_garbage, drop_record
from sequester.images.fetch import skopeo_fetch
from sequester.images.image_settings import ImageSettings
from sequester.images.manifest import (
    Descriptor,
    Platform,
    declared_compression,
    host_platform,
    parse_config,
    parse_json,
    parse_manifest,
    sha256_digest,
)
from sequester.images.progress import NO_PROGRESS, Progress
from sequester.images.records import ImageRecord, LayerRef, hex_of, read_record, write_record
from sequester.images.reference import parse_reference
from sequester.images.sources import Source, SourceKind, classify, compression_of
from sequester.images.synth import rootfs_image
from sequester.images.unpack import unpack_layer
from sequester.sandbox.idmap import IdMap

__all__ = ["ImageStore", "ImageLease"]

log = logging.getLogger("sequester.images")


@dataclass
class ImageLease:
    """An episode's use of an image: its layer folders (lowest first) until :meth:`release`."""

    record: ImageRecord
    layers: tuple[Path, ...]
    _fd: int | None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class ImageStore:
    """The store of ``settings``, its pulled layers owned through ``ids`` (the map the
    caller's episodes use, :mod:`sequester.sandbox.idmap`; None: the caller alone)."""

    def __init__(self, settings: ImageSettings | None = None, ids: IdMap | None = None):
        self.settings = settings or ImageSettings()
        self.root = self.settings.store_dir
        self.platform: Platform = host_platform()
        self.ids = ids

    def _ready(self) -> None:
        """The store's folders, and its layers owned through :attr:`ids` (:mod:`.migrate`)."""
        from sequester.images.migrate import reconcile

        self._ensure()
        reconcile(self)

    # -- folders --------------------------------------------------------------------------

    def _ensure(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            os.chmod(self.root, 0o700)
            for sub in ("blobs/sha256", "layers", "images", "tmp", "locks"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
            policy = self.root / "policy.json"
            if not policy.exists():
                policy.write_text(skopeo.POLICY)
        except OSError as exc:  # another user's store, a read-only disk: say which, never a traceback
            raise ImageError(
                f"the image store {self.root} cannot be used: {exc.strerror or exc} ([images] store_dir names another)"
            ) from None

    def blob(self, digest: str) -> Path:
        return self.root / "blobs" / "sha256" / hex_of(digest)

    def layer_dir(self, diff_id: str) -> Path:
        return self.root / "layers" / hex_of(diff_id)

    @contextlib.contextmanager
    def lock(self, name: str, kind: int, *, wait: float = 600, ready: bool = True) -> Iterator[None]:
        """The store's lock ``name`` (a flock of ``kind``). The store is made ready first
        (``ready``: its layers owned through :attr:`ids`), before any lock is held: the
        migration takes ``gc.lock`` exclusively, which a caller already holding it shared
        (a build) would wait for forever."""
        if ready:
            self._ready()
        else:
            self._ensure()
        deadline = time.monotonic() + wait
        if name == "gc.lock" and kind == fcntl.LOCK_SH:
            # Through the gate first: a prune or migration waiting for gc.lock exclusively
            # holds the gate, so new readers queue behind it instead of starving it (flock
            # has no fairness: overlapping builds would hold gc.lock shared forever).
            gate = self._flock("gate.lock", fcntl.LOCK_SH, deadline)
            os.close(gate)
        fd = self._flock(name, kind, deadline)
        try:
            yield
        finally:
            os.close(fd)

    def _flock(self, name: str, kind: int, deadline: float) -> int:
        """A descriptor of the lock file ``name`` holding a flock of ``kind``."""
        fd = os.open(self.root / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        while True:
            try:
                fcntl.flock(fd, kind | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise ImageError(f"the image store {self.root} is busy (another prune or fetch)") from None
                time.sleep(0.02)

    @contextlib.contextmanager
    def exclusive(self, *, wait: float = 600, ready: bool = True) -> Iterator[None]:
        """``gc.lock`` held exclusively (a prune, a migration), taken through the gate
        (:meth:`lock`): readers that come later wait until it is released."""
        if ready:
            self._ready()
        else:
            self._ensure()
        deadline = time.monotonic() + wait
        gate = self._flock("gate.lock", fcntl.LOCK_EX, deadline)
        try:
            fd = self._flock("gc.lock", fcntl.LOCK_EX, deadline)
            try:
                yield
            finally:
                os.close(fd)
        finally:
            os.close(gate)

    # -- reading ------------------------------------------------------------------------

    def records(self) -> list[ImageRecord]:
        folder = self.root / "images"
        if not folder.is_dir():
            return []
        return [read_record(p) for p in sorted(folder.glob("*.json")) if not p.name.startswith(".")]

    def find(self, name: str) -> ImageRecord | None:
        """By reference (normalised), by id or digest, or by an id prefix of 12 or more."""
        records = self.records()
        wanted = {name}
        try:
            wanted.add(str(parse_reference(name)))
        except ImageError:
            pass
        # Names first, then a whole id or digest, then a bare id prefix that only one image
        # has (attack: "ghcr.io/a/b:1" read as the prefix "1" of another image's id, so a
        # FROM or COPY --from got whichever image's id began with it).
        for r in records:
            if wanted & set(r.names):
                return r
        for r in records:
            if name in (r.id, r.source_digest):
                return r
        prefix = name.removeprefix("sha256:")
        if len(prefix) >= 12 and all(c in "0123456789abcdef" for c in prefix):
            matches = [r for r in records if hex_of(r.id).startswith(prefix)]
            if len(matches) == 1:
                return matches[0]
        return None

    def last_used(self, record: ImageRecord) -> float:
        try:
            return (self.root / "images" / f"{hex_of(record.id)}.used").stat().st_mtime
        except OSError:
            return record.created

    def lease(self, record: ImageRecord) -> ImageLease:
        """Hold ``record`` for an episode: its layers are there and stay until released."""
        self._ready()
        used = self.root / "images" / f"{hex_of(record.id)}.used"
        fd = os.open(used, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.utime(fd)
            if not (self.root / "images" / f"{hex_of(record.id)}.json").exists():
                raise ImageError(f"image {record.names[0] if record.names else record.short_id} was removed")
            layers = tuple(self.layer_dir(layer.diff_id) for layer in record.layers)
            for layer, path in zip(record.layers, layers, strict=True):
                if not path.is_dir():
                    raise ImageError(
                        f"image {record.short_id}: layer {layer.diff_id} is missing from the store "
                        f"({path}); pull or import the image again"
                    )
        except BaseException:
            os.close(fd)
            raise
        return ImageLease(record, layers, fd)

    # -- fetching -----------------------------------------------------------------------

    def get(self, text: str, *, progress: Progress = NO_PROGRESS) -> ImageRecord:
        """The image ``text`` names: from the store when it is there, else pulled (aliases applied)."""
        return self.find(text) or self.pull(text, progress=progress)

    def pull(self, text: str, *, progress: Progress = NO_PROGRESS) -> ImageRecord:
        """Fetch ``text`` (a reference, or what ``[images] aliases`` maps it to) into the store."""
        alias = self.settings.aliases.get(text)
        if alias is None and _is_reference(text):
            # Keys are references too: "python:3.13" also names docker.io/library/python:3.13.
            wanted = str(parse_reference(text))
            alias = next(
                (v for k, v in self.settings.aliases.items() if _is_reference(k) and str(parse_reference(k)) == wanted),
                None,
            )
        if alias is not None:
            source = classify(alias)
            name = str(parse_reference(text)) if _is_reference(text) else text
            return self._fetch(source, name, progress, what=f"{text} (alias of {alias})")
        ref = parse_reference(text)
        return self._fetch(Source(SourceKind.REGISTRY, str(ref)), str(ref), progress, what=str(ref))

    def import_source(self, text: str, tag: str | None, *, progress: Progress = NO_PROGRESS) -> ImageRecord:
        """Import a file, folder or engine image (see :mod:`.sources`) under ``tag``."""
        source = classify(text)
        if source.kind is SourceKind.REGISTRY:
            raise ImageError(f"{text}: no such file or folder (to fetch from a registry, use 'image pull')")
        if tag is not None and _is_reference(tag):
            tag = str(parse_reference(tag))
        return self._fetch(source, tag, progress, what=text)

    def _fetch(self, source: Source, name: str | None, progress: Progress, *, what: str) -> ImageRecord:
        self._ready()
        with self.lock("gc.lock", fcntl.LOCK_SH):
            tmp = Path(tempfile.mkdtemp(prefix="fetch-", dir=self.root / "tmp"))
            try:
                if source.kind in (SourceKind.ROOTFS_DIR, SourceKind.ROOTFS_TAR):
                    manifest_digest, fetched_from, source_digest = (
                        rootfs_image(self, source, tmp, progress),
                        f"{source.kind.value}:{source.location}",
                        None,
                    )
                    record = self._unpack_and_record(manifest_digest, name, fetched_from, source_digest, progress, what)
                else:
                    # Held until the image is recorded: skopeo rewrites a manifest blob in place,
                    # so a second fetch of the same image must not copy while this one reads it.
                    with skopeo_fetch(self, source, tmp, progress, what) as (
                        manifest_digest,
                        fetched_from,
                        source_digest,
                    ):
                        record = self._unpack_and_record(
                            manifest_digest, name, fetched_from, source_digest, progress, what
                        )
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return record

    def _read_blob(self, digest: str, what: str) -> bytes:
        try:
            data = self.blob(digest).read_bytes()
        except OSError as exc:
            raise ImageError(f"{what}: blob {digest} is missing after the fetch ({exc})") from None
        if sha256_digest(data) != digest:
            raise ImageError(f"{what}: blob {digest} does not match its digest (it hashes to {sha256_digest(data)})")
        return data

    def _unpack_and_record(
        self,
        manifest_digest: str,
        name: str | None,
        fetched_from: str,
        source_digest: str | None,
        progress: Progress,
        what: str,
    ) -> ImageRecord:
        manifest = parse_manifest(parse_json(self._read_blob(manifest_digest, what), f"{what}: manifest"), what)
        config = parse_config(parse_json(self._read_blob(manifest.config.digest, what), f"{what}: config"), what)
        if len(config.diff_ids) != len(manifest.layers):
            raise ImageError(
                f"{what}: the manifest has {len(manifest.layers)} layers but the config names {len(config.diff_ids)}"
            )
        if (
            config.platform
            and config.platform.architecture
            and config.platform.architecture != self.platform.architecture
        ):
            raise ImageError(f"{what}: the image is for {config.platform}, this machine is {self.platform}")
        layers, size = [], 0
        for i, (desc, diff_id) in enumerate(zip(manifest.layers, config.diff_ids, strict=False)):
            size += self._ensure_layer(desc, diff_id, progress, f"{what}: layer {i + 1}/{len(manifest.layers)}")
            layers.append(LayerRef(desc.digest, diff_id, desc.media_type, desc.size))

        def make(existing: ImageRecord | None, names: tuple[str, ...]) -> ImageRecord:
            return ImageRecord(
                id=manifest_digest,
                names=names,
                source=fetched_from,
                source_digest=source_digest or (existing.source_digest if existing else None),
                config_digest=manifest.config.digest,
                config=config,
                layers=tuple(layers),
                size=size,
                created=existing.created if existing else time.time(),
            )

        record = self.save_record(manifest_digest, name, make)
        for layer in layers:  # unpacked: the compressed copy is not needed (one copy of each layer)
            with contextlib.suppress(OSError):
                self.blob(layer.digest).unlink()
        log.info("image %s: %s (%d layers, %d bytes)", name or manifest_digest, manifest_digest, len(layers), size)
        return record

    def _ensure_layer(self, desc: Descriptor, diff_id: str, progress: Progress, what: str) -> int:
        folder, stats = self.layer_dir(diff_id), self.root / "layers" / f"{hex_of(diff_id)}.json"
        owners = self.root / "layers" / f"{hex_of(diff_id)}.owners"
        if not folder.is_dir():
            blob = self.blob(desc.digest)
            if not blob.is_file():
                raise ImageError(f"{what}: blob {desc.digest} was not fetched")
            progress.phase(f"unpacking {hex_of(diff_id)[:12]}", None)  # (advances in uncompressed bytes)
            media_type = desc.media_type
            if declared_compression(media_type) != compression_of(blob):
                # skopeo 1.9 copying a docker-archive with uncompressed layers labels them
                # tar+gzip: let the unpacker read the bytes (both digests are still checked).
                media_type = ""
            try:
                result = unpack_layer(
                    blob,
                    folder,
                    media_type=media_type,
                    digest=desc.digest,
                    diff_id=diff_id,
                    progress=progress.advance,
                    owners=owners,
                    ids=self.ids,
                )
            except (ImageError, OSError) as exc:
                if not folder.is_dir():  # else: a concurrent fetch unpacked the same layer first
                    raise ImageError(f"{what}: {exc}") from None
            else:
                stats.write_text(
                    json.dumps(
                        {
                            "bytes": result.bytes,
                            "entries": result.entries,
                            "devices_skipped": result.devices_skipped,
                            "owned": result.owned,
                            "unmapped_owners": result.unmapped_owners,
                        }
                    )
                )
            progress.done()
        try:
            return int(json.loads(stats.read_text())["bytes"])
        except (OSError, ValueError, KeyError):
            return 0

    def save_record(
        self, image_id: str, name: str | None, make: Callable[[ImageRecord | None, tuple[str, ...]], ImageRecord]
    ) -> ImageRecord:
        """Write the record ``make(existing record, names)`` gives for ``image_id``, known
        also as ``name``: a name belongs to one image, the newest, so it is taken from any
        other that had it."""
        with self.lock("lock", fcntl.LOCK_EX):
            existing = self.find(image_id)
            names = list(existing.names) if existing else []
            if name and name not in names:
                names.append(name)
                for other in self.records():
                    if other.id != image_id and name in other.names:
                        write_record(self.root / "images", _renamed(other, tuple(n for n in other.names if n != name)))
            record = make(existing, tuple(names))
            if existing != record:
                write_record(self.root / "images", record)
        return record

    # -- removing -------------------------------------------------------------------------

    def remove(self, name: str) -> ImageRecord:
        """Remove an image (not while an episode uses it), then the layers nothing else uses."""
        record = self.find(name)
        if record is None:
            raise ImageError(f"image {name!r} is not in the store {self.root}")
        with self.exclusive():
            drop_record(self, record)
            collect_garbage(self)
        return record

    def prune(self, unused_for: float | None = None) -> tuple[list[ImageRecord], int]:
        """Remove images not used for ``unused_for`` seconds (None: none) and the build
        cache's entries not used for as long (None: all of them), then every layer, blob
        and temporary folder no image needs. Returns the removed images and bytes freed."""
        from sequester.images.build_cache import BuildCache

        removed = []
        with self.exclusive():
            BuildCache(self.root).drop(unused_for)
            if unused_for is not None:
                for record in self.records():
                    if time.time() - self.last_used(record) > unused_for:
                        with contextlib.suppress(ImageError):
                            drop_record(self, record)
                            removed.append(record)
            freed = collect_garbage(self)
        return removed, freed


def _renamed(record: ImageRecord, names: tuple[str, ...]) -> ImageRecord:
    from dataclasses import replace

    return replace(record, names=names)


def _is_reference(text: str) -> bool:
    try:
        parse_reference(text)
        return True
    except ImageError:
        return False
