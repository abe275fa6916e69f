"""Scale-out on Ray: a job's trials on a cluster's nodes, and a pool of episodes for trainers.

* :class:`RayScheduler` (``sequester run --backend ray [--ray-address ADDRESS]``): each
  trial is a Ray task asking for the CPUs and memory its ``task.toml`` declares; the task
  folder travels through the object store (:mod:`.bundles`), the node runs the trial as
  the local runner would (:mod:`.node`), and the trial's folder comes back to the driver,
  which writes the job folder (:mod:`.landing`). A trial lost with its worker or node is
  retried once on another node, and the retry is recorded in its ``result.json``.
* :class:`EpisodePool`: the one episode pool
  (:class:`sequester.environments.pool.EpisodePool`, kept importable here); with
  ``backend="ray"`` (or ``EpisodePool(n_actors, tasks_dir)``) its episodes are held by
  actors across the cluster (:mod:`.pool`: ``reset`` / ``exec`` / ``evaluate`` / ``close``
  routed to the actor holding the episode, sync and async).

Ray is imported only when one of them is used (:mod:`.connect`).
"""

from __future__ import annotations

from typing import Any

from sequester.cluster.connect import ClusterError

__all__ = ["ClusterError", "RayScheduler", "EpisodePool"]


def __getattr__(name: str) -> Any:  # the classes that need Ray load it only when named
    if name == "RayScheduler":
        from sequester.cluster.scheduler import RayScheduler

        return RayScheduler
    if name == "EpisodePool":
        from sequester.environments.pool import EpisodePool

        return EpisodePool
    raise AttributeError(name)
