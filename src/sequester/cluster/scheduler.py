"""A job's trials on a Ray cluster (``sequester run --backend ray``).

Each trial is one Ray task (:func:`~.remote.trial_task`) asking for the CPUs and memory
its ``task.toml`` declares; at most ``concurrency`` are in flight. The task folder goes
through the object store once per task; the result and the trial's folder come back
and the driver writes the job folder (:mod:`.landing`), so the job folder, the progress
bar and the summary are the local runner's.

Failures, by whose they are:

* a trial's own failure (the agent, the task, the verifier) is in its result, as on the
  local runner: the node's :func:`~sequester.jobs.trial.run_trial` never raises for it;
* a trial lost with its worker or node (Ray's system errors) is retried once, on another
  node when there is one, and the lost attempt (error, node, worker pid, time) is in the
  result's ``retries``; lost again, it is an error naming both losses;
* a trial no node can hold (more CPUs or memory than the largest node) is an error at
  once (``UnsupportedByBackend``), never a task Ray would queue forever.

Ctrl-C (:meth:`RayScheduler.stop`): the job's monitor actor is told, every running trial
aborts its episode and comes back with an interrupted result; a trial that has not come
back after ``cancel_grace`` seconds is force-cancelled (its worker killed, and its
sandboxes with it), and the scheduler waits until Ray has ended it.
"""

from __future__ import annotations

import logging
import shutil
import tarfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sequester.cluster.bundles import pack_task
from sequester.cluster.connect import ClusterError, connect, system_failures
from sequester.cluster.landing import land_error, land_trial
from sequester.cluster.node import TrialOrder, machine_defaults
from sequester.cluster.remote import JobMonitor, trial_task
from sequester.environments import UnsupportedByBackend
from sequester.errors import PolicyError
from sequester.jobs.cancel import TrialCancelled
from sequester.jobs.results import TrialResult, utc_now
from sequester.jobs.schedule import JobRun, PlannedTrial
from sequester.tasks import Task

__all__ = ["RayScheduler", "trial_resources", "infeasible"]

log = logging.getLogger("sequester.cluster")


def trial_resources(task: Task) -> dict[str, float]:
    """What a trial asks Ray for: its task's ``cpus`` and ``memory_mb`` (bytes)."""
    env = task.config.environment
    need = {"num_cpus": float(env.cpus)}
    if env.memory_mb:
        need["memory"] = float(env.memory_mb) * (1 << 20)
    return need


def infeasible(need: dict[str, float], nodes: list[dict[str, float]]) -> str | None:
    """Why no node of ``nodes`` (each its total resources) can ever hold ``need``; None if one can."""
    for node in nodes:
        if node.get("CPU", 0.0) >= need["num_cpus"] and node.get("memory", 0.0) >= need.get("memory", 0.0):
            return None
    cpus = max((n.get("CPU", 0.0) for n in nodes), default=0.0)
    memory = max((n.get("memory", 0.0) for n in nodes), default=0.0)
    wanted = f"{need['num_cpus']:g} CPUs" + (f" and {need['memory'] / (1 << 20):.0f} MB" if "memory" in need else "")
    return (
        f"the task asks for {wanted}; no node of the cluster has that much (the largest: {cpus:g} CPUs, "
        f"{memory / (1 << 20):.0f} MB)"
    )


@dataclass
class _Attempt:
    trial: PlannedTrial
    number: int
    retries: list[dict[str, Any]] = field(default_factory=list)
    started_at: str = field(default_factory=utc_now)


