"""Environments: what runs an episode, behind one interface (:mod:`.base`).

:func:`open_environment` is the one place that picks a backend from the settings
(``[episodes] backend``): the job runner and the server call it and nothing else.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from sequester.environments.base import Capabilities, Environment, UnsupportedByBackend, missing_capabilities

if TYPE_CHECKING:
    from sequester.environments.settings import EpisodeSettings
    from sequester.sandbox.nsexec.client import NsExec

__all__ = ["Capabilities", "Environment", "UnsupportedByBackend", "missing_capabilities", "open_environment"]


def open_environment(
    settings: EpisodeSettings, *, hide: Iterable[str | os.PathLike[str]] = (), nsexec: NsExec | None = None
) -> Environment:
    """A new, not yet started environment of ``settings.backend``."""
    if settings.backend == "docker":
        from sequester.environments.docker import DockerEnvironment  # the Docker SDK is only needed here

        return DockerEnvironment(settings, base_url=settings.docker_host, build=settings.docker_build, hide=hide)
    from sequester.environments.local.episode import Episode

    return Episode(settings, hide=hide, nsexec=nsexec)
