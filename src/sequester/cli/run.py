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
    p.add_argument("tasks", nargs="*", metavar="TASK_DIR|TASKS_DIR", help="a task folder, or a folder of them")
    p.add_argument(
        "--agent", metavar="AGENT", help="oracle, nop, script:PATH or module:Class (required but with --resume)"
    )
    p.add_argument(
        "--resume",
        metavar="JOB_DIR",
        help="finish an interrupted job from its stored configuration (its finished trials kept)",
    )
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
        "--verifier-mode",
        choices=["shared", "separate"],
        help="run the tests in the agent's environment (shared) or in a fresh one holding only the task's artifacts",
    )
    # (the old spelling: Harbor's --verifier-env sets the verifier's variables, another thing)
    p.add_argument("--verifier-env", choices=["shared", "separate"], dest="verifier_env_old", help=argparse.SUPPRESS)
    # What `harbor run` users reach for, spelled as Harbor 0.26 spells it.
    p.add_argument(
        "-k", "--n-attempts", type=positive(int), default=1, metavar="K", help="trials per task (pass@k; default: 1)"
    )
    p.add_argument(
        "-i",
        "--include-task-name",
        action="append",
        default=[],
        metavar="PATTERN",
        help="only tasks whose name matches this shell pattern (repeatable)",
    )
    p.add_argument(
        "-x",
        "--exclude-task-name",
        action="append",
        default=[],
        metavar="PATTERN",
        help="leave out tasks whose name matches this shell pattern (repeatable)",
    )
    p.add_argument(
        "-r",
        "--max-retries",
        type=whole,
        default=0,
        metavar="N",
        help="run a trial that ended with a retryable error again, up to N times (default: 0)",
    )
    p.add_argument(
        "--retry-include",
        action="append",
        default=[],
        metavar="TYPE",
        help="retry only these exception types (repeatable)",
    )
    p.add_argument(
        "--retry-exclude",
        action="append",
        default=None,
        metavar="TYPE",
        help="never retry these exception types (repeatable; default: Harbor's list)",
    )
    p.add_argument(
        "--timeout-multiplier",
        type=positive(float),
        metavar="F",
        help="multiply the tasks' agent and verifier timeouts",
    )
    p.add_argument(
        "--agent-timeout-multiplier",
        type=positive(float),
        metavar="F",
        help="multiply the tasks' [agent] timeout_sec (overrides --timeout-multiplier)",
    )
    p.add_argument(
        "--verifier-timeout-multiplier",
        type=positive(float),
        metavar="F",
        help="multiply the tasks' [verifier] timeout_sec (overrides --timeout-multiplier)",
    )
    p.add_argument(
        "--ak",
        "--agent-kwarg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        dest="agent_kwarg",
        help="an argument of the agent's constructor (VALUE read as JSON or a Python literal, else text; repeatable)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan (tasks, how each system is had, backend, calibration) and run nothing",
    )
    p.add_argument("--env-file", metavar="FILE", help="a .env file whose variables the agents get (KEY=VALUE lines)")
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
    old = getattr(args, "verifier_env_old", None)
    if old is not None:
        err.print(
            "--verifier-env is deprecated: it is --verifier-mode (Harbor's --verifier-env sets variables)",
            highlight=False,
        )
    multiplier = getattr(args, "timeout_multiplier", None)
    overrides: dict[str, Any] = {
        "exec_timeout": getattr(args, "exec_timeout", None),
        "freeze_agent": getattr(args, "freeze_agent", False) or None,
        "verifier_env": getattr(args, "verifier_mode", None) or old,
        "agent_timeout_multiplier": getattr(args, "agent_timeout_multiplier", None) or multiplier,
        "verifier_timeout_multiplier": getattr(args, "verifier_timeout_multiplier", None) or multiplier,
    }
    settings = replace(settings, **{k: v for k, v in overrides.items() if v is not None})
    if args.image_source:
        settings = replace(settings, images=replace(settings.images, source=args.image_source))
    settings = apply_backend_arguments(args, settings)
    return apply_network_arguments(args, settings)


def cmd_run(args: argparse.Namespace) -> int:
    from sequester.cli.image import image_bars
    from sequester.jobs import default_job_name
    from sequester.jobs.job import prepare_job
    from sequester.jobs.retry import RetryPolicy

    if args.resume:
        return resume(args)
    if not args.tasks or not args.agent:
        missing = [w for w, given in (("TASK_DIR|TASKS_DIR", args.tasks), ("--agent", args.agent)) if not given]
        raise PolicyError(f"sequester run needs {' and '.join(missing)} (or --resume JOB_DIR)")
    settings = run_settings(args)
    retry = RetryPolicy.of(args.max_retries, args.retry_include, args.retry_exclude)
    if args.env_file:
        load_env_file(args.env_file)
    if args.dry_run:  # (before a cluster is joined: nothing is started)
        return dry_run(args, settings, runs_here=args.backend != "ray")
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
            n_attempts=args.n_attempts,
            include_tasks=args.include_task_name,
            exclude_tasks=args.exclude_task_name,
            retry=retry,
            agent_kwargs=parse_kwargs(args.agent_kwarg, "--agent-kwarg"),
        )
    return run_prepared(prepared, args.agent, job_dir)


def run_prepared(prepared, agent: str, job_dir: Path) -> int:
    """The trials of a prepared job, with the progress bar and the summary table."""
    from sequester.jobs import TrialResult
    from sequester.jobs.render import print_summary, trial_progress

    total = len(prepared.trials)
    finished: list[TrialResult] = []
    try:
        with trial_progress(total, err, f"{agent} on {total} task{'s' * (total != 1)}") as advance:

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


