"""One episode of a pool on a long-lived thread of its own, and what comes back of it.

An episode's sandboxes die with the thread that started them (``bwrap --die-with-parent``,
``PR_SET_PDEATHSIG``), and an :class:`~sequester.environments.Environment` is not
thread-safe, so a pooled episode is started and driven only on **its own thread**
(:class:`EpisodeThread`): a call queues its work there and waits on a future (a
:class:`concurrent.futures.Future` for a thread, an :class:`asyncio.Future` settled on
the caller's loop for a coroutine, so that an event loop never blocks). One episode's
calls thus run in order, and the thread lives until the episode is closed.

:class:`HeldEpisode` is what both of the pool's backends hold per episode: the local one
in this process (:mod:`.local`), the Ray one in its actors (:mod:`sequester.cluster.actor`).

What comes back is bounded and never teaches the tests: ``exec`` output is capped by the
episode's settings (``output_bytes``), ``read_file`` by ``read_cap``, and ``evaluate``
returns the verdict only (:class:`Verdict`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from sequester.environments.base import ExecResult, UnsupportedByBackend
from sequester.environments.local.checkpoint import Checkpoint, CheckpointError
from sequester.environments.settings import EpisodeSettings
from sequester.environments.verdict import VerifierError
from sequester.errors import EpisodeError

if TYPE_CHECKING:
    from sequester.environments import Environment

__all__ = ["EpisodeThread", "HeldEpisode", "ExecOutput", "Verdict", "FileContent", "READ_CAP", "CLOSE_GRACE"]

log = logging.getLogger("sequester.environments.pool")

T = TypeVar("T")
READ_CAP = 16 << 20  # bytes of one read_file that come back (the rest is cut: ``truncated``)
CLOSE_GRACE = 30.0  # seconds a close waits for an interrupted call to give way
_MAX_CHECKPOINTS = 64  # held by one episode at once (each is bounded too: checkpoint_depth, _disk_mb)


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
    (Made where the caller is: Ray ships a subclass of bytes as plain bytes.)"""

    truncated: bool = False

    @classmethod
    def of(cls, read: tuple[bytes, bool]) -> FileContent:
        content = cls(read[0])
        content.truncated = read[1]
        return content


