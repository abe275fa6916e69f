"""``sequester build``: build tasks' Dockerfiles into the image store, without a daemon.

Each step is shown as ``docker build`` shows it (``#3 [stage-0 2/5] RUN ...``, then
``CACHED`` or ``DONE 1.2s``) on standard error, prefixed by the task when several build
at once; each task's full log (the steps' output included) goes to ``--logs``; a table
sums up. Exit status 0 when every task built, 1 when one failed (the table and its log
say why), 2 for bad input (no such task, a malformed task.toml, a bad option).
"""

from __future__ import annotations

import argparse
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from sequester.cli.common import positive
from sequester.config import load_config
from sequester.environments.settings import episode_id_map, episode_image_store
from sequester.errors import ImageError, PolicyError
from sequester.imagebuild import BuildResult, StepReport, build_task
from sequester.images.image_settings import BUILD_NETWORKS

__all__ = ["add_build_command", "positive"]

_err = Console(stderr=True)


def cmd_build(args: argparse.Namespace) -> int:
    from sequester.net.build.network import parse_build_network
    from sequester.tasks import find_tasks
    from sequester.verifier.tree import runner_tree

    settings = load_config(args.config).episodes
    images = settings.images
    network = args.build_network or images.build_network
    hosts = tuple(args.allowed_host) or images.build_allowed_hosts
    parse_build_network(network, hosts)  # a bad value is exit 2 before anything runs
    tasks = find_tasks(args.tasks)
    if not tasks:
        raise PolicyError("no tasks given")
    missing = [t.name for t in tasks if not (t.environment_dir / "Dockerfile").is_file()]
    if missing:
        raise PolicyError(f"task {missing[0]} has no environment/Dockerfile to build")
    logs = Path(args.logs or f"build-logs/{time.strftime('%Y-%m-%d__%H-%M-%S')}").absolute()
    store = episode_image_store(settings)
    runner = runner_tree(settings.toolchain_dir)
    several = len(tasks) > 1
    lock = threading.Lock()

    def show(task: str, report: StepReport, done: bool) -> None:
        prefix = f"[bold]{escape(task)}[/] " if several else ""
        title = escape(report.title())
        with lock:
            if not done:
                _err.print(f"{prefix}#{report.number} {title}", highlight=False, soft_wrap=True)
            elif report.cached:
                _err.print(f"{prefix}#{report.number} {title} [dim]CACHED[/]", highlight=False, soft_wrap=True)
            else:
                _err.print(f"{prefix}#{report.number} [green]DONE[/] {report.seconds:.1f}s", highlight=False)

    ids = episode_id_map(settings)[0]  # the ids its RUN steps map: as the episodes'

    def one(task) -> tuple[BuildResult | None, str | None]:
        try:
            result = build_task(
                task,
                store,
                runner=runner,
                network=network,
                allowed_hosts=hosts,
                no_cache=args.no_cache,
                log_path=logs / f"{task.name}.log",
                on_step=lambda report, done: show(task.name, report, done),
                ids=ids,
            )
            return result, None
        except ImageError as exc:  # BuildError, or a base image that cannot be had
            return None, str(exc)

    with ThreadPoolExecutor(max_workers=args.concurrency, thread_name_prefix="build") as pool:
        outcomes = list(pool.map(one, tasks))
    table = Table(title=f"sequester build ({len(tasks)} task{'s' * several}; logs in {escape(str(logs))})")
    for column in ("task", "result", "steps run", "seconds", "image"):
        table.add_column(column)
    failed = 0
    for task, (result, error) in zip(tasks, outcomes, strict=True):
        if result is None:
            failed += 1
            table.add_row(escape(task.name), "[red]failed[/]", "", "", escape(_first_line(error or "")))
            _err.print(f"[red]error:[/] {escape(task.name)}: {escape(error or '')}", highlight=False, soft_wrap=True)
            continue
        ran = sum(not s.cached for s in result.steps)
        table.add_row(
            escape(task.name),
            "cached" if result.cached else "[green]built[/]",
            f"{ran}/{len(result.steps)}",
            f"{result.seconds:.2f}",
            f"{escape(result.record.names[0] if result.record.names else '')} {result.record.short_id}",
        )
    Console().print(table)
    return 1 if failed else 0


def _first_line(text: str) -> str:
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= 120 else line[:117] + "..."


def add_build_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build", help="build tasks' Dockerfiles into the image store (no daemon)")
    p.add_argument("tasks", nargs="+", metavar="TASK_DIR|TASKS_DIR", help="a task folder, or a folder of them")
    p.add_argument(
        "-n", "--concurrency", type=positive(int), default=2, metavar="N", help="tasks built at a time (default: 2)"
    )
    p.add_argument("--no-cache", action="store_true", help="run every step again (the new layers become the cache)")
    p.add_argument(
        "--build-network",
        choices=list(BUILD_NETWORKS),
        help="what RUN and ADD may reach: public hosts (default: [images] build_network, public), "
        "none, or the allowlist; never the host's loopback or private addresses",
    )
    p.add_argument(
        "--allow-host",
        "--allowed-host",
        dest="allowed_host",
        action="append",
        default=[],
        metavar="HOST[:PORT]",
        help="a host the allowlist allows (repeatable; the spelling of run's and serve's --allow-host; "
        "default: [images] build_allowed_hosts)",
    )
    p.add_argument(
        "--logs", metavar="DIR", help="where each task's build log goes (default: build-logs/YYYY-MM-DD__HH-MM-SS)"
    )
    p.add_argument("--config", metavar="FILE", help="config file ([images] and [episodes] are used)")
    p.set_defaults(func=cmd_build)
