"""``sequester image pull|import|ls|rm|prune``: the image store from the command line.

Downloads and unpacking show progress bars (on standard error); ``ls`` prints a table
(name, digest, size, last used) or JSON. Bad input (a malformed reference, a path that is
not an image, an unknown image) exits 2 with a message naming it; so does an image that
cannot be had (an unreachable registry, a digest mismatch, no manifest for this platform).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from sequester.config import load_config
from sequester.environments.settings import episode_image_store
from sequester.errors import ImageError
from sequester.images import ImageRecord, ImageStore, parse_reference

__all__ = ["add_image_commands", "image_bars"]

_err = Console(stderr=True)


class _Bars:
    """:class:`sequester.images.progress.Progress` drawn with rich."""

    def __init__(self, bars: Progress):
        self.bars = bars
        self.task: TaskID | None = None

    def phase(self, description: str, total: int | None) -> None:
        self.done()
        self.task = self.bars.add_task(escape(description), total=total)

    def advance(self, amount: int) -> None:
        if self.task is not None:
            self.bars.advance(self.task, amount)

    def note(self, line: str) -> None:
        if self.task is not None:
            self.bars.update(self.task, description=escape(line[:70]))

    def done(self) -> None:
        if self.task is not None:
            total = self.bars.tasks[-1].total
            self.bars.update(self.task, completed=total if total else 1, total=total or 1)
            self.task = None


@contextmanager
def image_bars() -> Iterator[_Bars]:
    """Progress bars for fetching and unpacking, on standard error."""
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeElapsedColumn())
    with Progress(*columns, console=_err, transient=False) as bars:
        yield _Bars(bars)


def _store(args: argparse.Namespace) -> ImageStore:
    return episode_image_store(load_config(args.config).episodes)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"  # pragma: no cover


def _ago(seconds: float) -> str:
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.0f}{unit} ago"
    return "just now"


def _short(name: str) -> str:
    try:
        return parse_reference(name).short
    except ImageError:
        return name


def _print_records(records: list[ImageRecord], store: ImageStore, title: str) -> None:
    table = Table(title=title)
    for column in ("name", "digest", "layers", "size", "last used"):
        table.add_column(column)
    now = time.time()
    for r in records:
        table.add_row(
            escape(", ".join(_short(n) for n in r.names) or "<none>"),
            r.digest[:19],
            str(len(r.layers)),
            _size(r.size),
            _ago(now - store.last_used(r)),
        )
    Console().print(table)


def cmd_pull(args: argparse.Namespace) -> int:
    store = _store(args)
    with image_bars() as bars:
        record = store.pull(args.reference, progress=bars)
    _print_records([record], store, "pulled")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    store = _store(args)
    with image_bars() as bars:
        record = store.import_source(args.path, args.tag, progress=bars)
    _print_records([record], store, "imported")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    store = _store(args)
    records = store.records()
    if args.json:
        print(json.dumps([{**r.to_json(), "last_used": store.last_used(r)} for r in records], indent=1))
    else:
        _print_records(records, store, f"images in {store.root}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    store = _store(args)
    for name in args.names:
        record = store.remove(name)
        print(f"removed {', '.join(record.names) or record.short_id} ({record.digest})")
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    store = _store(args)
    removed, freed = store.prune(args.unused_for * 86400 if args.unused_for is not None else None)
    for record in removed:
        print(f"removed {', '.join(record.names) or record.short_id} ({record.digest})")
    print(f"freed {_size(freed)}")
    return 0


def _days(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of days") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return value


def add_image_commands(sub: argparse._SubParsersAction) -> None:
    image = sub.add_parser("image", help="pull, import, list and remove images of the image store")
    isub = image.add_subparsers(dest="image_command", required=True)
    config = dict(metavar="FILE", help="config file ([images] is used); default: the embedded one")

    p = isub.add_parser("pull", help="fetch an image from a registry (mirrors and aliases of [images] apply)")
    p.add_argument("reference", metavar="REF", help="python:3.13-slim-bookworm, ghcr.io/org/img@sha256:...")
    p.add_argument("--config", **config)
    p.set_defaults(func=cmd_pull)

    p = isub.add_parser(
        "import",
        help="import an OCI layout or archive, a docker save archive, a root filesystem "
        "folder or tarball, or docker-daemon:NAME",
    )
    p.add_argument("path", metavar="PATH")
    p.add_argument("--tag", metavar="NAME", help="the name to know it by (a reference, e.g. my/image:1)")
    p.add_argument("--config", **config)
    p.set_defaults(func=cmd_import)

    p = isub.add_parser("ls", help="list the store's images")
    p.add_argument("--json", action="store_true", help="print the records as JSON")
    p.add_argument("--config", **config)
    p.set_defaults(func=cmd_ls)

    p = isub.add_parser("rm", help="remove images (not while an episode uses them) and the layers only they use")
    p.add_argument("names", nargs="+", metavar="NAME")
    p.add_argument("--config", **config)
    p.set_defaults(func=cmd_rm)

    p = isub.add_parser(
        "prune", help="remove the build cache, and the layers, blobs and temporary files no image needs"
    )
    p.add_argument(
        "--unused-for",
        type=_days,
        metavar="DAYS",
        help="only the build cache's steps not used for DAYS days, and also images not used for as long",
    )
    p.add_argument("--config", **config)
    p.set_defaults(func=cmd_prune)
