"""Which system an episode runs on: the task's prebuilt image, its Dockerfile, or the host.

``--image-source`` (``[images] source``, ``Episode.reset(image_source=...)``):

* ``prebuilt``: the task's ``[environment] docker_image``, from the store or pulled; an
  image that cannot be had is an :class:`ImageError` before any episode starts;
* ``dockerfile``: the task's Dockerfile, built (not available yet: an :class:`ImageError`
  saying so; until then ``auto`` goes on to host mode);
* ``host``: the host's own system plus the Dockerfile's ``COPY`` lines (the mode of
  tasks with no image);
* ``auto`` (default): ``prebuilt`` when the task names an image that can be had, else
  host mode, with a note saying why. An image that could not be had is not tried again
  by the same process (a job of many trials on one task asks the registry once).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ..errors import ImageError
from ..tasks import Task
from .progress import NO_PROGRESS, Progress
from .records import ImageRecord
from .settings import IMAGE_SOURCES
from .store import ImageStore

__all__ = ["Choice", "choose_image", "prefetch_images"]

_failed: dict[tuple[str, str], str] = {}
_failed_lock = threading.Lock()
_fetch_lock = threading.Lock()  # concurrent trials of one task pull its image once


@dataclass(frozen=True)
class Choice:
    record: ImageRecord | None  # None: host mode
    mode: str  # "image" | "host"
    notes: tuple[str, ...] = ()


def choose_image(task: Task, source: str, store: ImageStore, *, progress: Progress = NO_PROGRESS) -> Choice:
    if source not in IMAGE_SOURCES:
        raise ImageError(f"image source {source!r} is not one of {', '.join(IMAGE_SOURCES)}")
    if source == "host":
        return Choice(None, "host")
    image = task.config.environment.docker_image
    if source == "dockerfile":
        raise ImageError(f"task {task.name}: --image-source dockerfile: building a task's Dockerfile without a "
                         "daemon is not available yet; use prebuilt (the task's docker_image) or host")
    if source == "prebuilt":
        if not image:
            raise ImageError(f"task {task.name}: --image-source prebuilt, but its task.toml names no "
                             "[environment] docker_image")
        with _fetch_lock:
            return Choice(store.get(image, progress=progress), "image")
    if not image:
        return Choice(None, "host", ("the task names no image ([environment] docker_image): host mode",))
    key = (str(store.root), image)
    with _failed_lock:
        earlier = _failed.get(key)
    if earlier is None:
        try:
            with _fetch_lock:
                return Choice(store.get(image, progress=progress), "image")
        except ImageError as exc:
            earlier = str(exc)
            with _failed_lock:
                _failed[key] = earlier
    return Choice(None, "host", (f"the task's image {image} could not be had ({earlier}): host mode "
                                 "(the host's system plus the Dockerfile's COPY lines)",))


def prefetch_images(tasks: list[Task], source: str, store: ImageStore, *, progress: Progress = NO_PROGRESS) -> None:
    """Have every image the ``tasks`` will run on before any of them starts: with
    ``prebuilt``, an image that cannot be had raises :class:`ImageError` here; with
    ``auto``, it is remembered, and its trials run in host mode with the note."""
    if source not in ("prebuilt", "auto"):
        return
    seen: set[str] = set()
    for task in tasks:
        image = task.config.environment.docker_image
        if image and image not in seen:
            seen.add(image)
            choose_image(task, source, store, progress=progress)
