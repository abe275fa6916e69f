"""``sequester run --dry-run``: what a job would do, without doing any of it.

For each task (after the filters): how its system would be had (the task's prebuilt image
already in the store or to be fetched, its Dockerfile built earlier or to be built, or the
host's), the backend, the trials it gets, and its calibration state where the system is
known without fetching or building (else: known once the image is had). Nothing is
fetched, built, run or written; the store and the calibration records are only read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sequester.calibration import CalibrationStore
from sequester.environments.settings import EpisodeSettings, episode_image_store
from sequester.images.choose import Choice
from sequester.jobs.calibrate import calibration_states
from sequester.jobs.images import ImagePlan
from sequester.tasks import Task

__all__ = ["PlannedTask", "plan_job"]


@dataclass(frozen=True)
class PlannedTask:
    task: str
    trials: int
    system: str  # how the task's system would be had
    calibration: str


def plan_job(
    tasks: list[Task],
    settings: EpisodeSettings,
    *,
    n_attempts: int,
    calibration: str,
    runs_here: bool,
    store: CalibrationStore | None = None,
) -> list[PlannedTask]:
    """One row per task (see the module)."""
    images = episode_image_store(settings) if settings.backend == "local" and runs_here else None
    source = settings.images.source
    rows = []
    for task in tasks:
        system, known = _system(task, source, images, settings.backend, runs_here)
        state = "off" if calibration == "off" else "known once the image is had"
        if known is not None or (calibration != "off" and system.startswith("the host")):
            plans: dict[Path, ImagePlan] = {task.path: known if known is not None else Choice(None, "host")}
            found = calibration_states([task], plans, settings, mode=calibration, store=store)[task.path]
            state = found.state + (f" ({found.reason})" if found.reason else "")
        rows.append(PlannedTask(task.name, n_attempts, system, state))
    return rows


def _system(task: Task, source: str, store: object, backend: str, runs_here: bool) -> tuple[str, Choice | None]:
    """How the system would be had, and the choice when it is known now."""
    if backend == "docker":
        return "the Docker engine's (it pulls or builds the image)", None
    if not runs_here:
        return "each cluster node's own (it fetches or builds the image)", None
    from sequester.imagebuild.task_build import task_image_name

    image = task.config.environment.docker_image
    dockerfile = task.environment_dir / "Dockerfile"
    if source == "host":
        return "the host's system (--image-source host)", None
    record = store.find(image) if image else None  # type: ignore[attr-defined]
    built = store.find(task_image_name(task)) if dockerfile.is_file() else None  # type: ignore[attr-defined]
    if source == "prebuilt" or (source == "auto" and image):
        if record is not None:
            return f"image {image}, in the store ({record.short_id})", Choice(record, "image")
        if source == "prebuilt":
            return f"image {image}, to fetch", None
    if source == "dockerfile" or (source == "auto" and dockerfile.is_file()):
        if source == "auto" and image:
            fallback = f"image {image} to fetch; if it cannot be had, "
        else:
            fallback = ""
        last = "; if its base cannot be had, the host's system" if source == "auto" else ""
        if built is not None:
            return f"{fallback}its Dockerfile, built earlier ({built.short_id}; each step rechecked){last}", (
                None if fallback else Choice(built, "image")
            )
        return f"{fallback}its Dockerfile, to build{last}", None
    if source == "auto" and image:
        return f"image {image} to fetch; if it cannot be had, the host's system", None
    return "the host's system (no image, no Dockerfile)", None
