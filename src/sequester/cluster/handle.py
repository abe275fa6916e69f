"""What a trainer holds of an :class:`~sequester.environments.pool.EpisodePool` on Ray:
an episode's handle (kept here under its old path; it is the pool's own,
:class:`~sequester.environments.pool.handle.EpisodeHandle`) and an actor's facts."""

from __future__ import annotations

from dataclasses import dataclass

from sequester.environments.pool.handle import EpisodeHandle

__all__ = ["ActorInfo", "EpisodeHandle"]


@dataclass(frozen=True)
class ActorInfo:
    """One actor of the pool: where it runs and how many episodes it holds (diagnostics)."""

    index: int
    node_id: str
    pid: int
    hostname: str
    alive: bool
    episodes: int
