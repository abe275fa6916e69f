"""A trial that ran on a node, written into the driver's job folder.

The node ran the trial in a staging folder of its own and sent the folder back
(:class:`~.node.TrialReturn`). Here it is unpacked into the job folder and its
``result.json`` and ``config.json`` are rewritten with the driver's paths (the trial's
folder, the task's folder), where it ran, and the attempts lost before it. A trial the
cluster could not run at all (lost more often than it may be retried, infeasible, a node
without sequester) gets a result written here, as an error with its reason: never a 0.
"""

from __future__ import annotations

import dataclasses
import traceback
from typing import Any

from sequester.cluster.bundles import unpack_folder
from sequester.cluster.node import TrialReturn
from sequester.jobs.harbor import agent_info, task_checksum, task_config
from sequester.jobs.paths import TrialPaths
from sequester.jobs.results import ExceptionInfo, TrialResult, utc_now
from sequester.jobs.schedule import JobRun, PlannedTrial
from sequester.jobs.trial import trial_config, write_json

__all__ = ["land_trial", "land_error", "relocated_config"]


def relocated_config(config: dict[str, Any], trial: PlannedTrial) -> dict[str, Any]:
    """The node's ``config.json`` with the driver's folders (the node's own are gone)."""
    out = dict(config)
    out["task"] = task_config(trial.task.path, trial.source)
    out["trials_dir"] = str(trial.trial_dir.parent)
    out["trial_name"] = trial.trial_dir.name
    return out


def land_trial(returned: TrialReturn, trial: PlannedTrial, retries: list[dict[str, Any]]) -> TrialResult:
    """Unpack ``returned`` into ``trial.trial_dir`` and rewrite its result with the driver's paths."""
    unpack_folder(returned.folder, trial.trial_dir)
    config = relocated_config(returned.result.config, trial)
    notes = list(returned.result.notes)
    if returned.left_out:
        shown = ", ".join(returned.left_out[:10]) + (" ..." if len(returned.left_out) > 10 else "")
        notes.append(
            f"{len(returned.left_out)} file(s) of the trial's folder were not shipped back from its node "
            f"(more than the limit): {shown}"
        )
    result = dataclasses.replace(
        returned.result,
        trial_uri=trial.trial_dir.resolve().as_uri(),
        task_path=str(trial.task.path),
        config=config,
        node=dict(returned.node),
        retries=list(retries),
        notes=notes,
    )
    paths = TrialPaths(trial.trial_dir)
    write_json(paths.config_path, config)
    write_json(paths.result_path, result.to_dict())
    return result


def land_error(
    trial: PlannedTrial,
    job: JobRun,
    exc: BaseException,
    retries: list[dict[str, Any]],
    node: dict[str, Any] | None = None,
    started_at: str | None = None,
) -> TrialResult:
    """A trial the cluster could not run: a folder with its config and an error result."""
    paths = TrialPaths(trial.trial_dir)
    if not trial.trial_dir.exists():
        paths.mkdir()
    config = trial_config(
        trial.task,
        job.agent_spec,
        trial.trial_dir,
        settings=job.settings,
        hide=list(job.hide),
        source=trial.source,
        job_id=job.job_id,
        agent_kwargs=job.agent_kwargs,
    )
    write_json(paths.config_path, config)
    error = ExceptionInfo(type(exc).__name__, str(exc), "".join(traceback.format_exception(exc)), utc_now())
    result = TrialResult(
        task_name=trial.task.name,
        trial_name=trial.name,
        trial_uri=trial.trial_dir.resolve().as_uri(),
        agent_info=agent_info(job.agent_spec, None),
        verifier_result=None,
        exception_info=error,
        started_at=started_at or utc_now(),
        finished_at=utc_now(),
        source=trial.source,
        task_path=str(trial.task.path),
        task_checksum=task_checksum(trial.task.path),
        config=config,
        node=node,
        retries=list(retries),
    )
    write_json(paths.result_path, result.to_dict())
    return result
