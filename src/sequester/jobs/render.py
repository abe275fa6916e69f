"""How ``sequester run`` shows a job: a progress bar while trials run, a table at the end."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from sequester.jobs.results import JobResult, TrialResult

__all__ = ["trial_progress", "print_summary", "summary_table", "summary_line"]


@contextlib.contextmanager
def trial_progress(total: int | None, console: Console, label: str) -> Iterator[Callable[[TrialResult], None]]:
    """A progress bar over ``total`` trials (None: not known ahead); yields the callback
    that advances it."""
    errors = 0
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[errors]}"),
        TimeElapsedColumn(),
    )
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


# Below this width the trial column (the folder's random suffix) is left out: every
# other column then keeps its content whole at 80 columns.
WIDE = 100


def summary_table(job: JobResult, trials: list[TrialResult], width: int) -> Table:
    """One row per trial: task, trial (at ``WIDE`` columns and more), reward, time, error,
    tampering. Nothing is cut: long task names and error names fold onto more lines."""
    table = Table(title=f"job {escape(job.job_name)}", padding=(0, 1))
    table.add_column("task", overflow="fold", ratio=3, min_width=10)
    wide = width >= WIDE
    if wide:
        table.add_column("trial", no_wrap=True)  # the folder is task__trial
    table.add_column("reward", justify="right", no_wrap=True)
    table.add_column("time", justify="right", no_wrap=True)
    table.add_column("error", overflow="fold", ratio=2, min_width=8)
    table.add_column("tamper" if not wide else "tampering", justify="right", no_wrap=True)
    calibrated = any(t.calibration and t.calibration.get("state") != "off" for t in trials)
    if calibrated:  # (sequester.calibration: "calibrated", "none" without a record, "no" failed)
        table.add_column("calib", no_wrap=True)
    for t in trials:
        seconds = t.duration_sec
        cells = [escape(t.task_name), escape(t.trial_name.rpartition("__")[2])] if wide else [escape(t.task_name)]
        table.add_row(
            *cells,
            _reward(t),
            "" if seconds is None else f"{seconds:.1f} s",
            f"[red]{escape(t.exception_info.exception_type)}[/]" if t.exception_info else "",
            f"[yellow]! {len(t.tampering)}[/]" if t.tampering else "",
            *([_CALIBRATION.get((t.calibration or {}).get("state", ""), "")] if calibrated else []),
        )
    return table


_CALIBRATION = {"calibrated": "[green]yes[/]", "uncalibrated": "[yellow]none[/]", "not-calibrated": "[red]no[/]"}


def summary_line(job: JobResult, job_dir: Path) -> str:
    """The job folder, the mean reward and the counts, tampered trials included."""
    mean = "-" if job.mean_reward is None else f"{job.mean_reward:.3f}"
    counts = ", ".join(f"{n} × {reward}" for reward, n in job.reward_counts.items()) or "no verdicts"
    tampered = (
        (f"; [yellow]{job.n_tampered} with tampering[/] (information only: see 'tampering' in each result.json)")
        if job.n_tampered
        else "; 0 with tampering"
    )
    uncalibrated = (
        f"; [yellow]{job.n_uncalibrated} uncalibrated[/] (no calibration of their task here: sequester calibrate)"
        if job.n_uncalibrated
        else ""
    )
    return (
        f"{escape(str(job_dir))}: mean reward {mean} over {job.n_trials - job.n_errors} verdict(s) "
        f"({counts}){tampered}{uncalibrated}; {job.n_errors} error(s); {job.n_trials}/{job.n_total_trials} trials "
        "finished"
    )


def print_summary(console: Console, job: JobResult, trials: list[TrialResult], job_dir: Path) -> None:
    """One row per trial (in the job's order), each error's message, then the job folder,
    the mean reward and the counts."""
    order = {name: i for i, name in enumerate(job.trials)}
    trials = sorted(trials, key=lambda t: order.get(t.trial_name, len(order)))
    console.print(summary_table(job, trials, console.width))
    for t in trials:
        if t.exception_info is not None:
            console.print(
                f"[red]{escape(t.trial_name)}[/]: {escape(t.exception_info.exception_type)}: "
                f"{escape(t.exception_info.exception_message)}",
                highlight=False,
                soft_wrap=True,
            )
    console.print(summary_line(job, job_dir), highlight=False, soft_wrap=True)
