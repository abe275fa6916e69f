"""The episode actor of an :class:`~.pool.EpisodePool`: up to ``capacity`` episodes on one node.

Plain Python (Ray is imported only to fetch a task's archive and name the node): the pool
wraps :class:`EpisodeActor` with ``ray.remote`` as a *threaded* actor, so many episodes'
calls run at once. Each episode still runs on **one long-lived thread of its own**
(:class:`_Thread`): its sandboxes die with the thread that started them
(``bwrap --die-with-parent``, ``PR_SET_PDEATHSIG``), and Ray's method threads may come and
go, so an episode is started and driven only on its own thread; a Ray method call queues
its work there and blocks on a :class:`concurrent.futures.Future`. One episode's calls thus
run in order (an :class:`~sequester.environments.Environment` is not thread-safe), and a
killed actor process takes every sandbox of its episodes with it.

What comes back is bounded and never teaches the tests: ``exec`` output is capped by the
episode's settings (``output_bytes``), ``read_file`` by ``read_cap``, and ``evaluate``
returns the verdict only (see :class:`Verdict`).
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from sequester.cluster.bundles import hold_task
from sequester.cluster.connect import ClusterError, ray_dirs, require_ray
from sequester.cluster.node import cluster_cache, settings_for_node
from sequester.environments.base import ExecResult
from sequester.environments.settings import EpisodeSettings
from sequester.environments.verdict import VerifierError
from sequester.errors import EpisodeError

if TYPE_CHECKING:
    from sequester.environments import Environment

__all__ = ["EpisodeActor", "ExecOutput", "Verdict", "FileContent", "READ_CAP", "CLOSE_GRACE"]

log = logging.getLogger("sequester.cluster")

T = TypeVar("T")
READ_CAP = 16 << 20  # bytes of one read_file that come back (the rest is cut: ``truncated``)
CLOSE_GRACE = 30.0  # seconds a close waits for an interrupted call to give way
_MAX_TASKS = 4096  # unpacked task folders remembered per actor (by archive digest)


# One command's result, as the episode gave it (output capped by ``output_bytes``).
ExecOutput = ExecResult


@dataclass(frozen=True)
class Verdict:
    """The verdict of an episode and nothing else: no test output, no files the tests left
    (a trainer may hand what it gets to the model, and those would teach it the tests).
    ``error`` is set (and ``reward`` None) only when the verifier could not run."""

    reward: float | None
    rewards: dict[str, float] = field(default_factory=dict)
    zero_reason: str | None = None
    tampering: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    error: str | None = None


class FileContent(bytes):
    """A file's bytes, at most ``read_cap`` of them; ``truncated``: the file was longer.
    (Made on the driver: Ray ships a subclass of bytes as plain bytes.)"""

    truncated: bool = False

    @classmethod
    def of(cls, read: tuple[bytes, bool]) -> FileContent:
        content = cls(read[0])
        content.truncated = read[1]
        return content


class _Thread:
    """An episode's own thread: runs its calls in order, each answered on a Future (the
    synchronous twin of ``serve.sessions._Worker``). It lives until :meth:`stop`, like the
    sandboxes it starts."""

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self.running = 0  # calls submitted and not finished
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            self.running += 1
        self._queue.put((future, fn, args))
        return future

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        return self.submit(fn, *args).result()

    def stop(self) -> None:
        """End the thread after the calls already queued."""
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(*args))
                    except BaseException as exc:  # noqa: BLE001 - the caller's to see
                        future.set_exception(exc)
            finally:
                with self._lock:
                    self.running -= 1


class _Held:
    """One episode of the actor: its thread, its environment, whether it was evaluated."""

    def __init__(self, episode_id: str, task_name: str):
        self.id, self.task_name = episode_id, task_name
        self.thread = _Thread(f"episode-{episode_id[:12]}")
        self.env: Environment | None = None
        self.evaluated = False

    # -- on the episode's thread -------------------------------------------------------
    def start(self, folder: Path, settings: EpisodeSettings, hide: tuple[Path, ...]) -> tuple[str, str]:
        from sequester.environments import UnsupportedByBackend, missing_capabilities, open_environment
        from sequester.sandbox.nsexec.client import shared_nsexec
        from sequester.tasks import load_task

        task = load_task(folder)
        # One namespace helper for the process, kept by a thread of its own (it dies with
        # the thread that starts it; this one ends with the episode).
        nsexec = shared_nsexec() if settings.backend == "local" else None
        env = open_environment(settings, hide=hide, nsexec=nsexec)
        missing = missing_capabilities(env.capabilities, task, env.settings)
        if missing:  # before anything starts, naming what is missing
            raise UnsupportedByBackend("; ".join(missing))
        self.env = env
        env.start(task)
        return env.instruction, env.workdir

    def _env(self) -> Environment:
        if self.env is None:
            raise EpisodeError(f"episode {self.id}: it is not running")
        # Attack stopped: probing the hidden tests by trial and error within one episode
        # (change the work, evaluate, look at the reward, repeat). The verdict is final.
        if self.evaluated:
            raise EpisodeError(
                f"episode {self.id}: it was evaluated; its verdict is final (close it and reset for a new episode)"
            )
        return self.env

    def exec(self, command: str, timeout: float | None) -> ExecOutput:
        r = self._env().exec(command, timeout)
        return r

    def write_file(self, path: str, data: bytes | str, mode: int) -> int:
        self._env().write_file(path, data, mode=mode)
        return len(data.encode() if isinstance(data, str) else data)

    def read_file(self, path: str, cap: int) -> tuple[bytes, bool]:
        data = self._env().read_file(path)
        return data[:cap], len(data) > cap

    def evaluate(self) -> Verdict:
        env = self._env()
        self.evaluated = True  # final even when the verifier fails (see _env)
        try:
            result = env.evaluate()
        except VerifierError as exc:  # no verdict: the trial is an error, not a 0
            return Verdict(None, {}, None, tuple(exc.tampering), (), str(exc))
        return Verdict(
            result.reward, dict(result.rewards), result.zero_reason, tuple(result.tampering), tuple(result.notes), None
        )

    def close_env(self) -> None:
        if self.env is not None:
            self.env.close()

    # -- from any thread ---------------------------------------------------------------
    def shutdown(self, grace: float) -> None:
        """Kill what runs, then close on the episode's thread and end it. A call that does
        not give way within ``grace`` seconds is left to finish (the close runs after it)."""
        try:
            if self.thread.running and self.env is not None:
                self.env.abort()  # every process of the episode is killed: a call in flight ends
            self.thread.submit(self.close_env).result(grace)
        except FutureTimeout:
            log.warning("episode %s: a call did not stop within %g s; it closes when the call ends", self.id, grace)
        except Exception as exc:  # noqa: BLE001 - a failed cleanup is the operator's, not the trainer's
            log.error("episode %s was not closed cleanly: %s", self.id, exc)
        finally:
            self.thread.stop()


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
        self._episodes: dict[str, _Held] = {}
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
            held = self._episodes[episode_id] = _Held(episode_id, task_name)
        try:
            folder = self._folder(digest, refs)
            instruction, workdir = held.thread.call(held.start, folder, self._settings, self._hide)
        except BaseException:
            with self._lock:
                self._episodes.pop(episode_id, None)
            held.shutdown(self._grace)
            raise
        log.info("episode %s: started on task %s", episode_id, task_name)
        return instruction, workdir

    def _held(self, episode_id: str) -> _Held:
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
