"""Sessions of ``sequester serve``: an episode or a kernel per WebSocket connection.

Every call into an episode or a :class:`~sequester.kernel.client.Kernel` blocks (a
command, a verifier run, a sandbox's start), so each runs on **a thread of its own**: the
event loop never blocks, sessions never wait for one another, and one session's calls run
in order (neither is thread-safe). The sandboxes started on a thread die with it
(``bwrap --die-with-parent``), so that thread lives as long as what it started.

* An episode session takes its episode from the server's
  :class:`~sequester.environments.pool.EpisodePool` (its local backend; warm per task with
  ``[serve] episode_pool``): the episode's own thread runs its calls, answered on the
  event loop. Closing the session closes the episode (what runs in it is killed first),
  never to be handed to anyone else.
* A kernel session has a worker thread of its own (a warm kernel from the
  :class:`~sequester.kernel.pool.KernelPool` with ``[serve] kernel_pool``). Closing it first
  kills the kernel's processes (safe from any thread), then queues the close behind the
  step on the same worker, so a close never races a step.

:class:`SessionManager` holds the capacity (``max_sessions`` live sessions; a reset beyond
is refused at once), the tasks folder (``resolve_task``: nothing outside it can be named),
the pools, and the connections (closed on shutdown).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, TypeVar

from sequester.errors import KernelClosedError, PolicyError, SequesterError
from sequester.serve import protocol
from sequester.tasks import load_task
from sequester.tasks.finder import resolve_task_id

if TYPE_CHECKING:
    from sequester.config import Config
    from sequester.environments.pool import EpisodeHandle, EpisodePool
    from sequester.kernel.pool import KernelPool

__all__ = ["Session", "EpisodeSession", "KernelSession", "SessionManager", "resolve_task", "log_event"]

log = logging.getLogger("sequester.serve")

T = TypeVar("T")
_CLOSE_GRACE = 30.0  # seconds a close waits for an interrupted step to give way
_INLINE_READ = 1 << 20  # a read_file answer larger than this is encoded off the event loop
StepResult = tuple[Any, float | None, bool]  # observation model, reward, done


def log_event(event: str, **fields: Any) -> None:
    """One structured line per session event: ``{"event": "step", "session": ..., ...}``."""
    log.info("%s", json.dumps({"event": event, **fields}, default=str))


class _Worker:
    """A session's own thread: runs its calls in order, each answered on an asyncio future.

    Why not a ``ThreadPoolExecutor(max_workers=1)`` (as before): per step it costs a
    semaphore, a work item, a wrapped concurrent future and its callbacks on the event
    loop's one thread, which every session shares; this is one queue put and one
    ``call_soon_threadsafe``. The thread lives until :meth:`stop`, like the sandboxes
    it starts (they die with it)."""

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._queue.put((loop, future, fn, args))
        return future

    def stop(self) -> None:
        """End the thread after the calls already queued."""
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            loop, future, fn, args = item
            try:
                outcome = (True, fn(*args))
            except BaseException as exc:  # noqa: BLE001 - the caller's to see, as an executor would
                outcome = (False, exc)
            try:
                loop.call_soon_threadsafe(_settle, future, outcome)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass


def _settle(future: asyncio.Future[Any], outcome: tuple[bool, Any]) -> None:
    if not future.done():
        ok, value = outcome
        future.set_result(value) if ok else future.set_exception(value)


class Session:
    """One session: its counters, and the calls a connection makes (see the subclasses)."""

    kind: ClassVar[Literal["episode", "kernel"]]
    actions: ClassVar[frozenset[str]]

    def __init__(self, session_id: str, task: str | None = None):
        self.id, self.task = session_id, task
        self.steps, self.done = 0, False
        self.started_at: float | None = None
        self.closed = False
        self._closing: asyncio.Future[None] | None = None

    def state(self) -> protocol.SessionState:
        return protocol.SessionState(
            session_id=self.id,
            kind=self.kind,
            task=self.task,
            steps=self.steps,
            done=self.done,
            started_at=self.started_at,
        )

    async def start(self) -> protocol.ResetObservation:
        observation = await self._start()
        self.started_at = time.time()
        return observation

    async def step(self, action: Any) -> StepResult:
        result = await self._step(action)
        self.steps += 1
        self.done = self.done or result[2]
        return result

    async def close(self, grace: float = _CLOSE_GRACE) -> None:
        """Kill what runs, then close. Idempotent: every caller waits for the one close. A
        step that does not give way within ``grace`` seconds is left to finish (the close
        runs right after it)."""
        self.closed = True
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close_now(grace))
        await asyncio.shield(self._closing)

    async def _start(self) -> protocol.ResetObservation:
        raise NotImplementedError

    async def _step(self, action: Any) -> StepResult:
        raise NotImplementedError

    async def _close_now(self, grace: float) -> None:
        raise NotImplementedError


class EpisodeSession(Session):
    """An episode of one task, from the server's episode pool. ``evaluate`` ends it (``done``)."""

    kind = "episode"
    actions = protocol.EPISODE_ACTIONS

    def __init__(
        self,
        session_id: str,
        task_name: str,
        task_id: str,
        pool: EpisodePool,
        read_cap: int,
        fork_of: str | None = None,
    ):
        super().__init__(session_id, task_name)
        self._task_id, self._pool, self._read_cap = task_id, pool, read_cap
        self._fork_of = fork_of  # a checkpoint's id: the episode starts as a fork of it
        self._made: set[str] = set()  # the checkpoints this session made: only it may release them
        self._acquiring: asyncio.Future[EpisodeHandle] | None = None
        self._handle: EpisodeHandle | None = None

    async def _start(self) -> protocol.ResetObservation:
        if self.closed:
            raise protocol.FrameError(protocol.ErrorCode.SESSION_ERROR, "the session was closed before it started")
        # A task of its own, so that a close while it runs (the client went) cancels it:
        # the pool then gives back the slot, or closes the episode it was starting.
        self._acquiring = asyncio.ensure_future(
            self._pool.afork(self._fork_of) if self._fork_of is not None else self._pool.aacquire(self._task_id)
        )
        handle = self._handle = await self._acquiring
        return protocol.ResetObservation(
            session_id=self.id,
            kind="episode",
            task=self.task,
            instruction=handle.instruction,
            workdir=handle.workdir,
            calibration=dict(handle.calibration),
        )

    @property
    def init_pid(self) -> int:
        """Host pid of the episode's init (diagnostics and tests)."""
        if self._handle is None:
            raise protocol.FrameError(protocol.ErrorCode.SESSION_ERROR, "the episode has not started")
        return self._pool.init_pid(self._handle)

    async def _step(self, action: Any) -> StepResult:
        pool, handle = self._pool, self._handle
        if handle is None:
            raise protocol.FrameError(protocol.ErrorCode.SESSION_ERROR, "no episode: send a reset first")
        if isinstance(action, protocol.ExecAction):
            r = await pool.aexec(handle, action.command, action.timeout)
            return (
                protocol.ExecObservation(
                    stdout=r.stdout,
                    stderr=r.stderr,
                    exit_code=r.exit_code,
                    timed_out=r.timed_out,
                    duration=r.duration,
                    note=r.note,
                ),
                None,
                False,
            )
        if isinstance(action, protocol.WriteFileAction):
            data = action.data()
            await pool.awrite_file(handle, action.path, data, action.mode)
            return protocol.WriteFileObservation(path=action.path, bytes=len(data)), None, False
        if isinstance(action, protocol.ReadFileAction):
            content = await pool.aread_file(handle, action.path)  # at most read_cap (the pool's)
            cap = self._read_cap if action.limit is None else min(action.limit, self._read_cap)
            truncated, data = content.truncated or len(content) > cap, bytes(content[:cap])
            if len(data) > _INLINE_READ:
                text = await asyncio.to_thread(_encode, data, action.encoding)
            else:
                text = _encode(data, action.encoding)
            return (
                protocol.ReadFileObservation(content=text, encoding=action.encoding, truncated=truncated),
                None,
                False,
            )
        if isinstance(action, protocol.EvaluateAction):
            return await self._evaluate(handle)
        if isinstance(action, protocol.CheckpointAction):
            cp = await pool.acheckpoint(handle)
            self._made.add(cp.id)
            return (
                protocol.CheckpointObservation(
                    checkpoint=cp.id, depth=cp.depth, bytes=cp.bytes, not_restored=list(cp.not_restored)
                ),
                None,
                False,
            )
        if isinstance(action, protocol.RollbackAction):
            await pool.arollback(handle, action.checkpoint)
            return protocol.RollbackObservation(checkpoint=action.checkpoint), None, False
        if isinstance(action, protocol.ReleaseAction):
            if action.checkpoint not in self._made:  # (red team: a session released another's)
                raise protocol.FrameError(
                    protocol.ErrorCode.EXECUTION_ERROR,
                    "release failed: that checkpoint is not one this session made (it goes with its own session)",
                )
            self._made.discard(action.checkpoint)
            await pool.arelease(action.checkpoint)
            return protocol.ReleaseObservation(checkpoint=action.checkpoint, released=True), None, False
        raise protocol.FrameError(
            protocol.ErrorCode.SESSION_ERROR, f"an episode session takes no {action.type!r} action"
        )

    async def _evaluate(self, handle: EpisodeHandle) -> StepResult:
        """The verdict only: neither the tests' output nor the files they left (the client
        may hand observations to the model, and those would teach it the tests). A
        verifier that could not run is no verdict (``error``, reward None), not a 0."""
        result = await self._pool.aevaluate(handle)
        verdict = protocol.VerifierObservation(
            reward=result.reward,
            rewards=dict(result.rewards),
            zero_reason=result.zero_reason,
            tampering=list(result.tampering),
            notes=list(result.notes),
            error=result.error,
        )
        return protocol.EvaluateObservation(verifier=verdict), (result.reward if result.error is None else None), True

    async def _close_now(self, grace: float) -> None:
        acquiring = self._acquiring
        if acquiring is not None and not acquiring.done():
            acquiring.cancel()  # the pool gives back what it had (a slot, a warm episode) or closes it
            await asyncio.wait([acquiring])
        handle = self._handle
        if handle is None and acquiring is not None and acquiring.done() and not acquiring.cancelled():
            if acquiring.exception() is None:  # it came back just as it was cancelled
                handle = acquiring.result()
        if handle is None:
            return
        try:
            await self._pool.aclose(handle)  # what runs is killed first; the episode is never handed out again
        except Exception as exc:  # noqa: BLE001 - a failed cleanup is the server's, not a client's
            log.error("session %s was not closed cleanly: %s", self.id, exc)


