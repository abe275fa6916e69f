"""How ``sequester run`` shows a job: a progress bar while trials run, a table at the end."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from .results import JobResult, TrialResult

__all__ = ["trial_progress", "print_summary"]


@contextlib.contextmanager
def trial_progress(total: int, console: Console, label: str) -> Iterator[Callable[[TrialResult], None]]:
    """A progress bar over ``total`` trials; yields the callback that advances it."""
    errors = 0
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[errors]}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        job = bar.add_task(escape(label), total=total, errors="")

        def advance(result: TrialResult) -> None:
            nonlocal errors
            errors += result.exception_info is not None
            bar.update(job, advance=1, errors=f"[red]{errors} error{'s' * (errors != 1)}[/]" if errors else "")

        yield advance


def _reward(trial: TrialResult) -> str:
    if trial.reward is None:
        return "[red]-[/]"
    return f"[green]{trial.reward}[/]" if trial.reward >= 1 else str(trial.reward)


def print_summary(console: Console, job: JobResult, trials: list[TrialResult], job_dir: Path) -> None:
    """One row per trial (in the job's order), each error's message, then the job folder,
    the mean reward and the counts."""
    order = {name: i for i, name in enumerate(job.trials)}
    trials = sorted(trials, key=lambda t: order.get(t.trial_name, len(order)))
    table = Table(title=f"job {escape(job.job_name)}")
    table.add_column("task", overflow="fold", min_width=12)
    table.add_column("trial", no_wrap=True)  # the folder is task__trial
    table.add_column("reward", justify="right", no_wrap=True)
    table.add_column("time", justify="right", no_wrap=True)
    table.add_column("error", overflow="fold")
    table.add_column("tampering", no_wrap=True)
    for t in trials:
        seconds = t.duration_sec
        table.add_row(
            escape(t.task_name), escape(t.trial_name.rpartition("__")[2]), _reward(t),
            "" if seconds is None else f"{seconds:.1f} s",
            f"[red]{escape(t.exception_info.exception_type)}[/]" if t.exception_info else "",
            f"[yellow]! {len(t.tampering)}[/]" if t.tampering else "",
        )
    console.print(table)
    for t in trials:
        if t.exception_info is not None:
            console.print(f"[red]{escape(t.trial_name)}[/]: {escape(t.exception_info.exception_type)}: "
                          f"{escape(t.exception_info.exception_message)}", highlight=False, soft_wrap=True)
    mean = "-" if job.mean_reward is None else f"{job.mean_reward:.3f}"
    counts = ", ".join(f"{n} × {reward}" for reward, n in job.reward_counts.items()) or "no verdicts"
    console.print(f"{escape(str(job_dir))}: mean reward {mean} over {job.n_trials - job.n_errors} verdict(s) "
                  f"({counts}); {job.n_errors} error(s); {job.n_trials}/{job.n_total_trials} trials finished",
                  highlight=False, soft_wrap=True)
