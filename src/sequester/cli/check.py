"""``sequester check``: prove each isolation property of kernels on this machine."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from sequester.cli.common import add_policy_flags, policy_of

__all__ = ["add_check_command"]


def add_check_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="prove each isolation property on this machine")
    add_policy_flags(p, overrides=True)
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.add_argument("--fork", action="store_true", help="prove them on a fork of a warm kernel (Kernel.fork) instead")
    p.set_defaults(func=cmd_check)


def cmd_check(args: argparse.Namespace) -> int:
    from sequester.kernel.check import run_check

    report = run_check(policy_of(args), fork=args.fork)
    if args.json:
        print(
            json.dumps(
                {
                    "mode": report.mode.value,
                    "first_stage": report.first_stage,
                    "view": report.view,
                    "view_note": report.view_note or None,
                    "passed": report.passed,
                    "findings": [vars(f) for f in report.findings],
                },
                indent=2,
            )
        )
        return 0 if report.passed else 1
    table = Table(
        title=f"sequester check (isolation in force: {report.mode.value}; "
        f"first stage: {report.first_stage or 'none'}; view: {report.view or 'none'})"
    )
    table.add_column("property")
    table.add_column("result")
    table.add_column("evidence", overflow="fold")
    for f in report.findings:
        table.add_row(f.name, "[green]pass[/]" if f.passed else "[red]FAIL[/]", f.evidence)
    console = Console()
    console.print(table)
    if report.view_note:
        console.print(f"note: {escape(report.view_note)}", highlight=False, soft_wrap=True)
    return 0 if report.passed else 1
