"""What runs inside the cluster for a job: the trial task and the job's monitor actor.

:func:`trial_task` is the body of the Ray task that runs one trial on a node. It tells
the :class:`JobMonitor` (an actor beside the driver) where it started, so a trial lost
with its worker or node can be retried elsewhere and the loss recorded, and it watches
the monitor for the job's cancellation: on Ctrl-C the driver cancels through it, the
trial's episode is aborted (its processes killed at once), the trial writes its result
as interrupted and comes back like any other. If the monitor goes away (the driver
died), the trial stops the same way; and a worker killed outright takes its episode's
sandboxes with it (``bwrap --die-with-parent``).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from sequester.cluster.bundles import TaskBundle
from sequester.cluster.connect import ray_dirs, require_ray
from sequester.cluster.node import TrialOrder, TrialReturn, run_order
from sequester.jobs.cancel import Cancellation

__all__ = ["trial_task", "JobMonitor", "WATCH_SECONDS"]

WATCH_SECONDS = 5.0  # one monitor call per trial per this long while nothing happens


def trial_task(order: TrialOrder, bundle: TaskBundle, monitor: Any) -> TrialReturn:
    ray = require_ray()
    import os

    node_id = ray.get_runtime_context().get_node_id()
    # Not awaited: the monitor's first call waits for its worker to start (about a second),
    # which no trial should; the call is on its way before the trial does anything.
    monitor.started.remote(order.name, order.attempt, node_id, os.getpid())
    cancel = Cancellation()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            try:
                if ray.get(monitor.wait_cancelled.remote(WATCH_SECONDS), timeout=WATCH_SECONDS + 30):
                    break
            except Exception:  # noqa: BLE001 - the monitor is gone (the driver died): stop the trial
                break
        if not done.is_set():
            cancel.cancel()

    threading.Thread(target=watch, name=f"watch-{order.name}", daemon=True).start()
    try:
        return run_order(order, bundle, cancel=cancel, node_id=node_id, also_hide=ray_dirs())
    finally:
        done.set()


class JobMonitor:
    """Beside the driver: where each attempt started, and the job's cancellation. Async
    (one event loop), so hundreds of trials can wait on it at once."""

    def __init__(self) -> None:
        self._cancelled = asyncio.Event()
        self._starts: dict[tuple[str, int], dict[str, Any]] = {}

    async def started(self, name: str, attempt: int, node_id: str, pid: int) -> None:
        self._starts[(name, attempt)] = {"node_id": node_id, "pid": pid}

    async def start_of(self, name: str, attempt: int) -> dict[str, Any] | None:
        return self._starts.get((name, attempt))

    async def starts(self) -> dict[str, dict[str, Any]]:
        return {f"{name}#{attempt}": where for (name, attempt), where in self._starts.items()}

    async def cancel(self) -> None:
        self._cancelled.set()

    async def wait_cancelled(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._cancelled.wait(), timeout)
        except TimeoutError:
            return False
        return True
