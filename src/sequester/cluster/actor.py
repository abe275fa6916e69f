"""The episode actor of the Ray backend of an :class:`~sequester.environments.pool.EpisodePool`:
up to ``capacity`` episodes on one node.

Plain Python (Ray is imported only to fetch a task's archive and name the node): the pool
wraps :class:`EpisodeActor` with ``ray.remote`` as a *threaded* actor, so many episodes'
calls run at once. Each episode is a :class:`~sequester.environments.pool.held.HeldEpisode`,
as in the pool's local backend: it runs on **one long-lived thread of its own** (its
sandboxes die with the thread that started them, ``bwrap --die-with-parent``,
``PR_SET_PDEATHSIG``, and Ray's method threads may come and go), and a Ray method call
queues its work there and blocks on a :class:`concurrent.futures.Future`. One episode's
calls thus run in order (an :class:`~sequester.environments.Environment` is not
thread-safe), and a killed actor process takes every sandbox of its episodes with it.

What comes back is bounded and never teaches the tests: ``exec`` output is capped by the
episode's settings (``output_bytes``), ``read_file`` by ``read_cap``, and ``evaluate``
returns the verdict only (see :class:`Verdict`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from pathlib import Path
from typing import Any

from sequester.cluster.bundles import hold_task
from sequester.cluster.connect import ClusterError, ray_dirs, require_ray
from sequester.cluster.node import cluster_cache, settings_for_node
from sequester.environments.pool.held import CLOSE_GRACE, READ_CAP, ExecOutput, FileContent, HeldEpisode, Verdict
from sequester.environments.settings import EpisodeSettings
from sequester.errors import EpisodeError

__all__ = ["EpisodeActor", "ExecOutput", "Verdict", "FileContent", "READ_CAP", "CLOSE_GRACE"]

log = logging.getLogger("sequester.cluster")

_MAX_TASKS = 4096  # unpacked task folders remembered per actor (by archive digest)


class EpisodeActor:
    """Up to ``capacity`` episodes on this node (see module doc). ``settings`` are the
    driver's, ``defaulted`` the paths to replace by this node's defaults, ``hide`` what the
    driver hides (its tasks folder); this node's task cache and Ray's folders are hidden too."""

    def __init__(
        self,
        settings: EpisodeSettings,
        defaulted: frozenset[str],
        hide: tuple[str, ...],
        capacity: int,
        read_cap: int = READ_CAP,
        close_grace: float = CLOSE_GRACE,
    ):
        self._settings = settings_for_node(settings, defaulted)
        self._tasks_root = cluster_cache() / "tasks"
        # Hidden from every agent here: the driver's tasks folder (other tasks' tests and
        # solutions, when it is shared), this node's cache of shipped tasks (the same), and
        # Ray's session folder (spilled objects: task archives among them).
        self._hide = tuple(dict.fromkeys([*(Path(p) for p in hide), cluster_cache(), *ray_dirs()]))
        self._capacity, self._read_cap, self._grace = capacity, read_cap, close_grace
        self._episodes: dict[str, HeldEpisode] = {}
        self._folders: dict[str, tuple[Path, int]] = {}  # archive digest -> the task's folder here, held
        self._lock = threading.Lock()

    def ready(self) -> dict[str, Any]:
        """Where this actor runs (the pool waits for it before the first reset)."""
        ray = require_ray()
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
        }

    def held(self) -> list[str]:
        with self._lock:
            return list(self._episodes)

    def _folder(self, digest: str, refs: list[Any]) -> Path:
        """The task's folder on this node, its archive fetched only the first time."""
        with self._lock:
            entry = self._folders.get(digest)
        if entry is None:
            bundle = require_ray().get(refs[0])
            if bundle.digest != digest:
                raise ClusterError(f"task {bundle.name}: the archive sent is not the one named")
            # Held while this actor may start episodes on it: the node's cache never
            # evicts a task an episode here still reads its tests from.
            folder, fd = hold_task(bundle, self._tasks_root)
            with self._lock:
                if digest in self._folders:
                    os.close(fd)
                    return self._folders[digest][0]
                if len(self._folders) >= _MAX_TASKS:
                    os.close(self._folders.pop(next(iter(self._folders)))[1])
                self._folders[digest] = (folder, fd)
            return folder
        return entry[0]

    def reset(self, episode_id: str, task_name: str, digest: str, refs: list[Any]) -> tuple[str, str]:
        """Start episode ``episode_id``; its instruction and working directory."""
        with self._lock:
            if episode_id in self._episodes:
                raise EpisodeError(f"episode {episode_id}: already held by this actor")
            if len(self._episodes) >= self._capacity:  # the driver counts too; this holds if it miscounts
                raise ClusterError(f"this actor holds {self._capacity} episodes already (episodes_per_actor)")
            held = self._episodes[episode_id] = HeldEpisode(episode_id, task_name)
        try:
            folder = self._folder(digest, refs)
            instruction, workdir, _ = held.thread.call(held.start, folder, self._settings, self._hide)
        except BaseException:
            with self._lock:
                self._episodes.pop(episode_id, None)
            held.shutdown(self._grace)
            raise
        log.info("episode %s: started on task %s", episode_id, task_name)
        return instruction, workdir

    def _held(self, episode_id: str) -> HeldEpisode:
        with self._lock:
            held = self._episodes.get(episode_id)
        if held is None:
            raise EpisodeError(f"episode {episode_id}: not held by this actor (closed, or never reset here)")
        return held

    def exec(self, episode_id: str, command: str, timeout: float | None = None) -> ExecOutput:
        held = self._held(episode_id)
        return held.thread.call(held.exec, command, timeout)

    def write_file(self, episode_id: str, path: str, data: bytes | str, mode: int = 0o644) -> int:
        held = self._held(episode_id)
        return held.thread.call(held.write_file, path, data, mode)

    def read_file(self, episode_id: str, path: str) -> tuple[bytes, bool]:
        held = self._held(episode_id)
        return held.thread.call(held.read_file, path, self._read_cap)

    def evaluate(self, episode_id: str) -> Verdict:
        held = self._held(episode_id)
        verdict = held.thread.call(held.evaluate)
        log.info("episode %s: evaluated, reward %s", episode_id, verdict.reward)
        return verdict

    def checkpoint(self, episode_id: str) -> dict[str, Any]:
        held = self._held(episode_id)
        return held.thread.call(held.checkpoint)

    def rollback_to(self, episode_id: str, source_id: str, checkpoint_id: str) -> str:
        held = self._held(episode_id)
        cp = self._held(source_id).held_checkpoint(checkpoint_id)
        return held.thread.call(held.rollback, cp)

    def release(self, source_id: str, checkpoint_id: str) -> bool:
        with self._lock:
            held = self._episodes.get(source_id)
        return held.release(checkpoint_id) if held is not None else False

    def fork(self, episode_id: str, task_name: str, source_id: str, checkpoint_id: str) -> tuple[str, str]:
        """Start episode ``episode_id`` on a checkpoint of episode ``source_id`` (both this actor's)."""
        cp = self._held(source_id).held_checkpoint(checkpoint_id)
        with self._lock:
            if episode_id in self._episodes:
                raise EpisodeError(f"episode {episode_id}: already held by this actor")
            if len(self._episodes) >= self._capacity:
                raise ClusterError(f"this actor holds {self._capacity} episodes already (episodes_per_actor)")
            held = self._episodes[episode_id] = HeldEpisode(episode_id, task_name)
        try:
            got = held.thread.call(held.start_from, cp, self._settings, self._hide)
        except BaseException:
            with self._lock:
                self._episodes.pop(episode_id, None)
            held.shutdown(self._grace)
            raise
        log.info("episode %s: forked from a checkpoint of %s", episode_id, source_id)
        return got

    def close(self, episode_id: str) -> bool:
        """Close the episode (False: it was not held). Later calls on it are refused at once."""
        with self._lock:
            held = self._episodes.pop(episode_id, None)
        if held is None:
            return False
        held.shutdown(self._grace)
        log.info("episode %s: closed", episode_id)
        return True

    def close_all(self) -> int:
        """Close every episode (each on its own thread, all at once); how many there were."""
        with self._lock:
            held, self._episodes = list(self._episodes.values()), {}
        closers = [threading.Thread(target=h.shutdown, args=(self._grace,), daemon=True) for h in held]
        for t in closers:
            t.start()
        for t in closers:
            t.join(self._grace + 5)
        return len(held)
