"""The ``sequester`` command: a thin layer over the library.

Exit statuses, every command: 0 success; 1 the program failed (``exec``), a property
failed (``check``), a trial ended with an exception (``run``); 2 bad input (a flag, the
config file, a program file that cannot be read, a task, an agent, the output folder, an
image that cannot be had),
with a message naming it; 3 sequester itself could not do it here (no sandbox can be
made, a sandbox failed to start, a kernel died), with a message; 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from sequester import __version__
from sequester.config import Config, load_config
from sequester.cli.image import add_image_commands
from sequester.cli.backend import add_backend_arguments, apply_backend_arguments, scheduler_for
from sequester.cli.build import add_build_command, positive
from sequester.cli.serve import add_serve_command
from sequester.errors import ImageError, PolicyError, SequesterError, TaskError
from sequester.images.image_settings import IMAGE_SOURCES
from sequester.policy import Policy

__all__ = ["main"]

log = logging.getLogger("sequester")
_err = Console(stderr=True)


DESCRIPTION = ("Run model-written code in a sandboxed kernel (exec), prove the sandbox's properties on this "
               "machine (check), and run agents on tasks, scored by verifiers they cannot reach (run).")
EPILOG = ("exit status: 0 success; 1 the program failed (exec), a property failed (check) or a trial ended "
          "with an exception (run); 2 bad input (flags, config, files, tasks, agent); 3 sequester could not "
          "run here (sandbox unavailable or failed); 130 interrupted")


def _config(args: argparse.Namespace) -> Config:
    """The whole config file, validated once per command (every table, whatever the command uses)."""
    if getattr(args, "_loaded", None) is None:
        args._loaded = load_config(args.config)
    return args._loaded


def _policy(args: argparse.Namespace) -> Policy:
    policy = _config(args).policy
    return policy.with_overrides(
        allow=getattr(args, "allow", None) or (),
        readonly=getattr(args, "readonly", None) or (),
        hide=getattr(args, "hide", None) or (),
        isolation=_isolation_flag(args.isolation) if getattr(args, "isolation", None) else None,
    )


def _isolation_flag(text: str) -> object:
    return {"true": True, "false": False}.get(text, text)


def _add_policy_flags(p: argparse.ArgumentParser, *, overrides: bool) -> None:
    p.add_argument("--config", metavar="FILE", help="policy file (TOML); default: the embedded configs/default.toml")
    if overrides:
        p.add_argument("--allow", action="append", metavar="HOST:PORT", help="also allow this service (or URL)")
        p.add_argument("--readonly", action="append", metavar="PATH", help="also mount this path read-only")
        p.add_argument("--hide", action="append", metavar="PATH", help="also hide this path")
    p.add_argument("--isolation", choices=["true", "auto", "false"], help="override runtime.isolation")


def cmd_exec(args: argparse.Namespace) -> int:
    from sequester.kernel.client import Kernel

    code, filename = _program(args.file)
    policy = _policy(args)

    def relay(stream: str, text: str) -> None:
        out = sys.stdout if stream == "stdout" else sys.stderr
        out.write(text)
        out.flush()

    with Kernel(policy) as kernel:
        result = kernel.run(code, filename=filename, timeout=args.timeout, on_output=relay)
    if result.error is None:
        return 0
    if result.error.type == "SystemExit":
        code_text = result.error.message
        if code_text in ("0", "None", ""):
            return 0
        if not code_text.lstrip("-").isdigit():
            sys.stderr.write(code_text + "\n")
            return 1
        return int(code_text)
    sys.stderr.write(_user_traceback(result.error.type, result.error.traceback, filename) or f"{result.error}\n")
    return 1


def _program(file: str) -> tuple[str, str]:
    """The program's text and the name its tracebacks use; unreadable or not UTF-8: exit 2."""
    if file == "-":
        data, filename = sys.stdin.buffer.read(), "<stdin>"
    else:
        try:
            data, filename = Path(file).read_bytes(), file
        except OSError as exc:
            raise PolicyError(f"cannot read {file!r}: {exc.strerror}") from None
    try:
        return data.decode("utf-8"), filename
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise PolicyError(f"{filename}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}, "
                          f"line {line}); a program must be UTF-8") from None


def _user_traceback(kind: str, text: str, filename: str) -> str:
    """A traceback as the user should see it: a syntax error shows the program's line only,
    not the kernel's call into the compiler (``ast.py``)."""
    if kind not in ("SyntaxError", "IndentationError", "TabError") or not text:
        return text
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.startswith(f'  File "{filename}", line ')
                  and ", in " not in line), None)
    return text if start is None else "".join(lines[start:])


def cmd_check(args: argparse.Namespace) -> int:
    from sequester.kernel.check import run_check

    report = run_check(_policy(args))
    if args.json:
        print(json.dumps({"mode": report.mode.value, "first_stage": report.first_stage, "view": report.view,
                          "passed": report.passed,
                          "findings": [vars(f) for f in report.findings]}, indent=2))
        return 0 if report.passed else 1
    table = Table(title=f"sequester check (isolation in force: {report.mode.value}; "
                        f"first stage: {report.first_stage or 'none'}; view: {report.view or 'none'})")
    table.add_column("property")
    table.add_column("result")
    table.add_column("evidence", overflow="fold")
    for f in report.findings:
        table.add_row(f.name, "[green]pass[/]" if f.passed else "[red]FAIL[/]", f.evidence)
    Console().print(table)
    return 0 if report.passed else 1