class RayScheduler:
    """Trials as Ray tasks on the cluster at ``address`` (see :func:`~.connect.connect`)."""

    runs_here = False

    def __init__(
        self,
        address: str | None = None,
        concurrency: int = 4,
        *,
        retries: int = 1,
        cancel_grace: float = 30.0,
        **init: Any,
    ):
        self.address, self.concurrency, self.retries, self.cancel_grace = address, concurrency, retries, cancel_grace
        self._init = init
        self._ray: Any = None
        self._job: JobRun | None = None
        self._monitor: Any = None
        self._remote: Any = None
        self._pending: dict[Any, _Attempt] = {}
        self._bundles: dict[Path, Any] = {}
        self._nodes: list[dict[str, Any]] = []
        self._stopping = False
        self._forced = False

    def describe(self) -> dict[str, object]:
        return {
            "type": "ray",
            "address": self.address,
            "n_concurrent_trials": self.concurrency,
            "retries": self.retries,
        }

    # -- running ------------------------------------------------------------------------
    def run(self, job: JobRun, trials: list[PlannedTrial], started: Callable[[str], None]) -> Iterator[TrialResult]:
        ray = self._ray = connect(self.address, **self._init)
        self._job = job
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = ray.get_runtime_context().get_node_id()
        self._monitor = (
            ray.remote(JobMonitor)
            .options(
                num_cpus=0, max_concurrency=100_000, scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True)
            )
            .remote()
        )
        self._remote = ray.remote(trial_task)
        # Up before the first trial: a trial tells the monitor where it runs without
        # waiting, and a call queued for an actor still starting dies with a worker
        # killed meanwhile (then the lost attempt would not say where it ran).
        ray.get(self._monitor.starts.remote(), timeout=120)
        self._nodes = [n for n in ray.nodes() if n.get("Alive")]
        # Every task packed before the first trial starts: one that cannot travel (a fifo,
        # a link out of it, too large, unreadable) is its trials' error, found now, not a
        # failure hours into the job that would stop every trial in flight.
        unshippable: dict[Path, Exception] = {}
        for task in {t.task.path: t.task for t in trials}.values():
            try:
                self._bundle(task)
            except (PolicyError, OSError) as exc:
                unshippable[task.path] = exc
        waiting = deque(trials)
        try:
            while (waiting and not self._stopping) or self._pending:
                while waiting and len(self._pending) < self.concurrency and not self._stopping:
                    trial = waiting.popleft()
                    if trial.task.path in unshippable:
                        yield land_error(trial, job, unshippable[trial.task.path], [])
                        continue
                    why = infeasible(trial_resources(trial.task), [n["Resources"] for n in self._nodes])
                    if why is not None:
                        yield land_error(trial, job, UnsupportedByBackend(why), [])
                        continue
                    self._submit(_Attempt(trial, 1))
                    started(trial.name)
                if not self._pending:
                    continue
                ready, _ = ray.wait(list(self._pending), num_returns=1, timeout=1.0)
                for ref in ready:
                    result = self._collect(ref, self._pending.pop(ref))
                    if result is not None:
                        yield result
        except BaseException:
            self._stopping = True  # stop() finishes what runs; nothing more is submitted
            raise
        self._end()

    def _bundle(self, task: Task) -> Any:
        if task.path not in self._bundles:
            self._bundles[task.path] = self._ray.put(pack_task(task.path))
        return self._bundles[task.path]

    def _submit(self, attempt: _Attempt, avoid: str | None = None) -> None:
        job, trial = self._job, attempt.trial
        assert job is not None
        order = TrialOrder(
            trial.name,
            job.agent_spec,
            job.settings,
            machine_defaults(job.settings),
            tuple(str(p) for p in job.hide),
            trial.source,
            job.job_id,
            attempt.number,
            job.agent_kwargs,
        )
        options: dict[str, Any] = {**trial_resources(trial.task), "max_retries": 0}  # retries are ours: recorded
        elsewhere = self._other_node(avoid, trial.task) if avoid else None
        if elsewhere is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(elsewhere, soft=True)
        ref = self._remote.options(**options).remote(order, self._bundle(trial.task), self._monitor)
        self._pending[ref] = attempt

    def _other_node(self, avoid: str, task: Task) -> str | None:
        need = trial_resources(task)
        for node in self._ray.nodes():
            if node.get("Alive") and node["NodeID"] != avoid and infeasible(need, [node["Resources"]]) is None:
                return node["NodeID"]
        return None

    def _collect(self, ref: Any, attempt: _Attempt) -> TrialResult | None:
        """The attempt's result landed in the job folder; None when it was resubmitted."""
        ray, job, trial = self._ray, self._job, attempt.trial
        assert job is not None
        try:
            returned = ray.get(ref)
        except ray.exceptions.TaskCancelledError:
            return land_error(trial, job, self._killed(), attempt.retries, started_at=attempt.started_at)
        except ray.exceptions.RayTaskError as exc:
            # sequester itself failed on the node, not the node (first: Ray's error for a
            # failure raised in the task is also an instance of its cause's class, which
            # may be one of the system failures below)
            cause = exc.cause if isinstance(getattr(exc, "cause", None), BaseException) else exc
            return land_error(trial, job, cause, attempt.retries, started_at=attempt.started_at)
        except system_failures() as exc:
            if self._forced:  # its worker was killed by the cancel itself
                return land_error(trial, job, self._killed(), attempt.retries, started_at=attempt.started_at)
            where = self._where(attempt)
            lost = {
                "attempt": attempt.number,
                "error_type": type(exc).__name__,
                "message": str(exc)[:2000],
                "node_id": where.get("node_id"),
                "pid": where.get("pid"),
                "at": utc_now(),
            }
            retries = [*attempt.retries, lost]
            if attempt.number <= self.retries and not self._stopping:
                log.warning(
                    "trial %s lost with its worker or node (%s): retrying elsewhere", trial.name, type(exc).__name__
                )
                self._submit(_Attempt(trial, attempt.number + 1, retries, attempt.started_at), where.get("node_id"))
                return None
            error = ClusterError(
                f"the trial was lost with its worker or node {len(retries)} time(s), the last: "
                f"{type(exc).__name__}: {str(exc)[:500]}"
            )
            return land_error(trial, job, error, retries, started_at=attempt.started_at)
        try:
            return land_trial(returned, trial, attempt.retries)
        except (PolicyError, OSError, tarfile.TarError) as exc:  # this trial's folder, not the job's
            log.error("trial %s: its folder could not be written: %s", trial.name, exc)
            shutil.rmtree(trial.trial_dir, ignore_errors=True)
            return land_error(trial, job, exc, attempt.retries, node=returned.node, started_at=attempt.started_at)

    def _killed(self) -> TrialCancelled:
        return TrialCancelled(
            f"the job was interrupted; the trial did not stop within {self.cancel_grace:g} s and its worker was killed"
        )

    def _where(self, attempt: _Attempt) -> dict[str, Any]:
        try:
            found = self._ray.get(self._monitor.start_of.remote(attempt.trial.name, attempt.number), timeout=10)
        except Exception:  # noqa: BLE001 - where it ran is information only
            found = None
        return found or {}

    # -- stopping -----------------------------------------------------------------------
    def stop(self) -> list[TrialResult]:
        self._stopping = True
        if self._ray is None or self._monitor is None:
            return []
        ray, results = self._ray, []
        try:
            self._monitor.cancel.remote()
            deadline = time.monotonic() + self.cancel_grace
            while self._pending and time.monotonic() < deadline:
                ready, _ = ray.wait(list(self._pending), num_returns=1, timeout=max(0.1, deadline - time.monotonic()))
                for ref in ready:
                    result = self._collect(ref, self._pending.pop(ref))
                    if result is not None:
                        results.append(result)
            self._forced = True
            for ref in list(self._pending):  # did not give way: its worker is killed, its sandboxes die with it
                ray.cancel(ref, force=True)
            ended = time.monotonic() + 30
            while self._pending and time.monotonic() < ended:
                ready, _ = ray.wait(list(self._pending), num_returns=len(self._pending), timeout=1.0)
                for ref in ready:  # a trial that finished in the meantime keeps its result
                    result = self._collect(ref, self._pending.pop(ref))
                    if result is not None:
                        results.append(result)
        finally:
            self._end()
        return results

    def _end(self) -> None:
        if self._monitor is not None:
            try:
                self._ray.kill(self._monitor)
            except Exception:  # noqa: BLE001 - gone already
                pass
            self._monitor = None
