"""Sessions of ``sequester serve``: an episode or a kernel per WebSocket connection.

Every call into an :class:`~sequester.environments.local.episode.Episode` or a
:class:`~sequester.kernel.client.Kernel` blocks (a command, a verifier run, a sandbox's
start), so each session has **one worker thread of its own**: the event loop never blocks,
sessions never wait for one another, and one session's calls run in order (neither class
is thread-safe). The sandboxes a session starts die with the thread that started them
(``bwrap --die-with-parent``), so they live exactly as long as their session's worker.
Closing a session first kills what runs in it (``Episode.abort``, the kernel's processes;
both are safe from any thread), then queues the close behind it on the same worker, so a
close never races a step.

:class:`SessionManager` holds the capacity (``max_sessions`` live sessions; a reset beyond
is refused at once), the tasks folder (``resolve_task``: nothing outside it can be named),
and the connections (closed on shutdown).
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

from sequester.environments.verdict import VerifierError
from sequester.errors import KernelClosedError, SequesterError
from sequester.serve import protocol
from sequester.tasks import Task, load_task
from sequester.tasks.finder import has_task_toml

if TYPE_CHECKING:
    from sequester.config import Config
    from sequester.kernel.pool import KernelPool

__all__ = ["Session", "EpisodeSession", "KernelSession", "SessionManager", "resolve_task", "log_event"]

log = logging.getLogger("sequester.serve")

T = TypeVar("T")
_CLOSE_GRACE = 30.0  # seconds a close waits for an interrupted step to give way
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
    """One session: its worker thread, its counters, and the calls a connection makes."""

    kind: ClassVar[Literal["episode", "kernel"]]
    actions: ClassVar[frozenset[str]]

    def __init__(self, session_id: str, task: str | None = None):
        self.id, self.task = session_id, task
        self.steps, self.done = 0, False
        self.started_at: float | None = None
        self.closed = False
        self._closing: asyncio.Future[None] | None = None
        self._running = 0  # calls submitted and not finished (on the event loop's side)
        self._worker = _Worker(f"serve-{session_id}")

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        self._running += 1
        try:
            return await self._worker.submit(fn, *args)
        finally:
            self._running -= 1

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
        observation = await self._call(self._start)
        self.started_at = time.time()
        return observation

    async def step(self, action: Any) -> StepResult:
        result = await self._call(self._step, action)
        self.steps += 1
        self.done = self.done or result[2]
        return result

    async def close(self, grace: float = _CLOSE_GRACE) -> None:
        """Kill what runs, then close on the worker. Idempotent: every caller waits for the
        one close. A step that does not give way within ``grace`` seconds is left to finish
        (the close runs right after it)."""
        self.closed = True
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close_now(grace))
        await asyncio.shield(self._closing)

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
    def _start(self) -> protocol.ResetObservation:
        raise NotImplementedError

    def _step(self, action: Any) -> StepResult:
        raise NotImplementedError

    def _interrupt(self) -> None:
        """From the event loop's thread: end the call in flight now."""

    def _close(self) -> None:
        raise NotImplementedError


