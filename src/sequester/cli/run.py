"""``sequester run``: an agent on tasks, one trial (episode) each, scored; Harbor's job layout."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from sequester.cli.backend import add_backend_arguments, apply_backend_arguments, scheduler_for
from sequester.cli.common import config_of, err, positive
from sequester.cli.network import add_network_arguments, apply_network_arguments
from sequester.errors import PolicyError
from sequester.images.image_settings import IMAGE_SOURCES

__all__ = ["add_run_command", "run_settings", "build_lines", "jobs_dir"]


def add_run_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run an agent on tasks, one episode each, and score them")
    p.add_argument("tasks", nargs="+", metavar="TASK_DIR|TASKS_DIR", help="a task folder, or a folder of them")
    p.add_argument("--agent", required=True, metavar="AGENT", help="oracle, nop, script:PATH or module:Class")
    p.add_argument(
        "-n", "--concurrency", type=positive(int), default=4, metavar="N", help="trials at a time (default: 4)"
    )
    p.add_argument("-o", "--output", default="jobs", metavar="JOBS_DIR", help="where job folders go (default: jobs)")
    p.add_argument("--job-name", metavar="NAME", help="the job's folder name (default: the time, YYYY-MM-DD__HH-MM-SS)")
    p.add_argument(
        "--config",
        metavar="FILE",
        help="config file ([episodes] is used; every table is checked); default: the embedded one",
    )
    p.add_argument("--exec-timeout", type=positive(float), metavar="S", help="default seconds per agent command")
    p.add_argument("--freeze-agent", action="store_true", help="freeze the agent's processes while the verifier runs")
    p.add_argument(
        "--verifier-env",
        choices=["shared", "separate"],
        help="run the tests in the agent's environment (shared) or in a fresh one holding only the task's artifacts",
    )
    p.add_argument(
        "--image-source",
        choices=list(IMAGE_SOURCES),
        help="what each episode runs on: the task's prebuilt docker_image, its Dockerfile, the host's "
        "system, or auto (the image when it can be had, else host mode); default: [images] source",
    )
    p.add_argument(
        "--calibration",
        choices=["auto", "required", "off"],
        default="auto",
        help="auto: a task whose calibration (sequester calibrate) fails ends its trials with TaskNotCalibrated, "
        "one without any runs uncalibrated and says so; required: calibrate the tasks without one first; "
        "off: ask nothing (default: auto)",
    )
    add_backend_arguments(p, cluster=True)
    add_network_arguments(p)
    p.set_defaults(func=cmd_run)


def run_settings(args: argparse.Namespace):  # -> EpisodeSettings
    """The run's settings: the config file's ``[episodes]``, then the command line's."""
    from dataclasses import replace

    settings = config_of(args).episodes  # the whole file is checked, [runtime] and [limits] too
    overrides: dict[str, Any] = {
        "exec_timeout": getattr(args, "exec_timeout", None),
        "freeze_agent": getattr(args, "freeze_agent", False) or None,
        "verifier_env": getattr(args, "verifier_env", None),
    }
    settings = replace(settings, **{k: v for k, v in overrides.items() if v is not None})
    if args.image_source:
        settings = replace(settings, images=replace(settings.images, source=args.image_source))
    settings = apply_backend_arguments(args, settings)
    return apply_network_arguments(args, settings)


def cmd_run(args: argparse.Namespace) -> int:
    from sequester.cli.image import image_bars
    from sequester.jobs import TrialResult, default_job_name
    from sequester.jobs.job import prepare_job
    from sequester.jobs.render import print_summary, trial_progress

    settings = run_settings(args)
    scheduler = scheduler_for(args)  # --backend ray (its nodes fetch and build their own images)
    job_name = args.job_name or default_job_name()
    job_dir = jobs_dir(args.output) / job_name
    with image_bars() as bars:  # the images first (fetched or built once), with their own progress
        prepared = prepare_job(
            args.tasks,
            args.agent,
            jobs_dir=args.output,
            job_name=job_name,
            concurrency=args.concurrency,
            settings=settings,
            scheduler=scheduler,
            image_progress=bars,
            build_progress=build_lines,
            calibration=args.calibration,
        )
    total = len(prepared.trials)
    finished: list[TrialResult] = []
    try:
        with trial_progress(total, err, f"{args.agent} on {total} task{'s' * (total != 1)}") as advance:

            def progress(result: TrialResult) -> None:
                finished.append(result)
                advance(result)

            job = prepared.run(progress)
    except KeyboardInterrupt:
        if job_dir.is_dir():
            err.print(f"interrupted: what finished is in {escape(str(job_dir))}", highlight=False, soft_wrap=True)
        raise
    print_summary(Console(), job, finished, job_dir)
    return 0 if job.n_errors == 0 and job.n_trials == job.n_total_trials else 1


def build_lines(task: str, report, done: bool) -> None:
    """A Dockerfile build before the trials: each step as docker build shows it."""
    if not done:
        err.print(f"[bold]{escape(task)}[/] #{report.number} {escape(report.title())}", highlight=False, soft_wrap=True)
    elif not report.cached:
        err.print(f"[bold]{escape(task)}[/] #{report.number} [green]DONE[/] {report.seconds:.1f}s", highlight=False)


def jobs_dir(output: str) -> Path:
    """``-o``: a folder, or a path where one can be made; anything else is exit 2."""
    path = Path(output).absolute()
    for existing in (path, *path.parents):
        if existing.exists():
            break
    if not existing.is_dir():
        what = "is not a folder" if existing == path else f"cannot be made: {str(existing)!r} is not a folder"
        raise PolicyError(f"-o {output!r} {what}")
    if not os.access(existing, os.W_OK | os.X_OK):  # the job's folder (or -o itself) is made in it
        raise PolicyError(f"-o {output!r}: {str(existing)!r} is not writable")
    return path.resolve()