def _encode(data: bytes, encoding: str) -> str:
    return base64.b64encode(data).decode() if encoding == "base64" else data.decode("utf-8", "replace")


class _WorkerSession(Session):
    """A session whose calls run on a worker thread of its own (a kernel's)."""

    def __init__(self, session_id: str, task: str | None = None):
        super().__init__(session_id, task)
        self._running = 0  # calls submitted and not finished (on the event loop's side)
        self._worker = _Worker(f"serve-{session_id}")

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        self._running += 1
        try:
            return await self._worker.submit(fn, *args)
        finally:
            self._running -= 1

    async def _start(self) -> protocol.ResetObservation:
        return await self._call(self._start_now)

    async def _step(self, action: Any) -> StepResult:
        return await self._call(self._step_now, action)

    async def _close_now(self, grace: float) -> None:
        if self._running:
            try:
                self._interrupt()
            except Exception:  # noqa: BLE001 - the close below still runs
                log.exception("interrupting session %s", self.id)
        closing = self._worker.submit(self._close)
        closing.add_done_callback(self._closed)
        try:
            await asyncio.wait_for(asyncio.shield(closing), grace)
        except TimeoutError:
            log.warning("session %s: a step did not stop within %g s; it closes when the step ends", self.id, grace)
        except Exception:  # noqa: BLE001 - reported by _closed: a failed cleanup is the server's, not a client's
            pass
        finally:
            self._worker.stop()

    def _closed(self, closing: asyncio.Future[None]) -> None:
        if not closing.cancelled() and closing.exception() is not None:
            log.error("session %s was not closed cleanly: %s", self.id, closing.exception())

    # -- on the worker -------------------------------------------------------------------
    def _start_now(self) -> protocol.ResetObservation:
        raise NotImplementedError

    def _step_now(self, action: Any) -> StepResult:
        raise NotImplementedError

    def _interrupt(self) -> None:
        """From the event loop's thread: end the call in flight now."""

    def _close(self) -> None:
        raise NotImplementedError