class EpisodeSession(Session):
    """An :class:`Episode` on one task. ``evaluate`` ends it (``done``)."""

    kind = "episode"
    actions = protocol.EPISODE_ACTIONS

    def __init__(self, session_id: str, task: Task, config: Config, hide: tuple[Path, ...], read_cap: int):
        super().__init__(session_id, task.name)
        from sequester.environments import open_environment
        from sequester.sandbox.nsexec.client import shared_nsexec

        self._task = task
        # The namespace helper is one process for all episodes, and it dies with the
        # *thread* that started it (PR_SET_PDEATHSIG): started (or restarted) here, on the
        # event loop's thread, which lives as long as the server, never on a session's
        # worker, which ends with its session and would take every other episode's helper
        # with it. (The docker backend needs none.)
        nsexec = shared_nsexec() if config.episodes.backend == "local" else None
        self._episode = open_environment(config.episodes, hide=hide, nsexec=nsexec)
        self._read_cap = read_cap
        self._calibration_mode = config.serve.calibration

    def _start(self) -> protocol.ResetObservation:
        from sequester.environments import UnsupportedByBackend, missing_capabilities

        missing = missing_capabilities(self._episode.capabilities, self._task, self._episode.settings)
        if missing:  # before anything starts (a FACTORY_ERROR naming what is missing)
            raise UnsupportedByBackend("; ".join(missing))
        try:
            self._episode.start(self._task)
            calibration = self._calibration()
        except BaseException:
            self._episode.close()
            raise
        return protocol.ResetObservation(
            session_id=self.id,
            kind="episode",
            task=self.task,
            instruction=self._episode.instruction,
            workdir=self._episode.workdir,
            calibration=calibration,
        )

    def _calibration(self) -> dict[str, Any]:
        """The task's calibration on the system its episode got (see sequester.calibration):
        a record that does not calibrate it refuses the session (TaskNotCalibrated, a
        FACTORY_ERROR); with ``required``, so does having none (a server does not calibrate
        inside a reset: ``sequester calibrate`` with the server's settings does)."""
        from sequester import __version__
        from sequester.calibration import lookup
        from sequester.errors import TaskNotCalibrated
        from sequester.tasks.checksum import task_checksum

        mode = self._calibration_mode
        if mode == "off":
            return {"state": "off"}
        state = lookup(
            task_checksum=task_checksum(self._task.path),
            system=getattr(self._episode, "system", None),
            settings=self._episode.settings,
            version=__version__,
            mode=mode,
        )
        if state.state == "not-calibrated" or (mode == "required" and state.state != "calibrated"):
            raise TaskNotCalibrated(f"task {self._task.name} is not calibrated here: {state.reason}")
        return state.to_dict()

    @property
    def init_pid(self) -> int:
        """Host pid of the episode's init (diagnostics and tests)."""
        return self._episode.init_pid  # type: ignore[attr-defined]  # only the local backend has one

    def _step(self, action: Any) -> StepResult:
        ep = self._episode
        if isinstance(action, protocol.ExecAction):
            r = ep.exec(action.command, action.timeout)
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
            ep.write_file(action.path, data, mode=action.mode)
            return protocol.WriteFileObservation(path=action.path, bytes=len(data)), None, False
        if isinstance(action, protocol.ReadFileAction):
            data = ep.read_file(action.path)
            cap = self._read_cap if action.limit is None else min(action.limit, self._read_cap)
            truncated, data = len(data) > cap, data[:cap]
            content = (
                base64.b64encode(data).decode() if action.encoding == "base64" else data.decode("utf-8", "replace")
            )
            return (
                protocol.ReadFileObservation(content=content, encoding=action.encoding, truncated=truncated),
                None,
                False,
            )
        if isinstance(action, protocol.EvaluateAction):
            return self._evaluate()
        raise protocol.FrameError(
            protocol.ErrorCode.SESSION_ERROR, f"an episode session takes no {action.type!r} action"
        )

    def _evaluate(self) -> StepResult:
        """The verdict only: neither the tests' output nor the files they left (the client
        may hand observations to the model, and those would teach it the tests)."""
        try:
            result = self._episode.evaluate()
        except VerifierError as exc:  # the verifier could not run: no verdict, the trial is an error
            verdict = protocol.VerifierObservation(
                reward=None, rewards={}, zero_reason=None, tampering=list(exc.tampering), notes=[], error=str(exc)
            )
            return protocol.EvaluateObservation(verifier=verdict), None, True
        verdict = protocol.VerifierObservation(
            reward=result.reward,
            rewards=dict(result.rewards),
            zero_reason=result.zero_reason,
            tampering=list(result.tampering),
            notes=list(result.notes),
            error=None,
        )
        return protocol.EvaluateObservation(verifier=verdict), result.reward, True

    def _interrupt(self) -> None:
        self._episode.abort()  # every process of the episode is killed: an exec in flight ends

    def _close(self) -> None:
        self._episode.close()


