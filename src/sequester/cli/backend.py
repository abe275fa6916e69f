"""``--backend``, ``--docker-host`` and ``--docker-build``: the same flags on ``sequester
run`` and ``sequester serve``, over ``[episodes] backend / docker_host / docker_build``.
``sequester run`` also takes ``--backend ray [--ray-address ADDRESS]``: its trials on a
Ray cluster's nodes (:mod:`sequester.cluster`), each node running its episodes with the
``[episodes] backend`` (local by default)."""

from __future__ import annotations

import argparse
import dataclasses

from sequester.environments.settings import BACKENDS, EpisodeSettings
from sequester.errors import PolicyError

__all__ = ["add_backend_arguments", "apply_backend_arguments", "scheduler_for"]


def add_backend_arguments(p: argparse.ArgumentParser, *, cluster: bool = False) -> None:
    p.add_argument(
        "--backend",
        choices=[*BACKENDS, *(("ray",) if cluster else ())],
        help="what runs each episode: local (namespaces on this host) or docker (a Docker-API engine: "
        "dockerd, podman's service; see --docker-host)"
        + (
            "; ray: the trials on a Ray cluster's nodes (see --ray-address), each running its "
            "episodes as [episodes] backend says"
            if cluster
            else ""
        )
        + "; default: [episodes] backend, local",
    )
    if cluster:
        p.add_argument(
            "--ray-address",
            metavar="ADDRESS",
            help="--backend ray: the cluster (HOST:PORT, auto, ray://HOST:PORT; default: $RAY_ADDRESS, "
            "else a cluster started here with 'ray start', else a new one on this machine)",
        )
    p.add_argument(
        "--docker-host",
        metavar="URL",
        help="the engine for --backend docker (unix:///PATH, tcp://HOST:PORT, ssh://...; "
        "default: [episodes] docker_host, else $DOCKER_HOST, else the engine's default socket)",
    )
    p.add_argument(
        "--docker-build",
        action="store_true",
        help="--backend docker: build each task's environment/Dockerfile with the engine "
        "instead of running its docker_image",
    )


def apply_backend_arguments(args: argparse.Namespace, settings: EpisodeSettings) -> EpisodeSettings:
    if getattr(args, "ray_address", None) is not None and args.backend != "ray":
        raise PolicyError("--ray-address is for --backend ray")
    backend = None if args.backend == "ray" else args.backend  # ray schedules; the episodes' backend stays
    overrides = {"backend": backend, "docker_host": args.docker_host, "docker_build": args.docker_build or None}
    return dataclasses.replace(settings, **{k: v for k, v in overrides.items() if v is not None})


def scheduler_for(args: argparse.Namespace):
    """``--backend ray``: the :class:`~sequester.cluster.RayScheduler` (Ray imported now:
    without it, a :class:`~sequester.cluster.ClusterError` saying how to install it)."""
    if args.backend != "ray":
        return None
    from sequester.cluster.connect import require_ray
    from sequester.cluster.scheduler import RayScheduler

    require_ray()
    return RayScheduler(args.ray_address, args.concurrency)
