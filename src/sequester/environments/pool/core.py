"""One pool of episodes for RL trainers, in this process or across a Ray cluster:
warm episodes per task, a bounded wait queue at capacity, sync and async.

    with EpisodePool("tasks/", capacity=32, warm={"python-csv-stats": 4}) as pool:
        ep = pool.acquire("python-csv-stats")    # a warm episode: handed out in well under 1 ms
        out = ep.exec("ls")                      # or: await ep.aexec("ls")
        verdict = ep.evaluate()                  # the verdict only (no test output)
        ep.close()

    EpisodePool("tasks/", backend="ray", n_actors=8, episodes_per_actor=64)   # across a cluster
    EpisodePool(8, "tasks/", episodes_per_actor=64)                           # the same (the 0.1 form)

**Backends.** ``local`` (the default): episodes in this process, each on a thread of its
own (:mod:`.local`); Ray is never imported. ``ray``: episode actors spread over a
cluster's nodes (:class:`sequester.cluster.pool.RayBackend`, loaded only when asked for).
The API, the errors and the guarantees below are the same for both.

**Slots.** ``capacity`` counts every episode the pool holds: handed out, warm, starting,
and closing (a slot is free once its episode is closed). ``reset`` (``acquire`` is the same
call) hands out a warm episode of the task if there is one, else starts one in a free
slot. At capacity the caller waits, first come first served, up to ``wait_timeout``
seconds for a slot; at most ``max_waiting`` callers wait, and one more, or a wait that
runs out, is :class:`~sequester.errors.PoolFull` naming the numbers (``wait_timeout=0``:
refused at once). A caller never waits while a warm episode of another task holds a slot:
the oldest warm episode is closed for it. An async caller waits on its event loop (never
blocking it); cancelled, it leaves the queue, and a slot or warm episode it had been given
goes back to the pool.

**Warm episodes.** ``warm={task_id: n}`` keeps ``n`` episodes of the task started ahead,
each filled again in the background (on a thread of its own) as soon as one is handed out
and a slot is free (never while a caller waits). **Every episode is handed out once**:
closing it ends it, and it is never handed to another caller; a warm episode nobody
takes is closed at :meth:`shutdown`. A warm start that fails is logged and tried again
after a pause (1 s, doubling to 30 s); a caller that finds no warm episode starts its own,
and so sees the error itself.

Task ids name folders of ``tasks_dir`` only (:func:`~sequester.tasks.finder.resolve_task_id`:
``..``, absolute paths, hidden names and symlinks out are refused), and ``tasks_dir`` is
hidden from every agent. Calls on a closed, lost or unknown episode are refused with a
clear error; a lost one (its Ray actor or node died) is the backend's error
(``ClusterError``), ``close`` of it just forgets it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

from sequester.environments.pool.backend import PoolBackend, Started
from sequester.environments.pool.handle import EpisodeHandle
from sequester.environments.pool.held import CLOSE_GRACE, READ_CAP, ExecOutput, FileContent, Verdict
from sequester.environments.settings import EpisodeSettings
from sequester.errors import EpisodeError, PolicyError
from sequester.tasks.finder import resolve_task_id

__all__ = ["EpisodePool", "PoolStats", "CheckpointInfo", "DEFAULT_CAPACITY", "WAIT_TIMEOUT", "MAX_WAITING"]

log = logging.getLogger("sequester.environments.pool")

DEFAULT_CAPACITY = 64  # episodes a local pool holds at once (a Ray actor's default too)
WAIT_TIMEOUT = 60.0  # seconds a caller waits for a slot at capacity
MAX_WAITING = 1024  # callers that may wait at once
_REMEMBERED = 65536  # closed and lost episode ids remembered (for a clear error on reuse)
_FIRST_PAUSE, _LAST_PAUSE = 1.0, 30.0  # after a warm start failed, before the next try
_POOL_ARGUMENT = object()  # "the pool's own setting" for a call's wait_timeout

Grant = tuple[Literal["slot", "warm", "error"], Any]


@dataclass(frozen=True)
class PoolStats:
    """What the pool holds now. ``warm``: ready episodes by task id (the configured ids)."""

    capacity: int
    held: int
    warm: dict[str, int] = field(default_factory=dict)
    starting: int = 0
    closing: int = 0
    waiting: int = 0


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint of a pool's episode (:meth:`EpisodePool.checkpoint`): ``id`` names it to
    :meth:`~EpisodePool.rollback`, :meth:`~EpisodePool.fork` and :meth:`~EpisodePool.release`;
    ``depth``: sealed layers it stands on; ``bytes``: its own layer's disk;
    ``not_restored``: the processes the episode's restart did not bring back."""

    id: str
    episode_id: str
    depth: int
    bytes: int
    not_restored: tuple[str, ...] = ()


@dataclass
class _Entry:
    """An episode of the pool: starting (for a caller, or to be warm), warm, or handed out."""

    task_id: str
    folder: Path
    state: Literal["starting", "warm", "held"] = "starting"
    handle: EpisodeHandle | None = None
    ready_at: float = 0.0


