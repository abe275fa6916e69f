"""The Docker-API backend: an episode in a container of Docker, or of podman serving the
Docker API (see :mod:`.environment`). Needs the Docker SDK (``pip install 'sequester[docker]'``)."""

from __future__ import annotations

from sequester.environments.docker.environment import CAPABILITIES, DockerEnvironment

__all__ = ["DockerEnvironment", "CAPABILITIES"]
