"""What makes a job folder Harbor's: the fields, names and files Harbor 0.26 reads.

Harbor's models (``TrialResult``, ``TrialConfig``, ``JobResult``, ``JobConfig``) ignore
fields they do not know (none of them forbids extras), so sequester's own fields
(``tampering``, ``notes``, ``settings``, ``hide``, ``sequester_exception_type``, ...) stay
where they were, next to Harbor's. Here: the pieces Harbor needs that sequester does not
otherwise have (exception names in Harbor's vocabulary, a task checksum, agent and task
configs in Harbor's shape, the job's ``stats``), computed from sequester's own data.
Nothing here imports Harbor: tests check these documents against Harbor's own models.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sequester import __version__
from sequester.tasks.checksum import task_checksum

if TYPE_CHECKING:
    from sequester.jobs.results import TrialResult

__all__ = [
    "ENVIRONMENT_IMPORT_PATHS",
    "harbor_exception",
    "task_checksum",
    "agent_config",
    "agent_info",
    "task_config",
    "job_stats",
    "evals_key",
]

# Harbor's TrialConfig.environment names a type (docker, modal, ...) or an import path.
# Episodes are neither a Docker container nor a Harbor environment class: the import path
# says what ran the trial without claiming a Harbor environment type.
ENVIRONMENT_IMPORT_PATHS = {
    "local": "sequester.environments.local.episode:Episode",  # (on a Ray node too)
    "docker": "sequester.environments.docker:DockerEnvironment",
}

# sequester's exception name -> Harbor's name for the same failure (its error policy then
# applies: retry, grade, reward valid). See harbor/models/trial/error_policy.py.
_HARBOR_NAMES: dict[str, str] = {
    "RewardFileMissing": "RewardFileNotFoundError",
    "RewardInvalid": "VerifierOutputParseError",
    "VerifierTimeout": "VerifierTimeoutError",
    # the harness could not stage or start the tests (not the agent's doing): Harbor's
    # name for "the tests could not be put in place" (retry, no grade, no valid reward)
    "VerifierCouldNotRun": "AddTestsDirError",
    "BootstrapFailed": "AddTestsDirError",
    "VerifierError": "AddTestsDirError",
    "TrialCancelled": "CancelledError",
    # the episode's sandbox could not be made, staged, frozen or torn down
    "SandboxError": "SandboxBuildFailedError",
    "SandboxUnavailableError": "SandboxBuildFailedError",
    "StaleView": "SandboxBuildFailedError",  # a view template outdated twice in one start
    "TemplateUnavailable": "SandboxBuildFailedError",  # (caught at launch: a bwrap per kernel)
    "FreezeError": "SandboxBuildFailedError",
    # the task's image could not be had or unpacked: its environment could not be built
    "ImageError": "SandboxBuildFailedError",
    "BuildError": "SandboxBuildFailedError",
    "BuildTimeout": "SandboxBuildFailedError",
    "VerifierWheelsError": "SandboxBuildFailedError",
    # the docker backend's engine refused or failed a request
    "EngineError": "SandboxBuildFailedError",
}

# sequester's errors that Harbor has no name for: the name stays, with the policy Harbor
# should apply spelled out (Harbor's ExceptionInfo.policy_override), so none falls into
# Harbor's "unknown" policy (retry, grade, reward valid).
_NO_RETRY = {"should_retry": False, "should_grade": False, "has_valid_reward": False}
_OVERRIDES: dict[str, dict[str, bool]] = {
    "TaskError": _NO_RETRY,  # a malformed task: running it again gives the same error
    "PolicyError": _NO_RETRY,  # a bad setting
    "EpisodeError": _NO_RETRY,  # the agent used its episode out of order (e.g. ran the verifier)
    # a checkpoint refused (its bounds, a layer it cannot measure): the same again if retried
    "CheckpointError": _NO_RETRY,
    # the backend (or the cluster) lacks what the trial asks for: the operator's set-up
    "UnsupportedByBackend": _NO_RETRY,
    "TaskNotCalibrated": _NO_RETRY,  # the task scores wrongly here: running it again changes nothing
    # what this host lacks for a task (its GPUs, a project quota): the first is turned into
    # UnsupportedByBackend, the second into a note, before a trial sees either
    "GpuUnavailable": _NO_RETRY,
    "QuotaUnavailable": _NO_RETRY,
    # a file call of the agent's on its container (a missing path, one too large): its own doing
    "ContainerFileError": _NO_RETRY,
    "TooLarge": _NO_RETRY,
    # the Ray cluster lost the trial with its worker or node (after its retry), or could
    # not be joined: another run may not meet it again
    "ClusterError": {"should_retry": True, "should_grade": False, "has_valid_reward": False},
    # an episode pool at capacity past its wait: a later try may find a slot
    "PoolFull": {"should_retry": True, "should_grade": False, "has_valid_reward": False},
    "RayPoolFull": {"should_retry": True, "should_grade": False, "has_valid_reward": False},
    "SequesterError": _NO_RETRY,  # e.g. the oracle on a task without solution/solve.sh
    "KernelError": {"should_retry": True, "should_grade": False, "has_valid_reward": False},
    "KernelClosedError": {"should_retry": True, "should_grade": False, "has_valid_reward": False},
    # a warm kernel's fork channel out of step: the warm kernel is closed, a new one forks again
    "ForkChannelBroken": {"should_retry": True, "should_grade": False, "has_valid_reward": False},
    # sequester serve's client, in an agent driving a remote environment: the connection
    # or the server's session failed, which a new trial may not meet again
    "ClientError": {"should_retry": True, "should_grade": False, "has_valid_reward": False},
    "ServerError": {"should_retry": True, "should_grade": False, "has_valid_reward": False},
}


def harbor_exception(exception_type: str, message: str) -> tuple[str, dict[str, bool] | None]:
    """Harbor's name for sequester's ``exception_type`` and, where Harbor has none, the
    ``policy_override`` to write with sequester's own name. Any other name (what an agent
    raised: ``RuntimeError``, an API client's ``RateLimitError``) is kept as it is, as
    Harbor keeps its agents' exception names."""
    if exception_type == "RewardInvalid" and message.startswith("reward.txt: '' "):
        return "RewardFileEmptyError", None
    if exception_type in _HARBOR_NAMES:
        return _HARBOR_NAMES[exception_type], None
    return exception_type, _OVERRIDES.get(exception_type)