def _wake_future(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class _Waiter:
    """A caller waiting for a slot: a thread's event, or a coroutine's future on its loop."""

    __slots__ = ("folder", "task_id", "grant", "event", "loop", "future")

    def __init__(self, folder: Path, task_id: str, loop: asyncio.AbstractEventLoop | None):
        self.folder, self.task_id = folder, task_id
        self.grant: Grant | None = None
        self.loop = loop
        self.event = threading.Event() if loop is None else None
        self.future: asyncio.Future[None] | None = None if loop is None else loop.create_future()

    def wake(self) -> None:
        if self.event is not None:
            self.event.set()
        elif self.loop is not None and self.future is not None:
            try:
                self.loop.call_soon_threadsafe(_wake_future, self.future)
            except RuntimeError:  # its loop is closed: nobody waits any more
                pass


def _count(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise PolicyError(f"{name}: {value!r} is not a whole number of at least {least}")
    return value


def _seconds(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise PolicyError(f"{name}: {value!r} is not a number of seconds (0 or more), or None")
    return None if math.isinf(value) else float(value)


class EpisodePool:
    """Episodes of the tasks in ``tasks_dir``, held for callers (see the module doc).

    ``EpisodePool(tasks_dir, *, backend="local", ...)``, or the Ray form
    ``EpisodePool(n_actors, tasks_dir, ...)`` (``backend="ray"``).

    Both backends: ``warm`` ({task id: episodes kept started}); ``wait_timeout`` (seconds a
    caller waits for a slot at capacity; None: no limit; 0: never waits); ``max_waiting``
    (callers that may wait at once); ``settings`` (the episodes', default
    :class:`EpisodeSettings`); ``hide`` (more host paths no agent may see; ``tasks_dir`` is
    always hidden); ``read_cap`` (bytes a ``read_file`` returns at most); ``close_grace``
    (seconds a close waits for an interrupted call to give way); ``calibration``
    (``auto``, ``required``, ``off``: see :meth:`reset`).

    ``local``: ``capacity`` (episodes held at once, warm ones included; default 64).
    ``ray``: ``n_actors`` actors of ``actor_cpus`` CPUs (default 1) holding
    ``episodes_per_actor`` episodes each (default 64; the capacity is their product),
    ``address`` (the cluster: :func:`sequester.cluster.connect.connect`), ``start_timeout``
    (seconds the actors may take to be placed and ready, default 120)."""

    def __init__(
        self,
        *where: Any,
        tasks_dir: str | Path | None = None,
        backend: str | None = None,
        capacity: int | None = None,
        warm: Mapping[str, int] | None = None,
        wait_timeout: float | None = WAIT_TIMEOUT,
        max_waiting: int = MAX_WAITING,
        settings: EpisodeSettings | None = None,
        hide: Iterable[str | Path] = (),
        read_cap: int = READ_CAP,
        close_grace: float = CLOSE_GRACE,
        calibration: str = "auto",
        n_actors: int | None = None,
        address: str | None = None,
        episodes_per_actor: int | None = None,
        actor_cpus: float | None = None,
        start_timeout: float | None = None,
    ):
        if len(where) == 2:  # the Ray form: EpisodePool(n_actors, tasks_dir, ...)
            if n_actors is not None or tasks_dir is not None:
                raise PolicyError("EpisodePool(n_actors, tasks_dir): each given twice")
            n_actors, tasks_dir = where
            if n_actors is None:
                raise PolicyError("n_actors: None is not a whole number of at least 1")
        elif len(where) == 1:
            if tasks_dir is not None:
                raise PolicyError("EpisodePool(tasks_dir): tasks_dir given twice")
            tasks_dir = where[0]
        elif where:
            raise TypeError(f"EpisodePool() takes the tasks folder (and, before it, n_actors): {len(where)} given")
        if tasks_dir is None:
            raise PolicyError("tasks_dir: the folder of tasks the pool's episodes may name is needed")
        ray_only = {
            "n_actors": n_actors,
            "address": address,
            "episodes_per_actor": episodes_per_actor,
            "actor_cpus": actor_cpus,
            "start_timeout": start_timeout,
        }
        if backend is None:
            backend = "ray" if n_actors is not None else "local"
        if backend not in ("local", "ray"):
            raise PolicyError(f"backend: {backend!r} is not local or ray")
        if backend == "local":
            given = [name for name, value in ray_only.items() if value is not None]
            if given:
                raise PolicyError(f"{', '.join(given)}: only for backend='ray' (this pool's backend is local)")
        elif capacity is not None:
            raise PolicyError("capacity: the ray backend's is n_actors × episodes_per_actor; give those")
        if calibration not in ("auto", "required", "off"):
            raise PolicyError(f"calibration: {calibration!r} is not auto, required or off")
        self.calibration = calibration
        self.read_cap = _count("read_cap", read_cap, 1)
        self.wait_timeout = _seconds("wait_timeout", wait_timeout)
        self.max_waiting = _count("max_waiting", max_waiting, 0)
        grace = _seconds("close_grace", close_grace)
        self.close_grace = CLOSE_GRACE if grace is None else grace
        self.tasks_dir = Path(tasks_dir).resolve()
        if not self.tasks_dir.is_dir():
            raise PolicyError(f"tasks_dir: {str(tasks_dir)!r} is not a folder")
        self.settings = settings or EpisodeSettings()
        self.backend_name = backend
        self._targets = self._warm_targets(warm)
        # The warm task ids as configured, checked here once: a reset naming one of them
        # is not resolved again (a realpath is most of a warm reset's time).
        self._known = {task_id: folder for folder, (task_id, _) in self._targets.items()}

        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}  # every episode holding a slot but those closing
        self._warm: dict[Path, deque[str]] = {}  # task folder -> its warm episodes, oldest first
        self._filling: Counter[Path] = Counter()  # task folder -> warm starts in flight (or pausing)
        self._pause: dict[Path, float] = {}  # task folder -> the pause after its last failed warm start
        self._closing = 0  # closes in flight: their slots are not free yet
        self._waiters: deque[_Waiter] = deque()
        self._gone: OrderedDict[str, tuple[type[Exception], str]] = OrderedDict()  # closed or lost -> its error
        self._shut = False
        self._stopping = threading.Event()
        # Warm starts are handed to a thread of the pool's, which starts a thread for each:
        # a caller taking a warm episode only queues its replacement (starting a thread
        # waits for it to run, and on a busy machine that is milliseconds).
        self._starts: queue.SimpleQueue[tuple[Path, str, str] | None] = queue.SimpleQueue()

        hidden = tuple(dict.fromkeys([self.tasks_dir, *(Path(p).resolve() for p in hide)]))
        self._backend: PoolBackend
        if backend == "local":
            from sequester.environments.pool.local import LocalBackend

            cap = DEFAULT_CAPACITY if capacity is None else _count("capacity", capacity, 1)
            self._backend = LocalBackend(self.settings, hidden, cap, self.read_cap, self.close_grace, calibration)
        else:
            # The one upward reference of this package, loaded only when asked for (Ray
            # with it): see docs/architecture.md.
            from sequester.cluster.pool import RayBackend

            self._backend = RayBackend(
                _count("n_actors", n_actors, 1),
                self.tasks_dir,
                settings=self.settings,
                hide=hidden,
                address=address,
                episodes_per_actor=64 if episodes_per_actor is None else episodes_per_actor,
                actor_cpus=1.0 if actor_cpus is None else actor_cpus,
                start_timeout=120.0 if start_timeout is None else start_timeout,
                read_cap=self.read_cap,
                close_grace=self.close_grace,
                calibration=calibration,
                on_lost=self._lost,
            )
        wanted = sum(n for _, n in self._targets.values())
        if wanted > self._backend.capacity:
            self._backend.shutdown(self.close_grace)
            raise PolicyError(f"warm: {wanted} episodes kept warm is more than the capacity, {self._backend.capacity}")
        if self._targets:
            threading.Thread(target=self._start_fills, name="episode-pool-starter", daemon=True).start()
        self._settle()  # the warm episodes start filling

    def _warm_targets(self, warm: Mapping[str, int] | None) -> dict[Path, tuple[str, int]]:
        if warm is None:
            return {}
        if not isinstance(warm, Mapping):
            raise PolicyError(f"warm: {type(warm).__name__} is not a mapping of task ids to episode counts")
        targets: dict[Path, tuple[str, int]] = {}
        for task_id, n in warm.items():
            folder = self._resolve(task_id, f"warm[{task_id!r}]")
            _count(f"warm[{task_id!r}]", n, 0)
            if folder in targets:
                raise PolicyError(f"warm: {targets[folder][0]!r} and {task_id!r} name the same task")
            if n:
                targets[folder] = (task_id, n)
        return targets

    # -- what the pool holds ---------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Episodes the pool can hold at once now (warm ones included)."""
        return self._backend.capacity

    def stats(self) -> PoolStats:
        with self._lock:
            states = Counter(e.state for e in self._entries.values())
            warm = {self._targets[f][0] if f in self._targets else str(f): len(q) for f, q in self._warm.items()}
            return PoolStats(
                self._backend.capacity,
                states["held"],
                {task: n for task, n in warm.items() if n},
                states["starting"],
                self._closing,
                len(self._waiters),
            )

    def actors(self) -> list[Any]:
        """The Ray backend's actors (:class:`sequester.cluster.handle.ActorInfo`); none locally."""
        return self._backend.actors()

    def init_pid(self, ep: EpisodeHandle | str) -> int:
        """Host pid of a handed-out episode's init (local backend; diagnostics and tests)."""
        return self._backend.init_pid(self._route(ep))

    def _used(self) -> int:
        return len(self._entries) + self._closing

    def _forget(self, episode_id: str, kind: type[Exception], why: str) -> None:
        self._gone[episode_id] = (kind, why)
        while len(self._gone) > _REMEMBERED:
            self._gone.popitem(last=False)

    def _resolve(self, task_id: Any, where: str) -> Path:
        if not isinstance(task_id, str) or not task_id or len(task_id) > 4096:
            raise PolicyError(f"{where}: {type(task_id).__name__} is not the name of a task of the tasks folder")
        # Attack stopped: naming a task outside tasks_dir (see resolve_task_id).
        return resolve_task_id(self.tasks_dir, task_id, where)

    def _folder(self, task_id: str) -> Path:
        if self._shut:
            raise self._backend.unusable("the episode pool was shut down")
        known = self._known.get(task_id) if isinstance(task_id, str) else None
        return known if known is not None else self._resolve(task_id, "task_id")

    # -- slots: the one place that hands them out ---------------------------------------------
    def _settle(self) -> None:
        """After any change: warm episodes to waiting callers of their task, free slots to
        the first waiting callers, warm episodes closed for callers that still wait, and,
        when nobody waits, warm episodes started where a task has fewer than wanted."""
        woken: list[_Waiter] = []
        evicted: list[str] = []
        fills: list[tuple[Path, str, str]] = []
        with self._lock:
            if self._shut:
                return
            if self._waiters:
                for waiter in list(self._waiters):
                    ready = self._warm.get(waiter.folder)
                    if ready:
                        episode_id = ready.popleft()
                        self._entries[episode_id].state = "held"
                        waiter.grant = ("warm", episode_id)
                        self._waiters.remove(waiter)
                        woken.append(waiter)
                capacity = self._backend.capacity
                while self._waiters and self._used() < capacity:
                    waiter = self._waiters.popleft()
                    episode_id = uuid.uuid4().hex
                    self._entries[episode_id] = _Entry(waiter.task_id, waiter.folder)
                    waiter.grant = ("slot", episode_id)
                    woken.append(waiter)
                needed = len(self._waiters) - self._closing  # slots that closes in flight do not bring
                while needed > 0 and (oldest := self._oldest_warm()) is not None:
                    del self._entries[oldest]
                    self._closing += 1
                    evicted.append(oldest)
                    needed -= 1
            if not self._waiters:
                fills = self._fills()
        for waiter in woken:
            waiter.wake()
        for episode_id in evicted:
            log.info("episode pool: warm episode %s closed for a waiting caller", episode_id)
            self._backend.begin_close(episode_id).add_done_callback(partial(self._closed, episode_id))
        for fill in fills:
            self._starts.put(fill)

    def _start_fills(self) -> None:
        """The pool's starter thread: a thread for each warm start, until shutdown."""
        while (fill := self._starts.get()) is not None:
            threading.Thread(target=self._fill, args=fill, name="episode-pool-warm", daemon=True).start()

    def _oldest_warm(self) -> str | None:
        oldest: tuple[float, Path] | None = None
        for folder, ready in self._warm.items():
            if ready:
                at = self._entries[ready[0]].ready_at
                if oldest is None or at < oldest[0]:
                    oldest = (at, folder)
        return None if oldest is None else self._warm[oldest[1]].popleft()

    def _fills(self) -> list[tuple[Path, str, str]]:
        fills = []
        capacity = self._backend.capacity
        for folder, (task_id, want) in self._targets.items():
            short = want - len(self._warm.get(folder, ())) - self._filling[folder]
            while short > 0 and self._used() < capacity:
                episode_id = uuid.uuid4().hex
                self._entries[episode_id] = _Entry(task_id, folder)
                self._filling[folder] += 1
                fills.append((folder, task_id, episode_id))
                short -= 1
        return fills

    def _fill(self, folder: Path, task_id: str, episode_id: str) -> None:
        """A warm episode started, on a thread of its own."""
        try:
            started = self._backend.start(episode_id, task_id, folder, self._backend.prepare(folder))
        except BaseException as exc:  # noqa: BLE001 - logged; tried again after a pause
            with self._lock:
                self._entries.pop(episode_id, None)
                pause = self._pause[folder] = min(_LAST_PAUSE, max(_FIRST_PAUSE, 2 * self._pause.get(folder, 0)))
                shut = self._shut
            if not shut:
                log.warning(
                    "episode pool: a warm episode of %s failed to start (next try in %g s): %s", task_id, pause, exc
                )
                self._settle()  # its slot is free
                self._stopping.wait(pause)
            with self._lock:
                self._filling[folder] -= 1
            self._settle()
            return
        handle = self._handle(episode_id, task_id, started)
        with self._lock:
            self._filling[folder] -= 1
            self._pause.pop(folder, None)
            entry = self._entries.get(episode_id)
            if entry is not None:  # (None: lost meanwhile, or the pool was shut down)
                entry.state, entry.handle, entry.ready_at = "warm", handle, time.monotonic()
                self._warm.setdefault(folder, deque()).append(episode_id)
        self._settle()

    def _handle(self, episode_id: str, task_id: str, started: Started) -> EpisodeHandle:
        return EpisodeHandle(
            episode_id,
            task_id,
            started.instruction,
            started.workdir,
            started.node_id,
            started.actor,
            self,
            started.calibration,
        )

    def _take(
        self, folder: Path, task_id: str, loop: asyncio.AbstractEventLoop | None, waited: float | None
    ) -> Grant | _Waiter:
        """A warm episode of the task, else a free slot, else a place in the queue."""
        with self._lock:
            if self._shut:
                raise self._backend.unusable("the episode pool was shut down")
            ready = self._warm.get(folder)
            if ready:
                episode_id = ready.popleft()
                self._entries[episode_id].state = "held"
                return ("warm", episode_id)
            capacity = self._backend.capacity
            if not self._waiters and self._used() < capacity:
                episode_id = uuid.uuid4().hex
                self._entries[episode_id] = _Entry(task_id, folder)
                return ("slot", episode_id)
            if waited == 0 or len(self._waiters) >= self.max_waiting:
                raise self._backend.full(
                    f"the episode pool is full: {self._used()} of its {capacity} slots are taken "
                    f"({self._counts()}) and {len(self._waiters)} callers wait already "
                    f"(max_waiting {self.max_waiting}, wait_timeout {waited}): "
                    "close an episode first, or give the pool more capacity"
                )
            waiter = _Waiter(folder, task_id, loop)
            self._waiters.append(waiter)
        self._settle()  # warm episodes of other tasks may give way
        return waiter

    def _counts(self) -> str:
        states = Counter(e.state for e in self._entries.values())
        return (
            f"{states['held']} handed out, {states['warm']} warm, {states['starting']} starting, "
            f"{self._closing} closing"
        )

    def _gave_up(self, waiter: _Waiter, waited: float | None) -> Grant:
        """The wait ran out: the grant that came just in time, else PoolFull."""
        with self._lock:
            if waiter.grant is not None:
                return waiter.grant
            self._waiters.remove(waiter)
            raise self._backend.full(
                f"the episode pool is full: no slot came free within {waited or 0:g} s (wait_timeout); "
                f"all {self._backend.capacity} are taken ({self._counts()}), and {len(self._waiters)} "
                "other callers wait"
            )

    def _cancelled(self, waiter: _Waiter) -> None:
        """An async caller was cancelled while it waited: what it was given goes back."""
        with self._lock:
            grant = waiter.grant
            if grant is None:
                self._waiters.remove(waiter)
                return
            kind, value = grant
            if kind == "slot":
                self._entries.pop(value, None)
            elif kind == "warm" and value in self._entries:  # never seen by anyone: still fresh
                self._entries[value].state = "warm"
                self._warm.setdefault(waiter.folder, deque()).appendleft(value)
        self._settle()

    def _free(self, episode_id: str) -> None:
        """A start that failed (its episode closed by the backend): its slot is free."""
        with self._lock:
            self._entries.pop(episode_id, None)
        self._settle()

    def _closed(self, episode_id: str, closing: Future[None]) -> None:
        with self._lock:
            self._closing -= 1
        exc = None if closing.cancelled() else closing.exception()
        if exc is not None:  # a failed cleanup is the operator's, not the trainer's
            log.error("episode pool: episode %s was not closed cleanly: %s", episode_id, exc)
        self._settle()

    def _lost(self, episode_ids: list[str], why: str) -> None:
        """The backend lost these episodes (a Ray actor died): their slots are free, and
        every later call on one of them is the backend's error."""
        with self._lock:
            for episode_id in episode_ids:
                entry = self._entries.pop(episode_id, None)
                if entry is None:
                    continue
                if entry.state == "warm":
                    ready = self._warm.get(entry.folder)
                    if ready is not None and episode_id in ready:
                        ready.remove(episode_id)
                self._forget(episode_id, self._backend.unusable, f"episode {episode_id} was lost: {why}")
        self._settle()

    def _handed(self, episode_id: str, task_id: str, started: Started) -> EpisodeHandle:
        """A cold start came back: its handle, unless the episode was lost or the pool
        shut down meanwhile."""
        handle = self._handle(episode_id, task_id, started)
        with self._lock:
            entry = self._entries.get(episode_id)
            if entry is not None and not self._shut:
                entry.state, entry.handle = "held", handle
                return handle
            kind, why = self._gone.get(episode_id, (self._backend.unusable, "the episode pool was shut down"))
        self._backend.begin_close(episode_id)
        raise kind(why)

    def _granted(self, grant: Grant) -> EpisodeHandle | str:
        """A warm episode's handle, or the id of a slot to start one in."""
        kind, value = grant
        if kind == "error":
            raise value
        if kind == "warm":
            with self._lock:
                entry = self._entries.get(value)
                gone = self._gone.get(value, (self._backend.unusable, "the episode pool was shut down"))
            self._settle()  # its replacement starts
            if entry is None or entry.handle is None:  # lost the moment it was handed out
                raise gone[0](gone[1])
            return entry.handle
        return str(value)

    def _wait_for(self, wait_timeout: Any) -> float | None:
        return self.wait_timeout if wait_timeout is _POOL_ARGUMENT else _seconds("wait_timeout", wait_timeout)

    # -- sync API -----------------------------------------------------------------------------
    def reset(self, task_id: str, *, wait_timeout: Any = _POOL_ARGUMENT) -> EpisodeHandle:
        """An episode of task ``task_id`` (a folder of ``tasks_dir``), started and all the
        caller's: a warm one if there is one, else one started now (see the module doc for
        waiting at capacity; ``wait_timeout``: this call's, instead of the pool's).

        Calibration (:mod:`sequester.calibration`, the pool's settings): a task whose record
        does not calibrate it is refused with :class:`~sequester.errors.TaskNotCalibrated`
        (``required``: one without a calibrated record too). The local backend checks the
        record of the system the episode got (``sequester calibrate``'s key); the Ray
        backend, whose nodes choose their systems, the record without one, before anything
        starts."""
        folder = self._folder(task_id)
        got = self._slot(folder, task_id, wait_timeout)
        if isinstance(got, EpisodeHandle):
            return got
        episode_id = got
        try:
            started = self._backend.start(episode_id, task_id, folder, self._backend.prepare(folder))
        except BaseException:
            self._free(episode_id)
            raise
        return self._handed(episode_id, task_id, started)

    acquire = reset

    def _slot(self, folder: Path, task_id: str, wait_timeout: Any) -> EpisodeHandle | str:
        """A warm episode of ``folder``'s task, or a slot's episode id (waiting at capacity)."""
        waited = self._wait_for(wait_timeout)
        taken = self._take(folder, task_id, None, waited)
        if isinstance(taken, _Waiter):
            waiter = taken
            assert waiter.event is not None
            try:
                arrived = waiter.event.wait(waited)
            except BaseException:  # (Ctrl-C): what it was given goes back
                self._cancelled(waiter)
                raise
            grant = waiter.grant if arrived and waiter.grant is not None else self._gave_up(waiter, waited)
        else:
            grant = taken
        return self._granted(grant)

    # -- checkpoints (episodes on an image, local episodes: sequester.environments.local.checkpoint)
    def checkpoint(self, ep: EpisodeHandle | str) -> CheckpointInfo:
        """Seal the episode's files and go on from them (``Episode.checkpoint``): its shell
        restarted with its working directory and exports, other processes named as not
        restored. Held until :meth:`release` or until the episode that made it is closed
        (episodes started on it keep its layers)."""
        episode_id = self._route(ep)
        got = self._backend.call(episode_id, "checkpoint")
        return self._checkpoint_info(episode_id, got)

    def rollback(self, ep: EpisodeHandle | str, checkpoint: CheckpointInfo | str) -> None:
        """Start the episode again on ``checkpoint`` (one of this pool's episodes', on the
        same Ray actor for the Ray backend): every change since is gone."""
        source, local = _checkpoint_route(checkpoint)
        self._backend.rollback(self._route(ep), source, local)

    def release(self, checkpoint: CheckpointInfo | str) -> None:
        """Let a checkpoint go (idempotent; its layers stay while episodes stand on them)."""
        source, local = _checkpoint_route(checkpoint)
        self._backend.release(source, local)

    def fork(self, checkpoint: CheckpointInfo | str, *, wait_timeout: Any = _POOL_ARGUMENT) -> EpisodeHandle:
        """A new episode started on ``checkpoint``: its own writable layer, namespaces,
        network and processes, sharing the layers up to it. It takes a slot like
        :meth:`reset` (never a warm episode) and waits the same way at capacity."""
        source, local = _checkpoint_route(checkpoint)
        task_id = self._task_of(source)
        got = self._slot(_fork_folder(source, local), task_id, wait_timeout)
        assert isinstance(got, str)  # (no warm episode is ever kept for a fork's folder)
        try:
            started = self._backend.start_fork(got, task_id, source, local)
        except BaseException:
            self._free(got)
            raise
        return self._handed(got, task_id, started)

    def checkpoint_task(self, checkpoint: CheckpointInfo | str) -> str:
        """The task id of the episode that made ``checkpoint`` (while it is held)."""
        return self._task_of(_checkpoint_route(checkpoint)[0])

    def _task_of(self, episode_id: str) -> str:
        with self._lock:
            entry = self._entries.get(episode_id)
            if entry is not None and entry.state == "held":
                return entry.task_id
        raise EpisodeError(f"episode {episode_id[:64]!r}: its checkpoints went when it was closed")

    @staticmethod
    def _checkpoint_info(episode_id: str, got: dict[str, Any]) -> CheckpointInfo:
        return CheckpointInfo(
            f"{episode_id}-{got['id']}", episode_id, int(got["depth"]), int(got["bytes"]), tuple(got["not_restored"])
        )

    def _route(self, ep: EpisodeHandle | str) -> str:
        episode_id = ep.episode_id if isinstance(ep, EpisodeHandle) else ep
        if not isinstance(episode_id, str):
            raise PolicyError(f"episode: {type(ep).__name__} is not an EpisodeHandle or an episode id")
        with self._lock:
            entry = self._entries.get(episode_id)
            if entry is not None and entry.state == "held":
                return episode_id
            gone = self._gone.get(episode_id)
        if gone is not None:
            raise gone[0](gone[1])
        raise EpisodeError(f"episode {episode_id[:64]!r}: not an episode of this pool")

    def exec(self, ep: EpisodeHandle | str, command: str, timeout: float | None = None) -> ExecOutput:
        """Run ``command`` in the episode's shell (its state persists between calls)."""
        result: ExecOutput = self._backend.call(self._route(ep), "exec", command, timeout)
        return result

    def write_file(self, ep: EpisodeHandle | str, path: str, data: bytes | str, mode: int = 0o644) -> int:
        """Write a file in the episode (as its root); the bytes written."""
        written: int = self._backend.call(self._route(ep), "write_file", path, data, mode)
        return written

    def read_file(self, ep: EpisodeHandle | str, path: str) -> FileContent:
        """The file's bytes, at most ``read_cap`` of them (``.truncated`` says it was longer)."""
        return FileContent.of(self._backend.call(self._route(ep), "read_file", path))

    def evaluate(self, ep: EpisodeHandle | str) -> Verdict:
        """The verdict, once per episode: later calls on it are refused (close it)."""
        verdict: Verdict = self._backend.call(self._route(ep), "evaluate")
        return verdict

    def _begin_close(self, ep: EpisodeHandle | str) -> Future[None] | None:
        """Refuse every later call on the episode at once ("closed") and start closing it;
        None when it is closed or lost already (nothing to do)."""
        episode_id = ep.episode_id if isinstance(ep, EpisodeHandle) else ep
        if not isinstance(episode_id, str):
            raise PolicyError(f"episode: {type(ep).__name__} is not an EpisodeHandle or an episode id")
        with self._lock:
            entry = self._entries.get(episode_id)
            if entry is None or entry.state != "held":
                if episode_id in self._gone:
                    return None
                raise EpisodeError(f"episode {episode_id[:64]!r}: not an episode of this pool")
            del self._entries[episode_id]
            self._forget(episode_id, EpisodeError, f"episode {episode_id}: it was closed")
            self._closing += 1
        closing = self._backend.begin_close(episode_id)
        closing.add_done_callback(partial(self._closed, episode_id))
        return closing

    def close(self, ep: EpisodeHandle | str) -> None:
        """Close the episode, killing what runs in it; its slot is free once it is closed.
        Idempotent; a lost episode is just forgotten."""
        closing = self._begin_close(ep)
        if closing is not None:
            try:
                closing.result(self.close_grace + self._backend.close_margin)
            except FutureTimeout:
                log.warning(
                    "episode pool: a call did not stop within %g s; it closes when the call ends", self.close_grace
                )
            except Exception:  # noqa: BLE001 - logged by _closed: a failed cleanup is not the caller's
                pass

    # -- async API ----------------------------------------------------------------------------
    async def areset(self, task_id: str, *, wait_timeout: Any = _POOL_ARGUMENT) -> EpisodeHandle:
        """:meth:`reset` on an event loop, which it never blocks. Cancelled while it waits,
        it leaves the queue; while its episode starts, that episode is closed."""
        folder = self._folder(task_id)
        got = await self._aslot(folder, task_id, wait_timeout)
        if isinstance(got, EpisodeHandle):
            return got
        episode_id = got
        try:
            prepared = await self._backend.aprepare(folder)
            started = await self._backend.astart(episode_id, task_id, folder, prepared)
        except asyncio.CancelledError:  # the start goes on: its episode is closed, then its slot freed
            self._abandon(episode_id)
            raise
        except BaseException:
            self._free(episode_id)
            raise
        return self._handed(episode_id, task_id, started)

    aacquire = areset

    async def _aslot(self, folder: Path, task_id: str, wait_timeout: Any) -> EpisodeHandle | str:
        waited = self._wait_for(wait_timeout)
        taken = self._take(folder, task_id, asyncio.get_running_loop(), waited)
        if isinstance(taken, _Waiter):
            waiter = taken
            assert waiter.future is not None
            try:
                await asyncio.wait_for(asyncio.shield(waiter.future), waited)
            except TimeoutError:
                grant = self._gave_up(waiter, waited)
            except asyncio.CancelledError:
                self._cancelled(waiter)
                raise
            else:
                grant = waiter.grant if waiter.grant is not None else self._gave_up(waiter, waited)
        else:
            grant = taken
        return self._granted(grant)

    async def acheckpoint(self, ep: EpisodeHandle | str) -> CheckpointInfo:
        episode_id = self._route(ep)
        got = await self._backend.acall(episode_id, "checkpoint")
        return self._checkpoint_info(episode_id, got)

    async def arollback(self, ep: EpisodeHandle | str, checkpoint: CheckpointInfo | str) -> None:
        source, local = _checkpoint_route(checkpoint)
        await self._backend.arollback(self._route(ep), source, local)

    async def arelease(self, checkpoint: CheckpointInfo | str) -> None:
        source, local = _checkpoint_route(checkpoint)
        await asyncio.to_thread(self._backend.release, source, local)

    async def afork(self, checkpoint: CheckpointInfo | str, *, wait_timeout: Any = _POOL_ARGUMENT) -> EpisodeHandle:
        """:meth:`fork` on an event loop (cancelled while it starts, its episode is closed)."""
        source, local = _checkpoint_route(checkpoint)
        task_id = self._task_of(source)
        got = await self._aslot(_fork_folder(source, local), task_id, wait_timeout)
        assert isinstance(got, str)
        try:
            started = await self._backend.astart_fork(got, task_id, source, local)
        except asyncio.CancelledError:
            self._abandon(got)
            raise
        except BaseException:
            self._free(got)
            raise
        return self._handed(got, task_id, started)

    def _abandon(self, episode_id: str) -> None:
        with self._lock:
            if self._entries.pop(episode_id, None) is None:
                return
            self._closing += 1
        self._backend.begin_close(episode_id).add_done_callback(partial(self._closed, episode_id))

    async def aexec(self, ep: EpisodeHandle | str, command: str, timeout: float | None = None) -> ExecOutput:
        result: ExecOutput = await self._backend.acall(self._route(ep), "exec", command, timeout)
        return result

    async def awrite_file(self, ep: EpisodeHandle | str, path: str, data: bytes | str, mode: int = 0o644) -> int:
        written: int = await self._backend.acall(self._route(ep), "write_file", path, data, mode)
        return written

    async def aread_file(self, ep: EpisodeHandle | str, path: str) -> FileContent:
        return FileContent.of(await self._backend.acall(self._route(ep), "read_file", path))

    async def aevaluate(self, ep: EpisodeHandle | str) -> Verdict:
        verdict: Verdict = await self._backend.acall(self._route(ep), "evaluate")
        return verdict

    async def aclose(self, ep: EpisodeHandle | str) -> None:
        closing = self._begin_close(ep)
        if closing is not None:
            try:
                await asyncio.wait_for(
                    asyncio.shield(asyncio.wrap_future(closing)), self.close_grace + self._backend.close_margin
                )
            except TimeoutError:
                log.warning(
                    "episode pool: a call did not stop within %g s; it closes when the call ends", self.close_grace
                )
            except Exception:  # noqa: BLE001 - logged by _closed
                pass

    # -- shutdown -----------------------------------------------------------------------------
    def shutdown(self, timeout: float | None = None) -> None:
        """Close every episode, handed out or warm (their processes killed, their layers
        removed), and wait for it (at most ``timeout`` seconds, default ``close_grace`` +
        30); waiting callers are refused. Later calls are refused. Idempotent."""
        with self._lock:
            if self._shut:
                return
            self._shut = True
            waiters, self._waiters = list(self._waiters), deque()
            for waiter in waiters:
                waiter.grant = ("error", self._backend.unusable("the episode pool was shut down"))
            live = list(self._entries)
            for episode_id in live:
                self._forget(episode_id, EpisodeError, f"episode {episode_id}: it was closed (the pool was shut down)")
            self._entries.clear()
            self._warm.clear()
        self._stopping.set()
        self._starts.put(None)
        for waiter in waiters:
            waiter.wake()
        self._backend.shutdown(self.close_grace + 30 if timeout is None else timeout)
        log.info("episode pool: shut down (%d episodes closed)", len(live))

    async def ashutdown(self, timeout: float | None = None) -> None:
        await asyncio.to_thread(self.shutdown, timeout)

    def __enter__(self) -> EpisodePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    async def __aenter__(self) -> EpisodePool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.ashutdown()


_FORKS = Path("/nonexistent/sequester-forks")  # a fork's slot's folder: no warm episode is ever kept there


def _fork_folder(source: str, local: str) -> Path:
    return _FORKS / f"{source}-{local}"


def _checkpoint_route(checkpoint: CheckpointInfo | str) -> tuple[str, str]:
    """``(episode id, its checkpoint's id)`` of a pool checkpoint id (``EPISODE-CHECKPOINT``)."""
    cid = checkpoint.id if isinstance(checkpoint, CheckpointInfo) else checkpoint
    if not isinstance(cid, str):
        raise PolicyError(f"checkpoint: {type(checkpoint).__name__} is not a CheckpointInfo or a checkpoint id")
    source, sep, local = cid.rpartition("-")
    if not sep or not source or not local or not (source + local).isalnum() or len(cid) > 128:
        raise EpisodeError(f"checkpoint {cid[:64]!r}: not a checkpoint id of this pool")
    return source, local