def cmd_run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from sequester.jobs import TrialResult, default_job_name, run_job
    from sequester.jobs.render import print_summary, trial_progress
    from sequester.tasks import find_tasks

    settings = _config(args).episodes  # the whole file is checked, [runtime] and [limits] too
    overrides = {"exec_timeout": args.exec_timeout, "freeze_agent": args.freeze_agent or None,
                 "verifier_env": args.verifier_env}
    settings = replace(settings, **{k: v for k, v in overrides.items() if v is not None})
    if args.image_source:
        settings = replace(settings, images=replace(settings.images, source=args.image_source))
    settings = apply_backend_arguments(args, settings)
    tasks = find_tasks(args.tasks)  # also: a malformed task fails here, before anything runs
    scheduler = scheduler_for(args)  # --backend ray (its nodes fetch and build their own images)
    total = len(tasks)
    if scheduler is None and settings.backend == "local" and settings.images.source in ("prebuilt", "auto") and any(t.config.environment.docker_image for t in tasks):
        from sequester.cli.image import image_bars
        from sequester.images import ImageStore
        from sequester.images.choose import prefetch_images

        with image_bars() as bars:  # the images first, with their own progress bars
            prefetch_images(tasks, settings.images.source, ImageStore(settings.images), progress=bars)
    job_name = args.job_name or default_job_name()
    job_dir = _jobs_dir(args.output) / job_name
    finished: list[TrialResult] = []
    try:
        with trial_progress(total, _err, f"{args.agent} on {total} task{'s' * (total != 1)}") as advance:
            def progress(result: TrialResult) -> None:
                finished.append(result)
                advance(result)

            job = run_job(args.tasks, args.agent, jobs_dir=args.output, job_name=job_name,
                          concurrency=args.concurrency, settings=settings, progress=progress,
                          build_progress=_build_lines, scheduler=scheduler)
    except KeyboardInterrupt:
        if job_dir.is_dir():
            _err.print(f"interrupted: what finished is in {escape(str(job_dir))}", highlight=False, soft_wrap=True)
        raise
    print_summary(Console(), job, finished, job_dir)
    return 0 if job.n_errors == 0 and job.n_trials == job.n_total_trials else 1


def _build_lines(task: str, report, done: bool) -> None:
    """A Dockerfile build before the trials: each step as docker build shows it."""
    if not done:
        _err.print(f"[bold]{escape(task)}[/] #{report.number} {escape(report.title())}", highlight=False,
                   soft_wrap=True)
    elif not report.cached:
        _err.print(f"[bold]{escape(task)}[/] #{report.number} [green]DONE[/] {report.seconds:.1f}s", highlight=False)


def _jobs_dir(output: str) -> Path:
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sequester", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    parser.add_argument("--version", action="version", version=f"sequester {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("exec", help="run a program in a fresh kernel")
    _add_policy_flags(p, overrides=True)
    p.add_argument("--timeout", type=float, help="seconds (default: limits.cell_timeout)")
    p.add_argument("file", metavar="FILE|-")
    p.set_defaults(func=cmd_exec)

    p = sub.add_parser("check", help="prove each isolation property on this machine")
    _add_policy_flags(p, overrides=True)
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("run", help="run an agent on tasks, one episode each, and score them")
    p.add_argument("tasks", nargs="+", metavar="TASK_DIR|TASKS_DIR", help="a task folder, or a folder of them")
    p.add_argument("--agent", required=True, metavar="AGENT", help="oracle, nop, script:PATH or module:Class")
    p.add_argument("-n", "--concurrency", type=positive(int), default=4, metavar="N",
                   help="trials at a time (default: 4)")
    p.add_argument("-o", "--output", default="jobs", metavar="JOBS_DIR", help="where job folders go (default: jobs)")
    p.add_argument("--job-name", metavar="NAME", help="the job's folder name (default: the time, YYYY-MM-DD__HH-MM-SS)")
    p.add_argument("--config", metavar="FILE",
                   help="config file ([episodes] is used; every table is checked); default: the embedded one")
    p.add_argument("--exec-timeout", type=positive(float), metavar="S", help="default seconds per agent command")
    p.add_argument("--freeze-agent", action="store_true", help="freeze the agent's processes while the verifier runs")
    p.add_argument("--verifier-env", choices=["shared", "separate"],
                   help="run the tests in the agent's environment (shared) or in a fresh one holding only the task's artifacts")
    p.add_argument("--image-source", choices=list(IMAGE_SOURCES),
                   help="what each episode runs on: the task's prebuilt docker_image, its Dockerfile, the host's "
                        "system, or auto (the image when it can be had, else host mode); default: [images] source")
    add_backend_arguments(p, cluster=True)
    p.set_defaults(func=cmd_run)

    add_image_commands(sub)
    add_build_command(sub)
    add_serve_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="sequester: %(levelname)s: %(message)s")
    try:
        return args.func(args)
    except (PolicyError, TaskError, ImageError) as exc:
        _err.print(f"[red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 2
    except SequesterError as exc:
        _err.print(f"[red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 3
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
