"""The system each task of a job runs on, chosen once before any trial starts.

For every task: its prebuilt image (fetched into the store), its Dockerfile (built, the
build logged in the job's folder), or the host (see :func:`sequester.images.choose.choose_image`).
Each trial is handed its task's :class:`~sequester.images.choose.Choice` and starts its
episode on it: nothing is looked up, fetched or built again per trial. A task whose
image cannot be had gets the error instead, and each of its trials ends with it as an
environment error; with ``--image-source prebuilt``, an image that cannot be had stops
the job before any trial runs. A task the local backend refuses whatever its system (GPUs
this host lacks, Docker Compose services) gets nothing fetched or built: its trials end
with the refusal before anything starts.

Only for episodes of this machine's local backend: a Docker engine pulls and builds its
own images, and a cluster's nodes choose theirs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from sequester.environments.base import missing_capabilities
from sequester.environments.local.episode import local_capabilities
from sequester.environments.settings import EpisodeSettings, episode_image_store
from sequester.errors import BuildError, ImageError
from sequester.imagebuild import StepReport, ensure_built
from sequester.images.choose import Choice, choose_image
from sequester.images.progress import NO_PROGRESS, Progress
from sequester.tasks import Task

__all__ = ["ImagePlan", "choose_job_images"]

# A task's system, or why it cannot be had (its trials end with this error).
ImagePlan = Choice | ImageError


def choose_job_images(
    tasks: list[Task],
    settings: EpisodeSettings,
    *,
    log_path: Callable[[str], Path] | None = None,
    progress: Progress = NO_PROGRESS,
    on_step: Callable[[str, StepReport, bool], None] | None = None,
) -> dict[Path, ImagePlan]:
    """Each task's system, by task folder. An image that cannot be had with ``prebuilt``
    raises :class:`ImageError` here; any other failure is that task's plan."""
    store = episode_image_store(settings)
    source = settings.images.source
    plans: dict[Path, ImagePlan] = {}
    caps = local_capabilities()
    for task in tasks:
        if task.path in plans:
            continue
        if missing_capabilities(caps, task, settings):
            continue  # refused by its trial before anything starts (GPUs, Compose): nothing to fetch or build

        def build(t: Task) -> object:
            step = (lambda report, done: on_step(t.name, report, done)) if on_step else None
            return ensure_built(t, store, settings, log_path=log_path(t.name) if log_path else None, on_step=step)

        try:
            plans[task.path] = choose_image(task, source, store, progress=progress, build=build)  # type: ignore[arg-type]
        except BuildError as exc:
            plans[task.path] = exc
        except ImageError as exc:
            if source == "prebuilt":
                raise
            plans[task.path] = exc
    return plans