def resume(args: argparse.Namespace) -> int:
    """``--resume JOB_DIR``: the job's stored configuration, its finished trials kept, the
    rest run (see :mod:`sequester.jobs.resume`); a flag that contradicts what it stored is exit 2."""
    from sequester.cli.image import image_bars
    from sequester.jobs.job import prepare_resume
    from sequester.jobs.resume import contradictions, read_job

    job = read_job(args.resume)
    if args.tasks:
        raise PolicyError("--resume takes no TASK_DIR: the job's own tasks are used")
    if args.config or args.job_name or args.dry_run:
        raise PolicyError(
            "--resume uses the job's stored settings, name and plan: no --config, --job-name or --dry-run"
        )
    given: dict[str, Any] = {}
    for flag, value, default in (
        ("--agent", args.agent, None),
        ("--agent-kwarg", parse_kwargs(args.agent_kwarg, "--agent-kwarg"), {}),
        ("--n-attempts", args.n_attempts, 1),
        ("--include-task-name", args.include_task_name, []),
        ("--exclude-task-name", args.exclude_task_name, []),
        ("--max-retries", args.max_retries, 0),
    ):
        if value != default:
            given[flag] = value
    if args.calibration != "auto":
        given["--calibration"] = args.calibration
    s = job.settings
    mult = args.timeout_multiplier
    flags = {
        "--exec-timeout": (args.exec_timeout, s.exec_timeout),
        "--freeze-agent": (args.freeze_agent or None, s.freeze_agent),
        "--verifier-mode": (args.verifier_mode or args.verifier_env_old, s.verifier_env),
        "--image-source": (args.image_source, s.images.source),
        "--agent-timeout-multiplier": (args.agent_timeout_multiplier or mult, s.agent_timeout_multiplier),
        "--verifier-timeout-multiplier": (args.verifier_timeout_multiplier or mult, s.verifier_timeout_multiplier),
        "--network": (args.network, s.network),
        "--allow-host": (tuple(args.allow_host) if args.allow_host is not None else None, s.allowed_hosts),
    }
    given["--settings"] = {k: v for k, v in flags.items() if v[0] is not None}
    wrong = contradictions(job, given)
    if wrong:
        raise PolicyError(
            f"--resume {args.resume!r}: these flags contradict the job's stored configuration: " + "; ".join(wrong)
        )
    if args.env_file:
        load_env_file(args.env_file)
    scheduler = scheduler_for(args)
    with image_bars() as bars:
        prepared = prepare_resume(job, scheduler=scheduler, image_progress=bars, build_progress=build_lines)
    if job.kept or job.removed:
        err.print(
            f"resuming {escape(str(job.root))}: {len(job.kept)} finished trial(s) kept, "
            f"{len(job.removed)} cut off and run again, {len(prepared.trials)} to run",
            highlight=False,
        )
    return run_prepared(prepared, job.agent_spec, job.root)


def dry_run(args: argparse.Namespace, settings, *, runs_here: bool) -> int:
    """``--dry-run``: the plan, and nothing made (see :mod:`sequester.jobs.dry_run`)."""
    from rich.table import Table

    from sequester.agents import load_agent
    from sequester.jobs.dry_run import plan_job
    from sequester.jobs.job import filter_tasks
    from sequester.tasks import find_tasks

    tasks = find_tasks(args.tasks)
    if not tasks:
        raise PolicyError("no tasks given")
    tasks = filter_tasks(tasks, args.include_task_name, args.exclude_task_name)
    load_agent(args.agent, parse_kwargs(args.agent_kwarg, "--agent-kwarg"))  # (bad input is exit 2 here too)
    rows = plan_job(tasks, settings, n_attempts=args.n_attempts, calibration=args.calibration, runs_here=runs_here)
    where = "a Ray cluster" if not runs_here else f"{settings.backend} episodes on this machine"
    table = Table(title=f"{args.agent} on {len(rows)} task(s), {sum(r.trials for r in rows)} trial(s): {where}")
    for column in ("task", "trials", "system", "calibration"):
        table.add_column(column)
    for row in rows:
        table.add_row(escape(row.task), str(row.trials), escape(row.system), escape(row.calibration))
    Console().print(table)
    print(
        f"(dry run: nothing fetched, built, run or written; retries {args.max_retries}, concurrency {args.concurrency})"
    )
    return 0


def parse_kwargs(items: list[str], flag: str) -> dict[str, Any]:
    """``KEY=VALUE`` items as Harbor's CLI reads them: VALUE as JSON, else a Python literal
    (``True``, ``None``), else the text; a KEY that is not a name is exit 2. Pure."""
    import ast
    import json

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key.isidentifier():
            raise PolicyError(f"{flag} {item!r}: expected KEY=VALUE with KEY a Python name")
        try:
            out[key] = json.loads(value)
        except ValueError:
            try:
                out[key] = ast.literal_eval(value)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                out[key] = value
    return out


def whole(text: str) -> int:
    """An argparse type: a whole number >= 0; the error names the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 0")
    return value


def load_env_file(path: str) -> None:
    """``--env-file``: its variables into this process's environment (agents read their
    keys there), as Harbor's does, with python-dotenv; a file that cannot be read is exit 2."""
    from dotenv import dotenv_values

    if not os.path.isfile(path):
        raise PolicyError(f"--env-file {path!r} is not a file")
    try:
        values = dotenv_values(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError(f"--env-file {path!r} cannot be read: {exc}") from None
    os.environ.update({k: v for k, v in values.items() if v is not None})


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
