"""Building a task's image from its Dockerfile, without a daemon.

``sequester build`` and ``--image-source dockerfile`` (or ``auto`` with no prebuilt
image) come here. The modules, in the order a build uses them:

* :mod:`.parse`: the Dockerfile as stages of instructions (anything unsupported is an
  error naming its line, never skipped);
* :mod:`.plan`: each instruction as a step (:mod:`.steps`) with Docker's expansion
  against the base image's config, ``ARG`` and ``ENV``;
* :mod:`.cache`: every step's key, before anything runs;
* :mod:`.execute` and :mod:`.sandbox`: a step that is not cached runs in its own sandbox
  on the layers below it (``RUN`` as the Dockerfile's ``USER``, its network through the
  build proxy of :mod:`sequester.net.build.proxy`); :mod:`.layer` commits what it wrote;
* :mod:`.record`: the result as an image of the store;
* :mod:`.builder` composes them; :mod:`.task_build` builds a task (log, timeout).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from sequester.errors import ImageError
from sequester.imagebuild.builder import BuildOptions, BuildResult, StepReport, build_image
from sequester.imagebuild.errors import BuildError, BuildTimeout
from sequester.imagebuild.task_build import build_task, ensure_built, has_dockerfile, task_image_name

__all__ = ["BuildError", "BuildTimeout", "BuildOptions", "BuildResult", "StepReport", "build_image", "build_task",
           "ensure_built", "has_dockerfile", "task_image_name", "prebuild_images", "needs_build"]


def needs_build(task, source: str, store) -> bool:
    """Whether an episode of ``task`` with image source ``source`` builds its Dockerfile."""
    from sequester.images.choose import choose_image
    if source == "dockerfile":
        return True
    if source != "auto" or not has_dockerfile(task):
        return False
    return choose_image(task, "auto", store).mode == "host"  # no prebuilt image could be had


def prebuild_images(tasks, settings, store, log_path: Callable[[str], Path] | None,
                    on_step: Callable[[str, StepReport, bool], None] | None = None) -> dict[str, str]:
    """Build, before any trial starts, the images the ``tasks`` need (each Dockerfile once),
    logging each to ``log_path(task name)``. A build that fails is not raised here: every
    trial of that task ends as an environment error with its message. Returns the
    failures by task name."""
    failures: dict[str, str] = {}
    seen: set[Path] = set()
    for task in tasks:
        dockerfile = task.environment_dir / "Dockerfile"
        if dockerfile in seen or not needs_build(task, settings.images.source, store):
            continue
        seen.add(dockerfile)
        step = (lambda report, done, name=task.name: on_step(name, report, done)) if on_step else None
        try:
            ensure_built(task, store, settings, log_path=log_path(task.name) if log_path else None,
                         on_step=step)
        except BuildError as exc:
            failures[task.name] = str(exc)
        except ImageError as exc:  # a base image that cannot be had: auto goes on to host mode
            if settings.images.source == "dockerfile":
                failures[task.name] = str(exc)
    return failures
