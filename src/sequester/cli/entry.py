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
import logging

from rich.markup import escape

from sequester import __version__
from sequester.cli.build import add_build_command
from sequester.cli.calibrate import add_calibrate_command
from sequester.cli.check import add_check_command
from sequester.cli.common import err
from sequester.cli.exec import add_exec_command
from sequester.cli.image import add_image_commands
from sequester.cli.run import add_run_command
from sequester.cli.serve import add_serve_command
from sequester.cli.setup import add_setup_command
from sequester.errors import ImageError, PolicyError, SequesterError, TaskError

__all__ = ["main"]

log = logging.getLogger("sequester")


DESCRIPTION = (
    "Run model-written code in a sandboxed kernel (exec), prove the sandbox's properties on this "
    "machine (check), and run agents on tasks, scored by verifiers they cannot reach (run)."
)
EPILOG = (
    "exit status: 0 success; 1 the program failed (exec), a property failed (check) or a trial ended "
    "with an exception (run); 2 bad input (flags, config, files, tasks, agent); 3 sequester could not "
    "run here (sandbox unavailable or failed); 130 interrupted"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sequester", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    parser.add_argument("--version", action="version", version=f"sequester {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_exec_command(sub)
    add_check_command(sub)
    add_run_command(sub)
    add_calibrate_command(sub)
    add_image_commands(sub)
    add_build_command(sub)
    add_serve_command(sub)
    add_setup_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="sequester: %(levelname)s: %(message)s")
    try:
        return args.func(args)
    except (PolicyError, TaskError, ImageError) as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 2
    except SequesterError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 3
    except KeyboardInterrupt:
        return 130
