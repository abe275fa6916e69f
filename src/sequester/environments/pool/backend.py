"""What an :class:`~.core.EpisodePool` asks of its backend: start, drive and close episodes
by id. The pool keeps the ids, the slots, the warm episodes and the waiting callers; a
backend only runs episodes (:mod:`.local`: threads of this process; ``ray``:
:class:`sequester.cluster.pool.RayBackend`, actors across a cluster).

Every method may be called from any thread; the ``a``-prefixed ones from an event loop,
which they never block.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from sequester.errors import PoolFull, SequesterError

__all__ = ["Started", "PoolBackend", "LostCallback"]

# Told by a backend when episodes are lost with what held them (a Ray actor or its node):
# their ids and why. The pool frees their slots and refuses later calls on them.
LostCallback = Callable[[list[str], str], None]


@dataclass(frozen=True)
class Started:
    """An episode a backend started: what its handle shows."""

    instruction: str
    workdir: str
    node_id: str
    actor: int
    calibration: dict[str, Any] = field(default_factory=dict)


class PoolBackend(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def unusable(self) -> type[SequesterError]:
        """The error of a reset on a pool that was shut down, and of a lost episode's calls."""
        ...

    @property
    def full(self) -> type[PoolFull]:
        """The error of a caller that found no slot and could not wait."""
        ...

    @property
    def close_margin(self) -> float:
        """A close waits ``close_grace`` plus this for the backend to answer."""
        ...

    @property
    def capacity(self) -> int:
        """Episodes the backend can hold at once now (warm ones included)."""
        ...

    def prepare(self, folder: Path) -> Any:
        """Before an episode of the task starts, once per start (may block: the Ray
        backend checks the task's calibration and puts its archive in the object store);
        what it returns goes to :meth:`start`."""
        ...

    async def aprepare(self, folder: Path) -> Any: ...

    def start(self, episode_id: str, task_id: str, folder: Path, prepared: Any) -> Started:
        """Start episode ``episode_id`` (blocks). On failure it is closed, then raised."""
        ...

    async def astart(self, episode_id: str, task_id: str, folder: Path, prepared: Any) -> Started:
        """As :meth:`start`; cancelled, the start goes on and the caller must
        :meth:`begin_close` the episode."""
        ...

    def call(self, episode_id: str, method: str, *args: Any) -> Any:
        """``exec``, ``write_file``, ``read_file`` (``(bytes, truncated)``), ``evaluate`` or
        ``checkpoint`` (a dict: ``id``, ``depth``, ``bytes``, ``not_restored``)."""
        ...

    async def acall(self, episode_id: str, method: str, *args: Any) -> Any: ...

    def rollback(self, episode_id: str, source_id: str, checkpoint_id: str) -> None:
        """Start ``episode_id`` again on checkpoint ``checkpoint_id`` of episode ``source_id``."""
        ...

    async def arollback(self, episode_id: str, source_id: str, checkpoint_id: str) -> None: ...

    def release(self, source_id: str, checkpoint_id: str) -> None:
        """Let the checkpoint go (no error when it is gone already)."""
        ...

    def start_fork(self, episode_id: str, task_id: str, source_id: str, checkpoint_id: str) -> Started:
        """Start ``episode_id`` on checkpoint ``checkpoint_id`` of episode ``source_id`` (as :meth:`start`)."""
        ...

    async def astart_fork(self, episode_id: str, task_id: str, source_id: str, checkpoint_id: str) -> Started: ...

    def begin_close(self, episode_id: str) -> Future[None]:
        """Kill what runs in the episode and close it; never blocks. The future is done when
        it is closed (its slot free); at once for an id the backend does not hold."""
        ...

    def shutdown(self, timeout: float) -> None:
        """Close every episode the backend holds and wait for it (at most ``timeout``
        seconds); then nothing more starts."""
        ...

    def actors(self) -> list[Any]:
        """The Ray backend's actors (:class:`sequester.cluster.handle.ActorInfo`); none here."""
        ...

    def init_pid(self, episode_id: str) -> int:
        """Host pid of the episode's init (diagnostics; the local backend only)."""
        ...