class KernelSession(Session):
    """A :class:`Kernel` under the config's policy; actions are code cells."""

    kind = "kernel"
    actions = protocol.KERNEL_ACTIONS

    def __init__(self, session_id: str, config: Config, pool: KernelPool | None = None):
        super().__init__(session_id)
        from sequester.kernel.client import Kernel

        self._pool = pool
        self._kernel = Kernel(config.policy)

    def _start(self) -> protocol.ResetObservation:
        if self._pool is not None:  # a warm kernel, all this session's (it is closed with it, never reused)
            self._kernel = self._pool.acquire()
        else:
            self._kernel.start()
        return protocol.ResetObservation(session_id=self.id, kind="kernel")

    def _step(self, action: Any) -> StepResult:
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
    """The folder of task ``task_id`` under ``root`` (already resolved).

    Attack stopped: a client naming a folder outside the tasks folder (``../../etc``,
    ``/root/other-tasks/x``, a symlink inside the folder pointing out of it) to run an
    episode on (and have verified, and see the instruction of) a task the operator did not
    serve. The path is taken apart by name (no ``..``, no hidden names, not absolute),
    then its real path must lie inside ``root``'s.
    """
    if task_id.startswith("/") or "\\" in task_id:
        raise protocol.FrameError(
            protocol.ErrorCode.VALIDATION_ERROR,
            f"{where}: an absolute path is refused: name a task of the "
            "tasks folder by its folder name or its path relative to it",
        )
    parts = task_id.split("/")
    if parts[-1] == "":  # "python-csv-stats/"
        parts = parts[:-1]
    if not parts or any(part == "" or part.startswith(".") for part in parts):
        raise protocol.FrameError(
            protocol.ErrorCode.VALIDATION_ERROR,
            f"{where}: '..', '.', empty and hidden path components are refused: name a task of the tasks folder",
        )
    real = Path(os.path.realpath(root.joinpath(*parts)))
    if real == root or root not in real.parents:
        raise protocol.FrameError(
            protocol.ErrorCode.VALIDATION_ERROR,
            f"{where}: resolves outside the tasks folder (a symlink pointing out of it?): refused",
        )
    if not has_task_toml(real):
        raise protocol.FrameError(
            protocol.ErrorCode.VALIDATION_ERROR, f"{where}: no task {task_id[:200]!r} in the tasks folder"
        )
    return real


class _Closable(Protocol):
    async def shutdown(self) -> None: ...


class SessionManager:
    """Capacity, the tasks folder, and every live connection (closed on shutdown)."""

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
        if self.settings.kernel_pool:
            from sequester.kernel.pool import KernelPool

            self.kernel_pool = KernelPool(config.policy, size=self.settings.kernel_pool)

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
        if self.tasks_dir is None:
            raise protocol.FrameError(
                protocol.ErrorCode.VALIDATION_ERROR,
                f"{where}.task: this server serves no tasks (it was "
                'started without --tasks-dir); only kernel sessions ({"kind": "kernel"})',
            )
        folder = resolve_task(self.tasks_dir, request.task, f"{where}.task")
        try:
            task = load_task(folder)
        except SequesterError as exc:  # a malformed task: the operator's, not the client's
            raise protocol.FrameError(
                protocol.ErrorCode.FACTORY_ERROR, f"the task could not be loaded: {exc}"
            ) from None
        return EpisodeSession(session_id, task, self.config, self.hide, self.settings.max_message_bytes)

    async def close_all(self) -> None:
        """Graceful shutdown: every connection's session closed, its processes gone."""
        connections = list(self.connections)
        if connections:
            await asyncio.gather(*(c.shutdown() for c in connections), return_exceptions=True)
        if self.kernel_pool is not None:
            self.kernel_pool.close()
