"""``--backend``, ``--docker-host`` and ``--docker-build``: the same flags on ``sequester
run`` and ``sequester serve``, over ``[episodes] backend / docker_host / docker_build``."""

from __future__ import annotations

import argparse
import dataclasses

from .episodes.settings import BACKENDS, EpisodeSettings

__all__ = ["add_backend_arguments", "apply_backend_arguments"]


def add_backend_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=list(BACKENDS),
                   help="what runs each episode: local (namespaces on this host) or docker (a Docker-API engine: "
                        "dockerd, podman's service; see --docker-host); default: [episodes] backend, local")
    p.add_argument("--docker-host", metavar="URL",
                   help="the engine for --backend docker (unix:///PATH, tcp://HOST:PORT, ssh://...; "
                        "default: [episodes] docker_host, else $DOCKER_HOST, else the engine's default socket)")
    p.add_argument("--docker-build", action="store_true",
                   help="--backend docker: build each task's environment/Dockerfile with the engine "
                        "instead of running its docker_image")


def apply_backend_arguments(args: argparse.Namespace, settings: EpisodeSettings) -> EpisodeSettings:
    overrides = {"backend": args.backend, "docker_host": args.docker_host, "docker_build": args.docker_build or None}
    return dataclasses.replace(settings, **{k: v for k, v in overrides.items() if v is not None})