def _model_info(model_name: object) -> dict[str, str | None] | None:
    if not isinstance(model_name, str) or not model_name:
        return None
    provider, sep, name = model_name.partition("/")
    return {"name": name, "provider": provider} if sep else {"name": model_name, "provider": None}


def agent_config(spec: str, agent: object | None = None, kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Harbor's ``AgentConfig`` for ``spec``: a built-in by ``name``, a ``module:Class``
    by ``import_path`` (Harbor's own form), with the agent's ``model_name`` if it has one
    and the ``kwargs`` it was constructed with."""
    builtin = spec in ("oracle", "nop") or spec.startswith("script:")
    config: dict[str, Any] = (
        {"name": spec} if builtin else {"name": str(getattr(agent, "name", "") or spec), "import_path": spec}
    )
    model = getattr(agent, "model_name", None)
    if isinstance(model, str) and model:
        config["model_name"] = model
    if kwargs:
        config["kwargs"] = dict(kwargs)
    return config


def agent_info(spec: str, agent: object | None) -> dict[str, Any]:
    """Harbor's ``AgentInfo``: the agent's name, its ``version`` (sequester's for the
    built-ins, the agent's own attribute, else ``"unknown"``) and ``model_info``."""
    if agent is None:
        return {"name": spec, "version": "unknown", "model_info": None}
    builtin = spec in ("oracle", "nop") or spec.startswith("script:")
    version = __version__ if builtin else getattr(agent, "version", None)
    return {
        "name": str(agent.name) if getattr(agent, "name", None) else spec,  # type: ignore[attr-defined]
        "version": str(version) if version else "unknown",
        "model_info": _model_info(getattr(agent, "model_name", None)),
    }


def task_config(task_path: Path, source: str | None) -> dict[str, Any]:
    """Harbor's ``TaskConfig`` for a local task: its ``path`` (never also a ``name``: a
    ``name`` is Harbor's registry package) and the ``source`` (dataset) it came from."""
    return {"path": str(task_path), "source": source}


def evals_key(trial: TrialResult) -> str:
    """Harbor's key of a trial's group in ``stats.evals``: agent, model, dataset."""
    model = (trial.agent_info.get("model_info") or {}).get("name")
    dataset = trial.source or "adhoc"
    return f"{trial.agent_info['name']}__{model}__{dataset}" if model else f"{trial.agent_info['name']}__{dataset}"


def _mean_metric(verdicts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Harbor's default metric over the verdicts: ``{"mean": ...}`` of the one reward,
    or the mean of each key (a missing key counting 0) when there are several."""
    keys = sorted({key for rewards in verdicts for key in rewards})
    if len(keys) <= 1:
        values = [next(iter(rewards.values()), 0.0) for rewards in verdicts]
        return {"mean": sum(values) / len(values)}
    return {key: sum(rewards.get(key, 0.0) for rewards in verdicts) / len(verdicts) for key in keys}


def job_stats(trials: Sequence[TrialResult], n_total: int, n_running: int) -> dict[str, Any]:
    """Harbor's ``JobStats`` of the finished ``trials``: progress counts, and per agent
    and dataset the verdicts, the reward values (with the trials that got each), the
    exception types (Harbor's names) and the mean."""
    evals: dict[str, dict[str, Any]] = {}
    verdicts: dict[str, list[dict[str, float]]] = {}
    n_errors = n_cancelled = 0
    for trial in trials:
        group = evals.setdefault(
            evals_key(trial),
            {"n_trials": 0, "n_errors": 0, "metrics": [], "pass_at_k": {}, "reward_stats": {}, "exception_stats": {}},
        )
        if trial.verifier_result is not None and trial.exception_info is None:
            group["n_trials"] += 1
            verdicts.setdefault(evals_key(trial), []).append(dict(trial.verifier_result.rewards))
            for key, value in trial.verifier_result.rewards.items():
                group["reward_stats"].setdefault(key, {}).setdefault(str(value), []).append(trial.trial_name)
        if trial.exception_info is not None:
            name = trial.exception_info.harbor_type
            group["exception_stats"].setdefault(name, []).append(trial.trial_name)
            group["n_errors"] += 1
            n_errors += 1
            n_cancelled += name == "CancelledError"
    for key, rewards in verdicts.items():
        evals[key]["metrics"] = [_mean_metric(rewards)]
    return {
        "n_completed_trials": len(trials),
        "n_errored_trials": n_errors,
        "n_running_trials": n_running,
        "n_pending_trials": max(n_total - len(trials) - n_running, 0),
        "n_cancelled_trials": n_cancelled,
        "n_retries": 0,
        "evals": evals,
    }
