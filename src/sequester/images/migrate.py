"""Bring an image store to what this sequester and this caller's id map expect, once per
process: its layers' files owned through the map episodes use (:mod:`.owners`).

The store keeps the map its pulled layers were given their owners for in ``STORE/ids``:

* the same map: nothing to do (one read of a small file);
* another map (a range configured since, ``sequester setup ids`` run): every pulled layer
  is given its owners again from its list, for the new map;
* no ``ids`` file but images (a store of an earlier sequester, which unpacked every file
  as the caller's and kept no list): the images whose layers have no list are removed,
  to be pulled or built again when next used, and a warning says so once. Layers of
  ``RUN`` steps have no list: their owners are whatever the step's map made, and the map
  is part of their cache key (:func:`~sequester.images.build_cache.base_key`), so a
  build under another map makes its own.

All under the store's ``gc.lock`` held exclusively: no fetch or prune runs meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import TYPE_CHECKING

from sequester.errors import ImageError, SandboxError
from sequester.images.cleanup import collect_garbage, drop_record
from sequester.images.owners import map_tag, own_layer
from sequester.images.records import hex_of
from sequester.sandbox.idmap import IdMap

if TYPE_CHECKING:
    from sequester.images.store import ImageStore

__all__ = ["reconcile", "parse_tag", "IDS_FILE"]

log = logging.getLogger("sequester.images")

IDS_FILE = "ids"
_done: set[tuple[str, str]] = set()
_done_lock = threading.Lock()
_here = threading.local()  # the stores this thread is migrating (their own locks re-enter)


def parse_tag(text: str) -> IdMap | None:
    """The map :func:`~.owners.map_tag` wrote (None: the caller alone)."""
    kind, _, value = text.strip().partition(" ")
    numbers = [int(n) for n in value.split(":")] if value else []
    if kind == "map" and len(numbers) == 4:
        return IdMap(*numbers)
    if kind == "caller" and len(numbers) == 2:
        return None
    raise ValueError(f"not an id map: {text!r}")


def reconcile(store: ImageStore) -> None:
    """Make ``store``'s layers owned through ``store.ids`` (see the module's text)."""
    tag = map_tag(store.ids)
    key = (str(store.root), tag)
    with _done_lock:
        if key in _done:
            return
    busy: set[tuple[str, str]] = _here.__dict__.setdefault("busy", set())
    if key in busy:  # the migration's own use of the store (dropping a record takes its lock)
        return
    busy.add(key)
    try:
        if _read(store) != tag:
            with store.exclusive(ready=False):
                old = _read(store)
                if old != tag:
                    _migrate(store, old)
                    _write(store, tag)
    finally:
        busy.discard(key)
    with _done_lock:
        _done.add(key)


def _migrate(store: ImageStore, old: str | None) -> None:
    if old is None:
        legacy = _legacy_records(store)
        if legacy:
            dropped = 0
            for record in legacy:
                with contextlib.suppress(ImageError):  # held by a running episode: left as it is
                    drop_record(store, record)
                    dropped += 1
            collect_garbage(store)
            log.warning(
                "the image store %s was made by an earlier sequester, which kept no owners of the images' files: "
                "%d of its images were removed and will be pulled or built again when next used",
                store.root,
                dropped,
            )
        return
    try:
        before = parse_tag(old)
    except ValueError:
        before = None
    lists = sorted((store.root / "layers").glob("*.owners"))
    failed: dict[str, str] = {}
    for listed in lists:
        folder = listed.with_suffix("")
        if not folder.is_dir():
            continue
        try:
            own_layer(folder, listed, store.ids, current=before)
        except (OSError, SandboxError, ValueError, OverflowError) as exc:
            failed[folder.name] = str(exc)
    if failed:
        # One layer that cannot be given its owners (a hostile list, a full disk) costs
        # the images that use it, never the store (red team: one image made every later
        # use of the store fail).
        _drop_images_of(store, set(failed))
        log.warning(
            "the image store %s: %d layers could not be given their owners; the images using them were removed: %s",
            store.root,
            len(failed),
            "; ".join(f"{name[:12]}: {why}" for name, why in sorted(failed.items())[:5]),
        )
    if lists:
        log.warning(
            "the image store %s: %d layers given their owners for the ids %s (they had them for %s)",
            store.root,
            len(lists),
            store.ids.describe() if store.ids else "of the caller alone",
            before.describe() if before else "the caller alone",
        )


def _drop_images_of(store: ImageStore, layers: set[str]) -> None:
    """Remove the images that use any of ``layers`` (by folder name), then what no image
    needs any more; an image a running episode holds is left as it is."""
    for record in store.records():
        if any(hex_of(layer.diff_id) in layers for layer in record.layers):
            with contextlib.suppress(ImageError):
                drop_record(store, record)
    collect_garbage(store)


def _legacy_records(store: ImageStore) -> list:
    from sequester.images.build_cache import BuildCache

    built = BuildCache(store.root).layers()
    layers = store.root / "layers"
    out = []
    for record in store.records():
        for layer in record.layers:
            name = hex_of(layer.diff_id)
            if name not in built and not (layers / f"{name}.owners").exists():
                out.append(record)
                break
    return out


def _read(store: ImageStore) -> str | None:
    try:
        return (store.root / IDS_FILE).read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ImageError(f"the image store {store.root} cannot be used: {exc.strerror or exc}") from None


def _write(store: ImageStore, tag: str) -> None:
    path = store.root / IDS_FILE
    tmp = path.with_name(f".{IDS_FILE}.{os.getpid()}")
    tmp.write_text(tag + "\n")
    os.replace(tmp, path)
