"""The episode pool: episodes held for RL trainers and for ``sequester serve``, warm per
task, with a bounded wait queue at capacity; local (threads of this process) or on Ray.

* :class:`EpisodePool` (:mod:`.core`): the one pool, sync and async; also importable as
  ``sequester.cluster.EpisodePool``;
* :class:`EpisodeHandle` (:mod:`.handle`): what a caller holds of an episode;
* :mod:`.held`: an episode on a thread of its own, and what comes back of it
  (:class:`ExecOutput`, :class:`FileContent`, :class:`Verdict`);
* :mod:`.local`: the local backend; :mod:`.backend`: what the pool asks of a backend.
"""

from __future__ import annotations

from sequester.environments.pool.core import EpisodePool, PoolStats
from sequester.environments.pool.handle import EpisodeHandle
from sequester.environments.pool.held import ExecOutput, FileContent, Verdict
from sequester.errors import PoolFull

__all__ = ["EpisodePool", "EpisodeHandle", "PoolStats", "PoolFull", "ExecOutput", "FileContent", "Verdict"]
