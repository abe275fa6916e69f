"""The error of the build family: a Dockerfile sequester cannot build, and why.

A subclass of :class:`sequester.errors.ImageError` because a build is one more way of
getting an image: code that already catches ``ImageError`` (the CLI, an episode's image
resolution) then catches build failures too, without knowing about builds.
"""

from __future__ import annotations

from sequester.errors import ImageError

__all__ = ["BuildError", "BuildTimeout"]


class BuildError(ImageError):
    """A Dockerfile that is malformed, or asks for something sequester does not do.

    The message starts with ``"<source>:<line>: "`` and names the instruction, e.g.
    ``Dockerfile:4: RUN --mount is a BuildKit feature sequester does not support``.
    """


class BuildTimeout(BuildError):
    """The build outlived its deadline (the task's ``[environment] build_timeout_sec``)."""
