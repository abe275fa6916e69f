"""The episode pool's local backend: episodes in this process, each on a thread of its own.

Each episode is a :class:`~.held.HeldEpisode` (an :class:`~sequester.environments.Environment`
from :func:`~sequester.environments.open_environment`, ``[episodes] backend``: the local
namespaces, or a Docker engine) started and driven on its own thread. A synchronous call
waits on a :class:`concurrent.futures.Future`; an asynchronous one on an
:class:`asyncio.Future` the episode's thread settles, so the event loop never blocks.
Ray is not imported.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Any

from sequester.environments.pool.backend import Started
from sequester.environments.pool.held import HeldEpisode
from sequester.environments.settings import EpisodeSettings
from sequester.errors import EpisodeError, PoolFull

__all__ = ["LocalBackend"]

log = logging.getLogger("sequester.environments.pool")

_NODE = "local"


def _done() -> Future[None]:
    future: Future[None] = Future()
    future.set_result(None)
    return future


class LocalBackend:
    """Up to ``capacity`` episodes of ``settings`` in this process; ``hide``: what no agent
    sees (the tasks folder among it); ``calibration``: checked for the system each episode
    got (see :meth:`HeldEpisode.start`)."""

    name = "local"
    unusable = EpisodeError
    full = PoolFull
    close_margin = 0.0  # a close waits close_grace for an interrupted call, here

    def __init__(
        self,
        settings: EpisodeSettings,
        hide: tuple[Path, ...],
        capacity: int,
        read_cap: int,
        close_grace: float,
        calibration: str,
    ):
        self.settings, self._hide = settings, hide
        self._capacity, self._read_cap, self._grace = capacity, read_cap, close_grace
        self._calibration = calibration
        self._episodes: dict[str, HeldEpisode] = {}
        self._closing: dict[Future[None], HeldEpisode] = {}  # closes in flight (shutdown waits for them too)
        self._lock = threading.Lock()
        self._shut = False

    @property
    def capacity(self) -> int:
        return self._capacity

    def prepare(self, folder: Path) -> None:
        return None  # (the calibration is checked once the episode has its system)

    async def aprepare(self, folder: Path) -> None:
        return None

    def _hold(self, episode_id: str, task_id: str) -> HeldEpisode:
        with self._lock:
            if self._shut:
                raise EpisodeError("the episode pool was shut down")
            if episode_id in self._episodes:
                raise EpisodeError(f"episode {episode_id}: already held")
            held = self._episodes[episode_id] = HeldEpisode(episode_id, task_id)
            return held

    def _drop(self, episode_id: str) -> HeldEpisode | None:
        with self._lock:
            return self._episodes.pop(episode_id, None)

    def _started(self, got: tuple[str, str, dict[str, Any]]) -> Started:
        instruction, workdir, calibration = got
        return Started(instruction, workdir, _NODE, -1, calibration)

    def start(self, episode_id: str, task_id: str, folder: Path, prepared: Any) -> Started:
        held = self._hold(episode_id, task_id)
        try:
            got = held.thread.call(held.start, folder, self.settings, self._hide, self._calibration)
        except BaseException:
            if self._drop(episode_id) is not None:
                held.shutdown(self._grace)
            raise
        return self._started(got)

    async def astart(self, episode_id: str, task_id: str, folder: Path, prepared: Any) -> Started:
        held = self._hold(episode_id, task_id)
        try:
            got = await held.thread.asubmit(held.start, folder, self.settings, self._hide, self._calibration)
        except Exception:  # it did not start: closed on its thread, without blocking the loop
            if self._drop(episode_id) is not None:
                held.begin_close()
            raise
        return self._started(got)

    def _held(self, episode_id: str) -> HeldEpisode:
        with self._lock:
            held = self._episodes.get(episode_id)
        if held is None:
            raise EpisodeError(f"episode {episode_id}: not held (closed, or never started)")
        return held

    def call(self, episode_id: str, method: str, *args: Any) -> Any:
        held = self._held(episode_id)
        if method == "read_file":
            args = (*args, self._read_cap)
        return held.thread.call(getattr(held, method), *args)

    async def acall(self, episode_id: str, method: str, *args: Any) -> Any:
        held = self._held(episode_id)
        if method == "read_file":
            args = (*args, self._read_cap)
        return await held.thread.asubmit(getattr(held, method), *args)

    # -- checkpoints: the Checkpoint object stays with the episode that made it -----------
    def rollback(self, episode_id: str, source_id: str, checkpoint_id: str) -> None:
        held = self._held(episode_id)
        cp = self._held(source_id).held_checkpoint(checkpoint_id)
        held.thread.call(held.rollback, cp)

    async def arollback(self, episode_id: str, source_id: str, checkpoint_id: str) -> None:
        held = self._held(episode_id)
        cp = self._held(source_id).held_checkpoint(checkpoint_id)
        await held.thread.asubmit(held.rollback, cp)

    def release(self, source_id: str, checkpoint_id: str) -> None:
        with self._lock:
            held = self._episodes.get(source_id)
        if held is not None:
            held.release(checkpoint_id)

    def start_fork(self, episode_id: str, task_id: str, source_id: str, checkpoint_id: str) -> Started:
        cp = self._held(source_id).held_checkpoint(checkpoint_id)
        held = self._hold(episode_id, task_id)
        try:
            got = held.thread.call(held.start_from, cp, self.settings, self._hide)
        except BaseException:
            if self._drop(episode_id) is not None:
                held.shutdown(self._grace)
            raise
        return self._started((*got, {"state": "fork", "checkpoint": f"{source_id}-{checkpoint_id}"}))

    async def astart_fork(self, episode_id: str, task_id: str, source_id: str, checkpoint_id: str) -> Started:
        cp = self._held(source_id).held_checkpoint(checkpoint_id)
        held = self._hold(episode_id, task_id)
        try:
            got = await held.thread.asubmit(held.start_from, cp, self.settings, self._hide)
        except Exception:
            if self._drop(episode_id) is not None:
                held.begin_close()
            raise
        return self._started((*got, {"state": "fork", "checkpoint": f"{source_id}-{checkpoint_id}"}))

    def begin_close(self, episode_id: str) -> Future[None]:
        held = self._drop(episode_id)
        if held is None:
            return _done()
        closing = held.begin_close()
        with self._lock:
            self._closing[closing] = held
        closing.add_done_callback(self._closed)
        return closing

    def _closed(self, closing: Future[None]) -> None:
        with self._lock:
            self._closing.pop(closing, None)

    def shutdown(self, timeout: float) -> None:
        with self._lock:
            self._shut = True
            held, self._episodes = list(self._episodes.values()), {}
            closing = dict(self._closing)  # (the callers' closes in flight)
        closing.update({h.begin_close(): h for h in held})
        _, late = wait(closing, timeout)
        for future, h in closing.items():
            if future in late:
                log.warning("episode %s: not closed within %g s; it closes when its call ends", h.id, timeout)
            elif future.exception() is not None:
                log.error("episode %s was not closed cleanly: %s", h.id, future.exception())
            else:
                h.thread.join(5)  # it ends right after the close

    def actors(self) -> list[Any]:
        return []

    def init_pid(self, episode_id: str) -> int:
        env = self._held(episode_id).env
        pid = getattr(env, "init_pid", None)
        if not isinstance(pid, int):
            raise EpisodeError(f"episode {episode_id}: its environment has no init on this host")
        return pid