class KernelSession(_WorkerSession):
    """A :class:`Kernel` under the config's policy; actions are code cells."""

    kind = "kernel"
    actions = protocol.KERNEL_ACTIONS

    def __init__(self, session_id: str, config: Config, pool: KernelPool | None = None):
        super().__init__(session_id)
        from sequester.kernel.client import Kernel

        self._pool = pool
        self._kernel = Kernel(config.policy)

    def _start_now(self) -> protocol.ResetObservation:
        if self._pool is not None:  # a warm kernel, all this session's (it is closed with it, never reused)
            self._kernel = self._pool.acquire()
        else:
            self._kernel.start()
        return protocol.ResetObservation(session_id=self.id, kind="kernel")

    def _step_now(self, action: Any) -> StepResult:
        if not isinstance(action, protocol.CellAction):
            raise protocol.FrameError(
                protocol.ErrorCode.SESSION_ERROR, f"a kernel session takes no {action.type!r} action"
            )
        try:
            r = self._kernel.run(action.code, timeout=action.timeout)
        except KernelClosedError as exc:  # its lifetime (limits.kernel_timeout) is over
            raise protocol.FrameError(protocol.ErrorCode.EXECUTION_ERROR, f"{exc}: reset for a new kernel") from None
        error = (
            None
            if r.error is None
            else protocol.CellErrorModel(type=r.error.type, message=r.error.message, traceback=r.error.traceback)
        )
        return (
            protocol.CellObservation(
                stdout=r.stdout,
                stderr=r.stderr,
                value=r.value,
                error=error,
                duration=r.duration,
                timed_out=r.timed_out,
                restarted=r.restarted,
            ),
            None,
            False,
        )

    def _interrupt(self) -> None:
        # Kill the kernel's processes without closing its pipes: the worker reading them
        # sees the kernel die and returns (terminate() would close fds that thread is
        # reading, and a number reused by another session's pipe would then be read).
        process = self._kernel.process
        if process is None:
            return
        if process.sandbox is not None:
            process.sandbox.signal_kernel()
        else:
            try:
                os.killpg(process.popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def _close(self) -> None:
        self._kernel.close()


def resolve_task(root: Path, task_id: str, where: str = "data.task") -> Path:
    """The folder of task ``task_id`` under ``root`` (already resolved); a name that leads
    outside it is a ``VALIDATION_ERROR`` (:func:`~sequester.tasks.finder.resolve_task_id`)."""
    try:
        return resolve_task_id(root, task_id, where)
    except PolicyError as exc:
        raise protocol.FrameError(protocol.ErrorCode.VALIDATION_ERROR, str(exc)) from None


class _Closable(Protocol):
    async def shutdown(self) -> None: ...


class SessionManager:
    """Capacity, the tasks folder, the pools, and every live connection (closed on shutdown).

    Episode sessions take their episodes from :attr:`episode_pool` (the local backend of
    :class:`~sequester.environments.pool.EpisodePool`, ``max_sessions`` episodes at most,
    warm ones included; ``[serve] episode_pool`` keeps episodes of some tasks started)."""

    def __init__(self, config: Config, *, hide: tuple[Path, ...] = (), tasks: int = 0):
        self.config = config
        self.settings = config.serve
        self.tasks_dir = self.settings.tasks_dir.resolve() if self.settings.tasks_dir is not None else None
        self.max_sessions = self.settings.max_sessions
        # Hidden from every agent: the tasks folder (other tasks' tests and solutions), the
        # token file and the config file (the token in them would let an agent that
        # reached the server drive it).
        self.hide = tuple(dict.fromkeys([*(() if self.tasks_dir is None else (self.tasks_dir,)), *hide]))
        self.task_count = tasks
        self.active = 0
        self.connections: set[_Closable] = set()
        self.kernel_pool: KernelPool | None = None
        self.episode_pool: EpisodePool | None = None
        if self.tasks_dir is not None:
            from sequester.environments.pool import EpisodePool

            # Its capacity is the server's: it never waits unless warm starts or closes
            # still hold slots (the server refuses a reset beyond max_sessions itself).
            self.episode_pool = EpisodePool(
                self.tasks_dir,
                backend="local",
                capacity=self.max_sessions,
                warm=self.settings.episode_pool,
                settings=config.episodes,
                hide=self.hide,
                read_cap=self.settings.max_message_bytes,
                close_grace=_CLOSE_GRACE,
                calibration=self.settings.calibration,
                wait_timeout=_CLOSE_GRACE + 30,
                max_waiting=self.max_sessions,
            )
        elif self.settings.episode_pool:
            raise PolicyError("serve.episode_pool: this server serves no tasks (no tasks_dir) to keep episodes of")
        if self.settings.kernel_pool:
            from sequester.kernel.pool import KernelPool

            self.kernel_pool = KernelPool(config.policy, size=self.settings.kernel_pool, init=self.settings.kernel_init)

    def try_acquire(self) -> bool:
        """Take a session slot, or ``False`` at capacity (never waits). Runs on the event
        loop: the check and the take happen with no await between them."""
        if self.active >= self.max_sessions:
            return False
        self.active += 1
        return True

    def release(self) -> None:
        self.active = max(0, self.active - 1)

    def new_session(
        self, session_id: str, request: protocol.EpisodeReset | protocol.KernelReset, where: str = "data"
    ) -> Session:
        """A session for a reset (not started); :class:`FrameError` for a task that cannot be named or loaded."""
        if isinstance(request, protocol.KernelReset):
            return KernelSession(session_id, self.config, self.kernel_pool)
        if self.tasks_dir is None or self.episode_pool is None:
            raise protocol.FrameError(
                protocol.ErrorCode.VALIDATION_ERROR,
                f"{where}.task: this server serves no tasks (it was "
                'started without --tasks-dir); only kernel sessions ({"kind": "kernel"})',
            )
        if request.checkpoint is not None:  # a fork: the task is the checkpoint's episode's
            try:
                task_id = self.episode_pool.checkpoint_task(request.checkpoint)
            except SequesterError as exc:
                raise protocol.FrameError(protocol.ErrorCode.VALIDATION_ERROR, f"{where}.checkpoint: {exc}") from None
            return EpisodeSession(
                session_id,
                task_id,
                task_id,
                self.episode_pool,
                self.settings.max_message_bytes,
                fork_of=request.checkpoint,
            )
        assert request.task is not None
        folder = resolve_task(self.tasks_dir, request.task, f"{where}.task")
        try:
            task = load_task(folder)
        except SequesterError as exc:  # a malformed task: the operator's, not the client's
            raise protocol.FrameError(
                protocol.ErrorCode.FACTORY_ERROR, f"the task could not be loaded: {exc}"
            ) from None
        return EpisodeSession(session_id, task.name, request.task, self.episode_pool, self.settings.max_message_bytes)

    async def close_all(self) -> None:
        """Graceful shutdown: every connection's session closed, its processes gone; then
        the pools (their warm episodes and kernels closed)."""
        connections = list(self.connections)
        if connections:
            await asyncio.gather(*(c.shutdown() for c in connections), return_exceptions=True)
        if self.episode_pool is not None:
            await self.episode_pool.ashutdown()
        if self.kernel_pool is not None:
            self.kernel_pool.close()
