"""What a cluster node does with a trial the driver sent: plain Python, no Ray in it.

A node unpacks the task into its own cache (:func:`~.bundles.unpack_task`), runs the
trial with :func:`~sequester.jobs.trial.run_trial` exactly as the local runner does, in a
staging folder of its own, packs the trial's folder for the driver and removes it.

Paths that name this machine (the episodes' state folder, the verifier's toolchain, the
image store) follow the node, not the driver: one the driver left at its default is the
node's own default (:func:`settings_for_node`), so every node pulls or builds images into
its own store, cached there, and builds its own toolchain once. One the operator set
explicitly is kept (a cluster with the same layout everywhere).

Hidden from every agent on the node, besides what the driver hides (the tasks' folders
and the jobs folder, which a shared filesystem would show): the node's task cache and
trial staging (other trials' tests, solutions and verdicts) and Ray's session folder
(objects spilled from the object store, task archives among them).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import shutil
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from sequester.cluster.bundles import TaskBundle, evict_unused, pack_folder, task_on_node
from sequester.environments.settings import EpisodeSettings, cluster_cache_dir, default_state_dir, default_toolchain_dir
from sequester.images.image_settings import ImageSettings, default_store_dir
from sequester.jobs.cancel import Cancellation
from sequester.jobs.results import TrialResult
from sequester.jobs.trial import run_trial
from sequester.tasks import load_task

__all__ = [
    "TrialOrder",
    "TrialReturn",
    "machine_defaults",
    "settings_for_node",
    "cluster_cache",
    "run_order",
    "node_info",
    "sweep_staging",
]

MACHINE_PATHS = ("state_dir", "toolchain_dir", "images.store_dir")


def machine_defaults(settings: EpisodeSettings) -> frozenset[str]:
    """Which of ``MACHINE_PATHS`` ``settings`` leaves at this machine's default."""
    defaults = {
        "state_dir": default_state_dir(),
        "toolchain_dir": default_toolchain_dir(),
        "images.store_dir": default_store_dir(),
    }
    current = {
        "state_dir": settings.state_dir,
        "toolchain_dir": settings.toolchain_dir,
        "images.store_dir": settings.images.store_dir,
    }
    return frozenset(name for name in MACHINE_PATHS if current[name] == defaults[name])


class _MachinePaths(TypedDict, total=False):
    """The fields of :class:`EpisodeSettings` that :func:`settings_for_node` may replace."""

    state_dir: Path
    toolchain_dir: Path
    images: ImageSettings


def settings_for_node(settings: EpisodeSettings, defaulted: frozenset[str]) -> EpisodeSettings:
    """``settings`` with each path in ``defaulted`` replaced by this machine's default."""
    changes: _MachinePaths = {}
    if "state_dir" in defaulted:
        changes["state_dir"] = default_state_dir()
    if "toolchain_dir" in defaulted:
        changes["toolchain_dir"] = default_toolchain_dir()
    if "images.store_dir" in defaulted:
        changes["images"] = dataclasses.replace(settings.images, store_dir=default_store_dir())
    return dataclasses.replace(settings, **changes) if changes else settings


def cluster_cache() -> Path:
    """This node's folder for shipped tasks and trial staging (0700: tests live in it)."""
    root = cluster_cache_dir()
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(root, 0o700)
    return root


@dataclass(frozen=True)
class TrialOrder:
    """One trial as the driver sends it (the task's archive travels beside it, by reference)."""

    name: str
    agent_spec: str
    settings: EpisodeSettings
    defaulted: frozenset[str]
    hide: tuple[str, ...]
    source: str | None
    job_id: str
    attempt: int = 1
    agent_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TrialReturn:
    """A finished trial: its result, its folder as an archive, what did not fit, where it ran."""

    result: TrialResult
    folder: bytes
    left_out: tuple[str, ...]
    node: dict[str, object]


def node_info(node_id: str | None = None) -> dict[str, object]:
    return {"node_id": node_id, "hostname": socket.gethostname(), "pid": os.getpid(), "machine": platform.machine()}


def run_order(
    order: TrialOrder,
    bundle: TaskBundle,
    *,
    cancel: Cancellation,
    node_id: str | None = None,
    also_hide: tuple[Path, ...] = (),
) -> TrialReturn:
    """Run ``order`` on this machine; never raises for what happens in the trial."""
    cache = cluster_cache()
    tasks_root, trials_root = cache / "tasks", cache / "trials"
    trials_root.mkdir(exist_ok=True, mode=0o700)
    sweep_staging(trials_root)
    evict_unused(tasks_root)
    # The staging folder names its worker: one a killed worker left is swept by the next trial.
    staging = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=trials_root))
    try:
        with task_on_node(bundle, tasks_root) as folder:
            task = load_task(folder)
            trial_dir = staging / order.name
            hide = [*(Path(p) for p in order.hide), tasks_root, trials_root, *also_hide]
            result = run_trial(
                task,
                order.agent_spec,
                trial_dir,
                settings=settings_for_node(order.settings, order.defaulted),
                hide=hide,
                cancel=cancel,
                source=order.source,
                job_id=order.job_id,
                agent_kwargs=order.agent_kwargs,
            )
        data, left_out = pack_folder(trial_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return TrialReturn(result, data, tuple(left_out), node_info(node_id))


def sweep_staging(trials_root: Path) -> list[str]:
    """Remove the staging folders of workers that are gone (killed mid-trial: their
    ``finally`` never ran, and a trial folder holds the verifier's output)."""
    removed = []
    for name in os.listdir(trials_root):
        pid = name.split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # its worker lives: a trial of its own runs there
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(trials_root / name, ignore_errors=True)
        removed.append(name)
    return removed
