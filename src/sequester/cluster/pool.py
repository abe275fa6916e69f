"""A pool of episode actors across a Ray cluster, for RL trainers: ``reset`` / ``exec`` /
``evaluate`` / ``close`` routed to the actor holding the episode, sync and async.

    with EpisodePool(8, "tasks/", episodes_per_actor=64) as pool:
        ep = pool.reset("python-csv-stats")
        out = ep.exec("ls")                      # or: await ep.aexec("ls")
        verdict = ep.evaluate()                  # the verdict only (no test output)
        ep.close()

``n_actors`` actors (:class:`~.actor.EpisodeActor`, ``actor_cpus`` CPUs each) are spread
over the nodes; each holds up to ``episodes_per_actor`` episodes, so a rollout loop can
hold hundreds. ``reset`` picks the least-loaded live actor and is refused at once
(:class:`ClusterError`) beyond the pool's capacity: it never waits for a slot.

Tasks need no shared filesystem: a task id names a folder of ``tasks_dir``
(``resolve_task``: nothing outside it), packed once per pool and put in the object store
once; each node unpacks it once into its own cache. Settings paths the driver left at
their default follow the node (:func:`~.node.settings_for_node`).

Failures, by whose they are: an actor (or its node) lost takes its episodes with it, and
every later call on one of them raises :class:`ClusterError` naming the episode and the
loss (``close`` of such an episode just forgets it); the caller's mistakes inside the
actor (an unknown or evaluated episode, a bad path) come back as the actor raised them
(not as Ray's wrapper); bad arguments here are :class:`~sequester.errors.PolicyError`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import uuid
from collections import OrderedDict
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sequester.cluster.actor import CLOSE_GRACE, READ_CAP, EpisodeActor, ExecOutput, FileContent, Verdict
from sequester.cluster.bundles import pack_task
from sequester.cluster.connect import ClusterError, connect, system_failures
from sequester.cluster.handle import ActorInfo, EpisodeHandle
from sequester.environments.settings import EpisodeSettings
from sequester.errors import EpisodeError, PolicyError

__all__ = ["EpisodePool", "EpisodeHandle", "ActorInfo", "FileContent", "ExecOutput", "Verdict"]

log = logging.getLogger("sequester.cluster")

_REMEMBERED = 65536  # closed and lost episode ids remembered (for a clear error on reuse)


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


class EpisodePool:
    """Episode actors on the cluster at ``address`` (see module doc and :func:`~.connect.connect`).

    ``settings``: the episodes' (default: :class:`EpisodeSettings`); ``start_timeout``: seconds
    the actors may take to be placed and ready (then :class:`ClusterError`, not a wait);
    ``read_cap``: bytes a ``read_file`` returns at most; ``close_grace``: seconds a close
    waits for an interrupted call to give way."""

    def __init__(
        self,
        n_actors: int,
        tasks_dir: str | Path,
        *,
        settings: EpisodeSettings | None = None,
        address: str | None = None,
        episodes_per_actor: int = 64,
        actor_cpus: float = 1.0,
        start_timeout: float = 120.0,
        read_cap: int = READ_CAP,
        close_grace: float = CLOSE_GRACE,
        calibration: str = "auto",
    ):
        _positive_int("n_actors", n_actors)
        if calibration not in ("auto", "required", "off"):
            raise PolicyError(f"calibration: {calibration!r} is not auto, required or off")
        self.calibration = calibration
        self.episodes_per_actor = _positive_int("episodes_per_actor", episodes_per_actor)
        self.read_cap = _positive_int("read_cap", read_cap)
        if (
            isinstance(actor_cpus, bool)
            or not isinstance(actor_cpus, (int, float))
            or not (math.isfinite(actor_cpus) and actor_cpus >= 0)
        ):
            raise PolicyError(f"actor_cpus: {actor_cpus!r} is not a number of CPUs (0 or more)")
        self.tasks_dir = Path(tasks_dir).resolve()
        if not self.tasks_dir.is_dir():
            raise PolicyError(f"tasks_dir: {str(tasks_dir)!r} is not a folder")
        from sequester.cluster.node import machine_defaults

        self.settings = settings or EpisodeSettings()
        self._ray = ray = connect(address)
        self._lock = threading.Lock()
        self._bundle_lock = threading.Lock()
        self._bundles: dict[Path, tuple[str, Any]] = {}  # task folder -> (archive digest, object ref)
        self._where: dict[str, _Slot] = {}  # live episode -> its actor
        self._gone: OrderedDict[str, tuple[bool, str]] = OrderedDict()  # closed or lost episode -> (lost, why)
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
                self.settings,
                machine_defaults(self.settings),
                (str(self.tasks_dir),),
                self.episodes_per_actor,
                self.read_cap,
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

    def _forget(self, episode_id: str, why: str, lost: bool = False) -> None:
        self._gone[episode_id] = (lost, why)
        while len(self._gone) > _REMEMBERED:
            self._gone.popitem(last=False)

    def _reserve(self) -> tuple[str, _Slot]:
        """A new episode id on the least-loaded live actor (ties in turn), or ClusterError now."""
        with self._lock:
            if self._shut:
                raise ClusterError("the episode pool was shut down")
            free = [s for s in self._slots if s.alive and s.load < self.episodes_per_actor]
            if not free:
                live = sum(s.alive for s in self._slots)
                raise ClusterError(
                    f"the episode pool is full: {live} live actors × {self.episodes_per_actor} "
                    "episodes (episodes_per_actor) are held; close one first"
                )
            self._turn += 1
            slot = min(free, key=lambda s: (s.load, (s.index - self._turn) % len(self._slots)))
            slot.load += 1
            episode_id = uuid.uuid4().hex
            self._where[episode_id] = slot
            return episode_id, slot

    def _release(self, episode_id: str, slot: _Slot) -> None:
        with self._lock:
            if self._where.pop(episode_id, None) is not None:
                slot.load -= 1
            self._gone.pop(episode_id, None)  # never handed out: nothing to remember

    @staticmethod
    def _episode_id(ep: EpisodeHandle | str) -> str:
        episode_id = ep.episode_id if isinstance(ep, EpisodeHandle) else ep
        if not isinstance(episode_id, str):
            raise PolicyError(f"episode: {type(ep).__name__} is not an EpisodeHandle or an episode id")
        return episode_id

    def _route(self, ep: EpisodeHandle | str) -> tuple[str, _Slot]:
        episode_id = self._episode_id(ep)
        with self._lock:
            slot = self._where.get(episode_id)
            if slot is not None:
                return episode_id, slot
            gone = self._gone.get(episode_id)
        if gone is not None:
            lost, why = gone
            raise ClusterError(why) if lost else EpisodeError(why)
        raise EpisodeError(f"episode {episode_id[:64]!r}: not an episode of this pool")

    def _lose(self, slot: _Slot, exc: BaseException) -> None:
        """The actor is gone: it takes no more resets, and its episodes are remembered as lost."""
        with self._lock:
            if slot.alive:
                slot.alive = False
                slot.lost = (
                    f"its actor #{slot.index} (pid {slot.pid}) on node {slot.node_id[:16]} "
                    f"({slot.hostname}) died or became unreachable ({type(exc).__name__})"
                )
                log.warning("episode pool: actor #%d: %s", slot.index, slot.lost)
            for episode_id in [e for e, s in self._where.items() if s is slot]:
                del self._where[episode_id]
                self._forget(episode_id, f"episode {episode_id} was lost: {slot.lost}", lost=True)
            slot.load = 0
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
    def _check_calibration(self, folder: Path) -> None:
        if self.calibration == "off":
            return
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

    def _folder(self, task_id: str) -> Path:
        from sequester.serve import protocol
        from sequester.serve.sessions import resolve_task

        if self._shut:
            raise ClusterError("the episode pool was shut down")
        if not isinstance(task_id, str) or not task_id or len(task_id) > 4096:
            raise PolicyError(f"task_id: {type(task_id).__name__} is not the name of a task of the tasks folder")
        try:  # attack stopped: naming a task outside tasks_dir (see resolve_task)
            return resolve_task(self.tasks_dir, task_id, "task_id")
        except protocol.FrameError as exc:
            raise PolicyError(exc.message) from None

    def _bundle(self, folder: Path) -> tuple[str, Any]:
        """The task's archive in the object store, packed and put once per pool."""
        with self._bundle_lock:
            if folder not in self._bundles:
                bundle = pack_task(folder)
                self._bundles[folder] = (bundle.digest, self._ray.put(bundle))
            return self._bundles[folder]

    def _abandon(self, episode_id: str, slot: _Slot) -> None:
        """A reset that did not come back: the actor may still start it; have it closed."""
        self._release(episode_id, slot)
        if slot.alive:
            try:
                slot.actor.close.remote(episode_id)
            except Exception:  # noqa: BLE001 - the actor is gone: so is the episode
                pass

    def _send_reset(self, task_id: str, bundle: tuple[str, Any]) -> tuple[Any, str, _Slot]:
        episode_id, slot = self._reserve()
        digest, ref = bundle  # nested in a list: the actor fetches the archive only if it has not got it
        return slot.actor.reset.remote(episode_id, task_id, digest, [ref]), episode_id, slot

    def _send(self, ep: EpisodeHandle | str, method: str, *args: Any) -> tuple[Any, str, _Slot]:
        episode_id, slot = self._route(ep)
        return getattr(slot.actor, method).remote(episode_id, *args), episode_id, slot

    def _begin_close(self, ep: EpisodeHandle | str) -> tuple[Any, str, _Slot] | None:
        """Refuse every later call on the episode at once ("closed"), and ask its actor to
        close it; None when it is closed or lost already (nothing to do)."""
        episode_id = self._episode_id(ep)
        with self._lock:
            slot = self._where.pop(episode_id, None)
            if slot is None:
                if episode_id in self._gone:
                    return None
                raise EpisodeError(f"episode {episode_id[:64]!r}: not an episode of this pool")
            self._forget(episode_id, f"episode {episode_id}: it was closed")
        return slot.actor.close.remote(episode_id), episode_id, slot

    def _end_close(self, slot: _Slot) -> None:
        with self._lock:  # the slot is free once the actor has closed it (its own count agrees)
            if slot.alive:
                slot.load = max(0, slot.load - 1)

    # -- sync API ---------------------------------------------------------------------------
    def reset(self, task_id: str) -> EpisodeHandle:
        """A new episode on task ``task_id`` (a folder of ``tasks_dir``), started. A task whose
        calibration (sequester.calibration, with the pool's settings: the nodes choose their
        systems, so the key has none) does not calibrate it is refused with
        :class:`~sequester.errors.TaskNotCalibrated` before anything starts; with
        ``calibration="required"``, one without a calibrated record too."""
        folder = self._folder(task_id)
        self._check_calibration(folder)
        ref, episode_id, slot = self._send_reset(task_id, self._bundle(folder))
        try:
            started: tuple[str, str] = self._get(ref, episode_id, slot, "reset")  # instruction, workdir
        except BaseException:
            self._abandon(episode_id, slot)
            raise
        return EpisodeHandle(episode_id, task_id, *started, slot.node_id, slot.index, self)

    def exec(self, ep: EpisodeHandle | str, command: str, timeout: float | None = None) -> ExecOutput:
        return self._get(*self._send(ep, "exec", command, timeout), "exec")

    def write_file(self, ep: EpisodeHandle | str, path: str, data: bytes | str, mode: int = 0o644) -> int:
        """Write a file in the episode (as its root); the bytes written."""
        return self._get(*self._send(ep, "write_file", path, data, mode), "write_file")

    def read_file(self, ep: EpisodeHandle | str, path: str) -> FileContent:
        """The file's bytes, at most ``read_cap`` of them (``.truncated`` says it was longer)."""
        return FileContent.of(self._get(*self._send(ep, "read_file", path), "read_file"))

    def evaluate(self, ep: EpisodeHandle | str) -> Verdict:
        """The verdict, once per episode: later calls on it are refused (close it)."""
        return self._get(*self._send(ep, "evaluate"), "evaluate")

    def close(self, ep: EpisodeHandle | str) -> None:
        """Close the episode, killing what runs in it. Idempotent; a lost episode is just forgotten."""
        begun = self._begin_close(ep)
        if begun is not None:
            try:
                self._get(*begun, "close")
            except ClusterError as exc:  # the actor is gone, and its episode with it
                log.info("%s", exc)
            finally:
                self._end_close(begun[2])

    # -- async API (Ray's object refs are awaitable) ----------------------------------------
    async def areset(self, task_id: str) -> EpisodeHandle:
        folder = self._folder(task_id)
        await asyncio.to_thread(self._check_calibration, folder)  # (reads the task's files)
        cached = self._bundles.get(folder)
        bundle = cached if cached is not None else await asyncio.to_thread(self._bundle, folder)
        ref, episode_id, slot = self._send_reset(task_id, bundle)
        try:
            started: tuple[str, str] = await self._aget(ref, episode_id, slot, "reset")  # instruction, workdir
        except BaseException:  # cancelled too: the actor may have started it
            self._abandon(episode_id, slot)
            raise
        return EpisodeHandle(episode_id, task_id, *started, slot.node_id, slot.index, self)

    async def aexec(self, ep: EpisodeHandle | str, command: str, timeout: float | None = None) -> ExecOutput:
        return await self._aget(*self._send(ep, "exec", command, timeout), "exec")

    async def awrite_file(self, ep: EpisodeHandle | str, path: str, data: bytes | str, mode: int = 0o644) -> int:
        return await self._aget(*self._send(ep, "write_file", path, data, mode), "write_file")

    async def aread_file(self, ep: EpisodeHandle | str, path: str) -> FileContent:
        return FileContent.of(await self._aget(*self._send(ep, "read_file", path), "read_file"))

    async def aevaluate(self, ep: EpisodeHandle | str) -> Verdict:
        return await self._aget(*self._send(ep, "evaluate"), "evaluate")

    async def aclose(self, ep: EpisodeHandle | str) -> None:
        begun = self._begin_close(ep)
        if begun is not None:
            try:
                await self._aget(*begun, "close")
            except ClusterError as exc:
                log.info("%s", exc)
            finally:
                self._end_close(begun[2])

    # -- shutdown ---------------------------------------------------------------------------
    def shutdown(self, timeout: float = CLOSE_GRACE + 30) -> None:
        """Close every episode (their processes killed, their layers removed), then kill the
        actors. Idempotent."""
        with self._lock:
            if self._shut:
                return
            self._shut = True
            slots, live = list(self._slots), list(self._where)
            for episode_id in live:
                self._forget(episode_id, f"episode {episode_id}: it was closed (the pool was shut down)")
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
        log.info("episode pool: shut down (%d episodes closed)", len(live))

    async def ashutdown(self, timeout: float = CLOSE_GRACE + 30) -> None:
        await asyncio.to_thread(self.shutdown, timeout)

    def __enter__(self) -> EpisodePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    async def __aenter__(self) -> EpisodePool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.ashutdown()
