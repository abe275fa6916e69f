"""Which system an episode runs on: the task's prebuilt image, its Dockerfile, or the host.

``--image-source`` (``[images] source``, ``Episode.reset(image_source=...)``):

* ``prebuilt``: the task's ``[environment] docker_image``, from the store or pulled; an
  image that cannot be had is an :class:`ImageError` before any episode starts;
* ``dockerfile``: the task's ``environment/Dockerfile``, built (:mod:`sequester.imagebuild`;
  cached, so only the first episode of a task builds); a build that fails is a
  :class:`~sequester.errors.BuildError`, which ends the trial as an environment error;
* ``host``: the host's own system plus the Dockerfile's ``COPY`` lines (the mode of
  tasks with no image);
* ``auto`` (default): ``prebuilt`` when the task names an image that can be had, else
  its Dockerfile built when its base images can be had, else host mode, with a note
  saying why. A build whose base image can be had but whose step fails is an error, not
  host mode. An image that could not be had is not tried again by the same process for
  two minutes (a job of many trials on one task asks the registry once).

Building is given as ``build`` (a function of the task), so that this module decides
only *which* system, and :mod:`sequester.imagebuild` alone knows how to build one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from sequester.errors import ImageError
from sequester.images.image_settings import IMAGE_SOURCES
from sequester.images.progress import NO_PROGRESS, Progress
from sequester.images.records import ImageRecord
from sequester.images.store import ImageStore
from sequester.tasks import Task

__all__ = ["Choice", "choose_image", "Builder"]

Builder = Callable[[Task], ImageRecord]

_FAILURE_TTL = 120.0
_failed: dict[tuple[str, str], tuple[float, str]] = {}
_failed_lock = threading.Lock()
_fetch_lock = threading.Lock()  # concurrent trials of one task pull its image once


@dataclass(frozen=True)
class Choice:
    record: ImageRecord | None  # None: host mode
    mode: str  # "image" | "host"
    notes: tuple[str, ...] = ()


def choose_image(
    task: Task, source: str, store: ImageStore, *, progress: Progress = NO_PROGRESS, build: Builder | None = None
) -> Choice:
    if source not in IMAGE_SOURCES:
        raise ImageError(f"image source {source!r} is not one of {', '.join(IMAGE_SOURCES)}")
    if source == "host":
        return Choice(None, "host")
    image = task.config.environment.docker_image
    dockerfile = task.environment_dir / "Dockerfile"
    if source == "dockerfile":
        if not dockerfile.is_file():
            raise ImageError(f"task {task.name}: --image-source dockerfile, but it has no environment/Dockerfile")
        if build is None:
            raise ImageError(f"task {task.name}: --image-source dockerfile needs a builder")
        return Choice(build(task), "image", (f"built from the task's Dockerfile ({dockerfile})",))
    if source == "prebuilt":
        if not image:
            raise ImageError(
                f"task {task.name}: --image-source prebuilt, but its task.toml names no [environment] docker_image"
            )
        with _fetch_lock:
            return Choice(store.get(image, progress=progress), "image")
    notes: list[str] = []
    if image:
        earlier = _remembered(store, image)
        if earlier is None:
            try:
                with _fetch_lock:
                    return Choice(store.get(image, progress=progress), "image")
            except ImageError as exc:
                earlier = _remember(store, image, str(exc))
        notes.append(f"the task's image {image} could not be had ({earlier})")
    else:
        notes.append("the task names no image ([environment] docker_image)")
    if dockerfile.is_file() and build is not None:
        from sequester.errors import BuildError

        key = f"dockerfile:{dockerfile}"
        earlier = _remembered(store, key)
        if earlier is None:
            try:
                return Choice(build(task), "image", (*notes, f"built from the task's Dockerfile ({dockerfile})"))
            except BuildError:
                raise  # its base could be had and a step failed: an environment error, not host mode
            except ImageError as exc:  # a base image that cannot be had
                earlier = _remember(store, key, str(exc))
        notes.append(f"its Dockerfile could not be built ({earlier})")
    return Choice(
        None, "host", (*notes[:-1], notes[-1] + ": host mode (the host's system plus the Dockerfile's COPY lines)")
    )


def _remembered(store: ImageStore, what: str) -> str | None:
    """An earlier failure to have ``what``, for a while (a job asks once; a long-running
    server asks again after a registry's bad minute)."""
    with _failed_lock:
        when, message = _failed.get((str(store.root), what), (0.0, None))
    return message if time.monotonic() - when < _FAILURE_TTL else None


def _remember(store: ImageStore, what: str, message: str) -> str:
    with _failed_lock:
        _failed[(str(store.root), what)] = (time.monotonic(), message)
    return message
