"""The Ray backend of :class:`~sequester.environments.pool.EpisodePool`: episode actors
across a cluster, each call routed to the actor holding the episode.

    with EpisodePool(8, "tasks/", episodes_per_actor=64) as pool:       # backend="ray"
        ep = pool.reset("python-csv-stats")
        out = ep.exec("ls")                      # or: await ep.aexec("ls")
        verdict = ep.evaluate()                  # the verdict only (no test output)
        ep.close()

The pool (one class for both backends) keeps the ids, the slots, the warm episodes and the
waiting callers; :class:`RayBackend` runs the episodes. ``n_actors`` actors
(:class:`~.actor.EpisodeActor`, ``actor_cpus`` CPUs each) are spread over the nodes; each
holds up to ``episodes_per_actor`` episodes, and a start goes to the least-loaded live
actor. The pool's capacity is what the live actors hold; a reset beyond waits in the
pool's queue, and a refusal (:class:`RayPoolFull`) is both a
:class:`~sequester.errors.PoolFull` and a :class:`ClusterError`, as it was.

Tasks need no shared filesystem: a task id names a folder of ``tasks_dir``
(:func:`~sequester.tasks.finder.resolve_task_id`: nothing outside it), packed once per pool
and put in the object store once; each node unpacks it once into its own cache. Settings
paths the driver left at their default follow the node (:func:`~.node.settings_for_node`).

Failures, by whose they are: an actor (or its node) lost takes its episodes with it, the
pool is told (they are forgotten as lost, their slots freed), and every later call on one
of them raises :class:`ClusterError` naming the episode and the loss (``close`` of such an
episode just forgets it); the caller's mistakes inside the actor (an unknown or evaluated
episode, a bad path) come back as the actor raised them (not as Ray's wrapper); bad
arguments here are :class:`~sequester.errors.PolicyError`.

``EpisodePool``, ``EpisodeHandle``, ``Verdict``, ``FileContent`` and ``ExecOutput`` are
importable from here as before.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Awaitable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sequester.cluster.actor import EpisodeActor
from sequester.cluster.bundles import pack_task
from sequester.cluster.connect import ClusterError, connect, system_failures
from sequester.cluster.handle import ActorInfo
from sequester.environments.pool import EpisodeHandle, EpisodePool
from sequester.environments.pool.backend import LostCallback, Started
from sequester.environments.pool.held import ExecOutput, FileContent, Verdict
from sequester.environments.settings import EpisodeSettings
from sequester.errors import EpisodeError, PolicyError, PoolFull

__all__ = [
    "EpisodePool",
    "EpisodeHandle",
    "ActorInfo",
    "FileContent",
    "ExecOutput",
    "Verdict",
    "RayBackend",
    "RayPoolFull",
]

log = logging.getLogger("sequester.cluster")


class RayPoolFull(PoolFull, ClusterError):
    """The Ray backend's :class:`PoolFull`: a :class:`ClusterError` too, as its refusals
    at capacity were."""


@dataclass
class _Slot:
    index: int
    actor: Any
    node_id: str
    pid: int
    hostname: str
    load: int = 0
    alive: bool = True
    lost: str = ""


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PolicyError(f"{name}: {value!r} is not a whole number of at least 1")
    return value


def _done() -> Future[None]:
    future: Future[None] = Future()
    future.set_result(None)
    return future


class RayBackend:
    """Episode actors on the cluster at ``address`` (see module doc and :func:`~.connect.connect`).
    ``hide``: what the driver hides (its tasks folder among it); ``start_timeout``: seconds
    the actors may take to be placed and ready (then :class:`ClusterError`, not a wait);
    ``on_lost``: told which episodes an actor took with it."""

    name = "ray"
    unusable = ClusterError
    full = RayPoolFull
    close_margin = 30.0  # the actor waits close_grace for an interrupted call; then Ray answers

    def __init__(
        self,
        n_actors: int,
        tasks_dir: Path,
        *,
        settings: EpisodeSettings,
        hide: tuple[Path, ...],
        address: str | None,
        episodes_per_actor: int,
        actor_cpus: float,
        start_timeout: float,
        read_cap: int,
        close_grace: float,
        calibration: str,
        on_lost: LostCallback,
    ):
        _positive_int("n_actors", n_actors)
        self.episodes_per_actor = _positive_int("episodes_per_actor", episodes_per_actor)
        if (
            isinstance(actor_cpus, bool)
            or not isinstance(actor_cpus, (int, float))
            or not (math.isfinite(actor_cpus) and actor_cpus >= 0)
        ):
            raise PolicyError(f"actor_cpus: {actor_cpus!r} is not a number of CPUs (0 or more)")
        if isinstance(start_timeout, bool) or not isinstance(start_timeout, (int, float)) or not start_timeout > 0:
            raise PolicyError(f"start_timeout: {start_timeout!r} is not a positive number of seconds")
        from sequester.cluster.node import machine_defaults

        self.tasks_dir, self.settings, self.calibration = tasks_dir, settings, calibration
        self._on_lost = on_lost
        self._ray = ray = connect(address)
        self._lock = threading.Lock()
        self._bundle_lock = threading.Lock()
        self._bundles: dict[Path, tuple[str, Any]] = {}  # task folder -> (archive digest, object ref)
        self._where: dict[str, _Slot] = {}  # live episode -> its actor
        self._turn = 0
        self._shut = False
        remote = ray.remote(EpisodeActor).options(
            num_cpus=actor_cpus,
            max_concurrency=self.episodes_per_actor + 8,
            scheduling_strategy="SPREAD",
            max_restarts=0,
            max_task_retries=0,
        )  # a restarted actor would hold none of its episodes
        actors = [
            remote.remote(
                settings,
                machine_defaults(settings),
                tuple(str(p) for p in hide),
                self.episodes_per_actor,
                read_cap,
                close_grace,
            )
            for _ in range(n_actors)
        ]
        try:
            infos = ray.get([a.ready.remote() for a in actors], timeout=start_timeout)
        except Exception as exc:
            for actor in actors:
                ray.kill(actor)
            if isinstance(exc, ray.exceptions.GetTimeoutError):  # never a pool that waits forever for room
                raise ClusterError(
                    f"the cluster could not place {n_actors} episode actors of {actor_cpus:g} CPUs "
                    f"within {start_timeout:g} s (it has {ray.available_resources().get('CPU', 0):g} "
                    "CPUs free): fewer actors, or fewer actor_cpus"
                ) from None
            raise ClusterError(f"the episode actors could not start: {type(exc).__name__}: {exc}") from None
        self._slots = [
            _Slot(i, a, info["node_id"], info["pid"], info["hostname"])
            for i, (a, info) in enumerate(zip(actors, infos, strict=True))
        ]
        log.info(
            "episode pool: %d actors on %d nodes, %d episodes each",
            n_actors,
            len({s.node_id for s in self._slots}),
            self.episodes_per_actor,
        )

    # -- bookkeeping ------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Episodes the live actors can hold at once."""
        with self._lock:
            return sum(self.episodes_per_actor for s in self._slots if s.alive)

    def actors(self) -> list[ActorInfo]:
        with self._lock:
            return [ActorInfo(s.index, s.node_id, s.pid, s.hostname, s.alive, s.load) for s in self._slots]

    def init_pid(self, episode_id: str) -> int:
        raise EpisodeError(f"episode {episode_id}: it runs in a Ray actor, whose processes are not this host's to name")

    def _place(self, episode_id: str) -> _Slot:
        """The least-loaded live actor (ties in turn), its slot taken for ``episode_id``."""
        with self._lock:
            if self._shut:
                raise ClusterError("the episode pool was shut down")
            free = [s for s in self._slots if s.alive and s.load < self.episodes_per_actor]
            if not free:  # (the pool counts slots first: only when actors died meanwhile)
                live = sum(s.alive for s in self._slots)
                raise ClusterError(
                    f"no actor of the episode pool has room: {live} live actors × {self.episodes_per_actor} "
                    "episodes (episodes_per_actor) are held"
                )
            self._turn += 1
            slot = min(free, key=lambda s: (s.load, (s.index - self._turn) % len(self._slots)))
            slot.load += 1
            self._where[episode_id] = slot
            return slot

    def _place_on(self, episode_id: str, slot: _Slot) -> None:
        """``slot``'s actor takes ``episode_id`` (a fork: beside its checkpoint's layers)."""
        with self._lock:
            if self._shut:
                raise ClusterError("the episode pool was shut down")
            if not slot.alive or slot.load >= self.episodes_per_actor:
                raise ClusterError(
                    f"a fork runs on the actor of its checkpoint (its layers are that node's files), and "
                    f"actor #{slot.index} has no room: its {self.episodes_per_actor} episodes (episodes_per_actor) "
                    "are held"
                    if slot.alive
                    else f"the checkpoint's actor #{slot.index} is gone: {slot.lost}"
                )
            slot.load += 1
            self._where[episode_id] = slot

    def _release(self, episode_id: str, slot: _Slot) -> None:
        with self._lock:
            if self._where.pop(episode_id, None) is not None:
                slot.load -= 1

    def _route(self, episode_id: str) -> _Slot:
        with self._lock:
            slot = self._where.get(episode_id)
        if slot is None:
            raise EpisodeError(f"episode {episode_id[:64]!r}: not held by the pool's actors (closed, or lost)")
        return slot

    def _lose(self, slot: _Slot, exc: BaseException) -> None:
        """The actor is gone: it takes no more episodes, and the pool forgets its episodes as lost."""
        with self._lock:
            if slot.alive:
                slot.alive = False
                slot.lost = (
                    f"its actor #{slot.index} (pid {slot.pid}) on node {slot.node_id[:16]} "
                    f"({slot.hostname}) died or became unreachable ({type(exc).__name__})"
                )
                log.warning("episode pool: actor #%d: %s", slot.index, slot.lost)
            lost = [e for e, s in self._where.items() if s is slot]
            for episode_id in lost:
                del self._where[episode_id]
            slot.load = 0
        self._on_lost(lost, slot.lost)
        try:
            self._ray.kill(slot.actor)  # gone or unreachable: make sure it holds nothing any more
        except Exception:  # noqa: BLE001 - gone already
            pass

    def _failure(self, exc: Exception, episode_id: str, slot: _Slot, what: str) -> Exception:
        """What the caller sees for ``exc``, raised by Ray for a call to ``slot``."""
        ray = self._ray
        if isinstance(exc, ray.exceptions.RayTaskError):  # raised in the actor: its cause, not Ray's wrapper
            cause = getattr(exc, "cause", None)
            if isinstance(cause, Exception) and not isinstance(cause, system_failures()):
                return cause
            return ClusterError(f"episode {episode_id}: {what} failed in its actor: {str(cause or exc)[-2000:]}")
        if isinstance(exc, ray.exceptions.ActorUnavailableError):  # maybe back soon: this call only
            return ClusterError(
                f"episode {episode_id}: {what}: its actor #{slot.index} is unreachable for now "
                f"({exc}); the call may or may not have run"
            )
        if isinstance(exc, system_failures()):
            self._lose(slot, exc)
            return ClusterError(f"episode {episode_id} was lost ({what} failed): {slot.lost}")
        return exc

    def _get(self, ref: Any, episode_id: str, slot: _Slot, what: str) -> Any:
        try:
            return self._ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - translated (see _failure)
            raise self._failure(exc, episode_id, slot, what) from None

    async def _aget(self, ref: Awaitable[Any], episode_id: str, slot: _Slot, what: str) -> Any:
        try:
            return await ref
        except Exception as exc:  # noqa: BLE001 - translated (see _failure)
            raise self._failure(exc, episode_id, slot, what) from None

    # -- tasks ------------------------------------------------------------------------------
    def _check_calibration(self, folder: Path) -> dict[str, Any]:
        if self.calibration == "off":
            return {"state": "off"}
        from sequester import __version__
        from sequester.calibration import lookup
        from sequester.errors import TaskNotCalibrated
        from sequester.tasks.checksum import task_checksum

        state = lookup(
            task_checksum=task_checksum(folder),
            system=None,
            settings=self.settings,
            version=__version__,
            mode=self.calibration,
        )
        if state.state == "not-calibrated" or (self.calibration == "required" and state.state != "calibrated"):
            raise TaskNotCalibrated(f"task {folder.name} is not calibrated: {state.reason}")
        return state.to_dict()

    def _bundle(self, folder: Path) -> tuple[str, Any]:
        """The task's archive in the object store, packed and put once per pool."""
        with self._bundle_lock:
            if folder not in self._bundles:
                bundle = pack_task(folder)
                self._bundles[folder] = (bundle.digest, self._ray.put(bundle))
            return self._bundles[folder]

    def prepare(self, folder: Path) -> tuple[tuple[str, Any], dict[str, Any]]:
        """The task's calibration (the nodes choose their systems, so the key has none:
        a task it does not calibrate is refused before anything starts) and its archive."""
        calibration = self._check_calibration(folder)
        return self._bundle(folder), calibration

    async def aprepare(self, folder: Path) -> tuple[tuple[str, Any], dict[str, Any]]:
        calibration = await asyncio.to_thread(self._check_calibration, folder)  # (reads the task's files)
        cached = self._bundles.get(folder)
        bundle = cached if cached is not None else await asyncio.to_thread(self._bundle, folder)
        return bundle, calibration

    def _abandon(self, episode_id: str, slot: _Slot) -> None:
        """A start that did not come back: the actor may still start it; have it closed."""
        self._release(episode_id, slot)
        if slot.alive:
            try:
                slot.actor.close.remote(episode_id)
            except Exception:  # noqa: BLE001 - the actor is gone: so is the episode
                pass

    def _send_start(self, episode_id: str, task_id: str, prepared: Any) -> tuple[Any, _Slot]:
        slot = self._place(episode_id)
        (digest, ref), _ = prepared  # nested in a list: the actor fetches the archive only if it has not got it
        return slot.actor.reset.remote(episode_id, task_id, digest, [ref]), slot

    def _started(self, got: tuple[str, str], slot: _Slot, prepared: Any) -> Started:
        instruction, workdir = got
        return Started(instruction, workdir, slot.node_id, slot.index, prepared[1])

    def start(self, episode_id: str, task_id: str, folder: Path, prepared: Any) -> Started:
        ref, slot = self._send_start(episode_id, task_id, prepared)
        try:
            got = self._get(ref, episode_id, slot, "reset")
        except BaseException:
            self._abandon(episode_id, slot)
            raise
        return self._started(got, slot, prepared)

    async def astart(self, episode_id: str, task_id: str, folder: Path, prepared: Any) -> Started:
        ref, slot = self._send_start(episode_id, task_id, prepared)
        try:
            got = await self._aget(ref, episode_id, slot, "reset")
        except BaseException:  # cancelled too: the actor may have started it
            self._abandon(episode_id, slot)
            raise
        return self._started(got, slot, prepared)

    # -- calls ------------------------------------------------------------------------------
    def call(self, episode_id: str, method: str, *args: Any) -> Any:
        slot = self._route(episode_id)
        return self._get(getattr(slot.actor, method).remote(episode_id, *args), episode_id, slot, method)

    async def acall(self, episode_id: str, method: str, *args: Any) -> Any:
        slot = self._route(episode_id)
        return await self._aget(getattr(slot.actor, method).remote(episode_id, *args), episode_id, slot, method)

    # -- checkpoints: each is its actor's (the layers are files of that node) ------------------
    def _same_actor(self, episode_id: str, source_id: str) -> _Slot:
        slot, source = self._route(episode_id), self._route(source_id)
        if slot is not source:
            raise EpisodeError(
                f"episode {episode_id[:64]}: checkpoint of episode {source_id[:64]} is on another actor "
                "(a checkpoint's layers are files of its actor's node): roll back to one of that actor's episodes'"
            )
        return slot

    def rollback(self, episode_id: str, source_id: str, checkpoint_id: str) -> None:
        slot = self._same_actor(episode_id, source_id)
        self._get(slot.actor.rollback_to.remote(episode_id, source_id, checkpoint_id), episode_id, slot, "rollback")

    async def arollback(self, episode_id: str, source_id: str, checkpoint_id: str) -> None:
        slot = self._same_actor(episode_id, source_id)
        await self._aget(
            slot.actor.rollback_to.remote(episode_id, source_id, checkpoint_id), episode_id, slot, "rollback"
        )

    def release(self, source_id: str, checkpoint_id: str) -> None:
        with self._lock:
            slot = self._where.get(source_id)
        if slot is not None and slot.alive:
            self._get(slot.actor.release.remote(source_id, checkpoint_id), source_id, slot, "release")

    def _send_fork(self, episode_id: str, task_id: str, source_id: str, checkpoint_id: str) -> tuple[Any, _Slot]:
        slot = self._route(source_id)
        self._place_on(episode_id, slot)
        return slot.actor.fork.remote(episode_id, task_id, source_id, checkpoint_id), slot

    def start_fork(self, episode_id: str, task_id: str, source_id: str, checkpoint_id: str) -> Started:
        ref, slot = self._send_fork(episode_id, task_id, source_id, checkpoint_id)
        try:
            got = self._get(ref, episode_id, slot, "fork")
        except BaseException:
            self._abandon(episode_id, slot)
            raise
        return Started(got[0], got[1], slot.node_id, slot.index, {"state": "fork"})

    async def astart_fork(self, episode_id: str, task_id: str, source_id: str, checkpoint_id: str) -> Started:
        ref, slot = self._send_fork(episode_id, task_id, source_id, checkpoint_id)
        try:
            got = await self._aget(ref, episode_id, slot, "fork")
        except BaseException:
            self._abandon(episode_id, slot)
            raise
        return Started(got[0], got[1], slot.node_id, slot.index, {"state": "fork"})

    def begin_close(self, episode_id: str) -> Future[None]:
        """Ask the episode's actor to close it; the future is done when the actor has (its
        slot there free: the actor's own count agrees), or the actor is gone."""
        with self._lock:
            slot = self._where.pop(episode_id, None)
        if slot is None:
            return _done()
        closed: Future[None] = Future()
        ref = slot.actor.close.remote(episode_id)

        def wait() -> None:  # (a thread of its own: Ray's callback threads must not call Ray)
            try:
                self._get(ref, episode_id, slot, "close")
            except ClusterError as exc:  # the actor is gone, and its episode with it
                log.info("%s", exc)
            except BaseException as exc:  # noqa: BLE001 - the pool logs it
                closed.set_exception(exc)
            finally:
                with self._lock:
                    if slot.alive:
                        slot.load = max(0, slot.load - 1)
                if not closed.done():
                    closed.set_result(None)

        threading.Thread(target=wait, name="episode-pool-close", daemon=True).start()
        return closed

    # -- shutdown ---------------------------------------------------------------------------
    def shutdown(self, timeout: float) -> None:
        """Close every episode (their processes killed, their layers removed), then kill the
        actors. Idempotent."""
        with self._lock:
            if self._shut:
                return
            self._shut = True
            slots = list(self._slots)
            self._where.clear()
        ray = self._ray
        closing = [s.actor.close_all.remote() for s in slots if s.alive]
        try:
            ray.wait(closing, num_returns=len(closing), timeout=timeout)
        except Exception:  # noqa: BLE001 - the kill below ends what did not close
            log.exception("episode pool: closing the episodes")
        for slot in slots:
            slot.alive, slot.load = False, 0
            try:
                ray.kill(slot.actor)
            except Exception:  # noqa: BLE001 - gone already
                pass
        self._bundles.clear()
