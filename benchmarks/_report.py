"""The side-by-side table every benchmark prints."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

def rss_kb(pid: int) -> int:
    """Resident memory of a process, in KiB (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


Row = tuple[str, str, str, str, bool]  # measure, sequester, reference (same run), target, met


def report(title: str, rows: list[Row]) -> int:
    """Print the table; the exit status: 0 if every target is met."""
    table = Table(title=title)
    for column in ("measure", "sequester", "reference (same run)", "target", "met"):
        table.add_column(column)
    for name, value, reference, target, ok in rows:
        table.add_row(name, value, reference, target, "[green]yes[/]" if ok else "[red]NO[/]")
    Console().print(table)
    return 0 if all(r[4] for r in rows) else 1