def _settle(future: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if not future.done():
        future.set_result(value) if ok else future.set_exception(value)


class EpisodeThread:
    """An episode's own thread: runs its calls in order, each answered on a future. It
    lives until :meth:`stop`, like the sandboxes it starts."""

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue[tuple[Any, Callable[..., Any], tuple[Any, ...]] | None] = queue.SimpleQueue()
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

    def asubmit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """The call, answered on the running loop (one queue put here, one
        ``call_soon_threadsafe`` there: no executor in between)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._lock:
            self.running += 1
        self._queue.put(((loop, future), fn, args))
        return future

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        return self.submit(fn, *args).result()

    def stop(self) -> None:
        """End the thread after the calls already queued."""
        self._queue.put(None)

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            target, fn, args = item
            try:
                if isinstance(target, Future):
                    if target.set_running_or_notify_cancel():
                        try:
                            target.set_result(fn(*args))
                        except BaseException as exc:  # noqa: BLE001 - the caller's to see
                            target.set_exception(exc)
                    continue
                loop, future = target
                try:
                    ok, value = True, fn(*args)
                except BaseException as exc:  # noqa: BLE001 - the caller's to see
                    ok, value = False, exc
                try:
                    loop.call_soon_threadsafe(_settle, future, ok, value)
                except RuntimeError:  # the loop is closed: nobody is waiting any more
                    pass
            finally:
                with self._lock:
                    self.running -= 1


class HeldEpisode:
    """One episode: its thread, its environment, whether it was evaluated."""

    def __init__(self, episode_id: str, task_name: str):
        self.id, self.task_name = episode_id, task_name
        self.thread = EpisodeThread(f"episode-{episode_id[:12]}")
        self.env: Environment | None = None
        self.evaluated = False
        self.aborted = False
        # The checkpoints this episode made (sequester.environments.local.checkpoint), by
        # their ids: released when it closes (episodes started on one keep its layers).
        self.checkpoints: dict[str, Checkpoint] = {}

    # -- on the episode's thread -------------------------------------------------------
    def start(
        self, folder: Path, settings: EpisodeSettings, hide: tuple[Path, ...], calibration: str | None = None
    ) -> tuple[str, str, dict[str, Any]]:
        """Start the episode: its instruction, working directory and calibration state.
        ``calibration`` (``auto``, ``required``, ``off``): check the task's record for the
        system the episode got (a record that does not calibrate it refuses the episode,
        :class:`~sequester.errors.TaskNotCalibrated`); None: checked elsewhere."""
        from sequester.environments import UnsupportedByBackend, missing_capabilities, open_environment
        from sequester.sandbox.nsexec.client import shared_nsexec
        from sequester.tasks import load_task

        task = load_task(folder)
        # One namespace helper for the process, kept by a thread of its own (shared_nsexec).
        nsexec = shared_nsexec() if settings.backend == "local" else None
        env = open_environment(settings, hide=hide, nsexec=nsexec)
        missing = missing_capabilities(env.capabilities, task, env.settings)
        if missing:  # before anything starts, naming what is missing
            raise UnsupportedByBackend("; ".join(missing))
        self.env = env
        if self.aborted:  # closed before it started (abort() saw no environment yet)
            raise EpisodeError(f"episode {self.id}: it was closed while it started")
        try:
            env.start(task)
            state = {} if calibration is None else self._calibration(env, folder, task.name, calibration)
        except BaseException:
            env.close()
            raise
        return env.instruction, env.workdir, state

    def start_from(self, checkpoint: Checkpoint, settings: EpisodeSettings, hide: tuple[Path, ...]) -> tuple[str, str]:
        """Start the episode as a fork of ``checkpoint`` (another episode's, of this
        process): its instruction and working directory."""
        from sequester.environments.local.episode import Episode
        from sequester.sandbox.nsexec.client import shared_nsexec

        if settings.backend != "local":
            raise UnsupportedByBackend(f"fork: the {settings.backend} backend's episodes have no checkpoints")
        env = Episode(settings, hide=hide, nsexec=shared_nsexec())
        self.env = env
        if self.aborted:
            raise EpisodeError(f"episode {self.id}: it was closed while it started")
        try:
            env.start_from(checkpoint)
        except BaseException:
            env.close()
            raise
        return env.instruction, env.workdir

    def checkpoint(self) -> dict[str, Any]:
        """Seal the episode's state (``Episode.checkpoint``): the checkpoint's id, depth,
        disk and what was not restored. At most 64 held per episode."""
        env = self._env()
        if not env.capabilities.checkpoint or not hasattr(env, "checkpoint"):
            raise UnsupportedByBackend(f"checkpoint: the {env.capabilities.backend} backend cannot seal an episode")
        if len(self.checkpoints) >= _MAX_CHECKPOINTS:
            raise CheckpointError(
                f"episode {self.id}: it holds {len(self.checkpoints)} checkpoints already: release one first"
            )
        cp: Checkpoint = env.checkpoint()
        self.checkpoints[cp.id] = cp
        return {"id": cp.id, "depth": cp.depth, "bytes": cp.layer_bytes, "not_restored": list(cp.not_restored)}

    def rollback(self, checkpoint: Checkpoint) -> str:
        """Start the episode again on ``checkpoint`` (``Episode.rollback``): its working
        directory."""
        env = self._env()
        if not hasattr(env, "rollback"):
            raise UnsupportedByBackend(f"rollback: the {env.capabilities.backend} backend cannot seal an episode")
        env.rollback(checkpoint)
        return str(env.workdir)

    def held_checkpoint(self, checkpoint_id: str) -> Checkpoint:
        """One of this episode's checkpoints (any thread: a dictionary read)."""
        cp = self.checkpoints.get(checkpoint_id)
        if cp is None or cp.released:
            raise CheckpointError(f"checkpoint {checkpoint_id[:64]!r}: not held by episode {self.id} (released?)")
        return cp

    def release(self, checkpoint_id: str) -> bool:
        cp = self.checkpoints.pop(checkpoint_id, None)
        if cp is not None:
            cp.release()
        return cp is not None

    @staticmethod
    def _calibration(env: Environment, folder: Path, name: str, mode: str) -> dict[str, Any]:
        from sequester import __version__
        from sequester.calibration import lookup
        from sequester.errors import TaskNotCalibrated
        from sequester.tasks.checksum import task_checksum

        if mode == "off":
            return {"state": "off"}
        state = lookup(
            task_checksum=task_checksum(folder),
            system=getattr(env, "system", None),
            settings=env.settings,
            version=__version__,
            mode=mode,
        )
        if state.state == "not-calibrated" or (mode == "required" and state.state != "calibrated"):
            raise TaskNotCalibrated(f"task {name} is not calibrated here: {state.reason}")
        return state.to_dict()

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
        return self._env().exec(command, timeout)

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
        try:
            if self.env is not None:
                self.env.close()
        finally:
            held, self.checkpoints = list(self.checkpoints.values()), {}
            for cp in held:
                cp.release()

    # -- from any thread ---------------------------------------------------------------
    def abort(self) -> None:
        """Kill every process of the episode now: a call in flight (a start too) ends."""
        self.aborted = True
        env = self.env
        if env is not None:
            env.abort()

    def begin_close(self) -> Future[None]:
        """Kill what runs, queue the close behind it on the episode's thread and end the
        thread after it; the future is done when the episode is closed. Never blocks."""
        if self.thread.running:
            self.abort()
        closing = self.thread.submit(self.close_env)
        self.thread.stop()
        return closing

    def shutdown(self, grace: float) -> None:
        """:meth:`begin_close`, and wait for it. A call that does not give way within
        ``grace`` seconds is left to finish (the close runs after it)."""
        try:
            self.begin_close().result(grace)
        except FutureTimeout:
            log.warning("episode %s: a call did not stop within %g s; it closes when the call ends", self.id, grace)
        except Exception as exc:  # noqa: BLE001 - a failed cleanup is the operator's, not the trainer's
            log.error("episode %s was not closed cleanly: %s", self.id, exc)
