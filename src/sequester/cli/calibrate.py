"""``sequester calibrate``: ``oracle`` and ``nop`` on tasks, ``--repeats`` times, their
verdicts kept (see :mod:`sequester.calibration`), a table of each task's state."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from sequester.cli.backend import add_backend_arguments, scheduler_for
from sequester.cli.common import err, positive
from sequester.cli.network import add_network_arguments
from sequester.cli.run import build_lines, jobs_dir, run_settings
from sequester.images.image_settings import IMAGE_SOURCES

__all__ = ["add_calibrate_command"]


def add_calibrate_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="run oracle and nop on tasks and keep their verdicts: a task whose oracle does not score full marks "
        "or whose nop scores above 0 here is not calibrated, and run ends its trials with TaskNotCalibrated",
    )
    p.add_argument("tasks", nargs="+", metavar="TASK_DIR|TASKS_DIR", help="a task folder, or a folder of them")
    p.add_argument(
        "--repeats", type=positive(int), default=1, metavar="N", help="runs of each agent per task (default: 1)"
    )
    p.add_argument(
        "-n", "--concurrency", type=positive(int), default=4, metavar="N", help="trials at a time (default: 4)"
    )
    p.add_argument(
        "-o", "--output", default="jobs", metavar="JOBS_DIR", help="where the job folders go (default: jobs)"
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="config file (the [episodes] the calibration is for); default: the embedded one",
    )
    p.add_argument(
        "--image-source",
        choices=list(IMAGE_SOURCES),
        help="what each episode runs on (as for run); default: [images] source",
    )
    add_backend_arguments(p, cluster=True)
    add_network_arguments(p)
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from sequester.jobs import default_job_name
    from sequester.jobs.job import calibrate_tasks
    from sequester.jobs.render import trial_progress

    settings = run_settings(args)
    scheduler = scheduler_for(args)
    root = jobs_dir(args.output)
    name = "calibration__" + default_job_name()
    with trial_progress(None, err, "calibrating (oracle, nop)") as advance:
        found = calibrate_tasks(
            args.tasks,
            jobs_dir=root,
            settings=settings,
            repeats=args.repeats,
            concurrency=args.concurrency,
            name=name,
            scheduler=scheduler,
            progress=advance,
            build_progress=build_lines,
        )
    table = Table(title=f"calibration ({args.repeats} run{'s' * (args.repeats != 1)} of each agent)")
    for column in ("task", "oracle", "nop", "state"):
        table.add_column(column)
    bad = 0
    for record, state in sorted(found, key=lambda f: f[0].task):
        shown = [
            ", ".join(f"{r:g}" if not isinstance(r, str) else "error" for r in record.runs.get(agent, [])) or "-"
            for agent in ("oracle", "nop")
        ]
        ok = state.state == "calibrated"
        bad += not ok
        table.add_row(
            escape(record.task),
            *shown,
            "[green]calibrated[/]" if ok else f"[red]not calibrated[/]: {escape(state.reason or '')}",
        )
    Console().print(table)
    err.print(f"job folders: {escape(str(root))}/{escape(name)}-*", highlight=False, soft_wrap=True)
    return 0 if bad == 0 else 1
