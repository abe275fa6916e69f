"""``sequester run --resume JOB_DIR``: an interrupted job finished from what it stored.

The job's ``config.json`` says what it was (the agent and its kwargs, the tasks and their
filters, the attempts per task, the retry policy, the settings, the calibration mode); the
trials that wrote their ``result.json`` are kept as they are, a trial folder without one
(cut off mid-run) is removed, and each task gets the trials it still lacks. A flag given
with ``--resume`` that says otherwise than the stored configuration is bad input, as is a
job folder sequester did not write or whose tasks are no longer where they were.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sequester.environments.settings import EpisodeSettings
from sequester.errors import PolicyError, SequesterError
from sequester.images.image_settings import ImageSettings
from sequester.jobs.results import TrialResult
from sequester.jobs.retry import RetryPolicy
from sequester.sandbox.remove import remove_tree

__all__ = ["StoredJob", "read_job", "contradictions"]


@dataclass(frozen=True)
class StoredJob:
    """What a job's folder says it is, and the trials it kept."""

    root: Path
    config: dict[str, Any]
    agent_spec: str
    agent_kwargs: dict[str, Any]
    task_paths: list[str]
    task_names: list[str]
    include: list[str]
    exclude: list[str]
    n_attempts: int
    concurrency: int
    calibration: str
    retry: RetryPolicy
    settings: EpisodeSettings
    kept: list[TrialResult]
    removed: list[str]  # trial folders cut off mid-run


def read_job(job_dir: str | Path) -> StoredJob:
    """Read ``job_dir`` (see the module); bad input raises :class:`PolicyError` naming it."""
    root = Path(job_dir).resolve()
    where = f"--resume {str(job_dir)!r}"
    try:
        config = json.loads((root / "config.json").read_text())
        agent_spec = str(config["agent_spec"])
        names = [str(n) for n in config["task_names"]]
        retry_raw = config.get("retry") or {}
        retry = RetryPolicy.of(
            int(retry_raw.get("max_retries", 0)),
            retry_raw.get("include_exceptions") or (),
            retry_raw.get("exclude_exceptions"),
        )
        raw = dict(config["settings"])
        images = ImageSettings(**raw.pop("images"))
        settings = EpisodeSettings(**raw, images=images)
        agents = config.get("agents") or [{}]
        task_paths = [d["path"] for d in config.get("datasets", [])] + [t["path"] for t in config.get("tasks", [])]
    except FileNotFoundError:
        raise PolicyError(f"{where}: no config.json there (not a job folder of sequester run)") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise PolicyError(
            f"{where}: its config.json is not one sequester run wrote ({type(exc).__name__}: {exc})"
        ) from None
    except SequesterError as exc:
        raise PolicyError(f"{where}: its stored settings are refused: {exc}") from None
    kept, removed = [], []
    for trial in sorted(p for p in root.iterdir() if p.is_dir() and (p / "config.json").is_file()):
        try:
            kept.append(TrialResult.from_dict(json.loads((trial / "result.json").read_text())))
        except FileNotFoundError:
            removed.append(trial.name)  # cut off mid-run: run again
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PolicyError(f"{where}: {trial.name}/result.json cannot be read ({exc})") from None
    return StoredJob(
        root,
        config,
        agent_spec,
        dict(agents[0].get("kwargs") or {}),
        task_paths,
        names,
        list(config.get("include_tasks") or []),
        list(config.get("exclude_tasks") or []),
        int(config.get("n_attempts", 1)),
        int(config.get("n_concurrent_trials", 4)),
        str(config.get("calibration", "auto")),
        retry,
        settings,
        kept,
        removed,
    )


def remove_unfinished(job: StoredJob) -> None:
    """The trial folders cut off mid-run, removed before their trials run again."""
    for name in job.removed:
        remove_tree(job.root / name)


def missing_trials(job: StoredJob) -> Counter[str]:
    """How many trials each task still lacks, by task name."""
    done = Counter(t.task_name for t in job.kept)
    return Counter({name: max(0, job.n_attempts - done[name]) for name in dict.fromkeys(job.task_names)})


def contradictions(job: StoredJob, given: dict[str, Any]) -> list[str]:
    """The flags in ``given`` (name -> value, only those the user gave) whose value differs
    from the stored configuration's. Pure."""
    stored: dict[str, Any] = {
        "--agent": job.agent_spec,
        "--agent-kwarg": job.agent_kwargs,
        "--n-attempts": job.n_attempts,
        "--include-task-name": job.include,
        "--exclude-task-name": job.exclude,
        "--calibration": job.calibration,
        "--max-retries": job.retry.max_retries,
    }
    out = []
    for flag, value in given.items():
        if flag == "--settings":
            for key, (mine, theirs) in value.items():
                if mine != theirs:
                    out.append(f"{key} {mine!r} (the job's: {theirs!r})")
        elif flag in stored and value != stored[flag]:
            out.append(f"{flag} {value!r} (the job's: {stored[flag]!r})")
    return out
