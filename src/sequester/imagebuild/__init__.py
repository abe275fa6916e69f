"""Building a task's image from its Dockerfile, without a daemon.

``sequester build`` and ``--image-source dockerfile`` (or ``auto`` with no prebuilt
image) come here. The modules, in the order a build uses them:

* :mod:`sequester.tasks.dockerfile_parse`: the Dockerfile as stages of instructions (anything unsupported is an
  error naming its line, never skipped);
* :mod:`.plan`: each instruction as a step (:mod:`.steps`) with Docker's expansion
  against the base image's config, ``ARG`` and ``ENV``;
* :mod:`sequester.images.build_cache`: every step's key, before anything runs;
* :mod:`.execute` and :mod:`.step_sandbox`: a step that is not cached runs in its own sandbox
  on the layers below it (``RUN`` as the Dockerfile's ``USER``, its network through the
  build proxy of :mod:`sequester.net.build.proxy`); :mod:`.layer` commits what it wrote;
* :mod:`.record`: the result as an image of the store;
* :mod:`.builder` composes them; :mod:`.task_build` builds a task (log, timeout).
"""

from __future__ import annotations

from sequester.errors import BuildError, BuildTimeout
from sequester.imagebuild.builder import BuildOptions, BuildResult, StepReport, build_image
from sequester.imagebuild.task_build import build_task, ensure_built, has_dockerfile, task_image_name

__all__ = [
    "BuildError",
    "BuildTimeout",
    "BuildOptions",
    "BuildResult",
    "StepReport",
    "build_image",
    "build_task",
    "ensure_built",
    "has_dockerfile",
    "task_image_name",
]
