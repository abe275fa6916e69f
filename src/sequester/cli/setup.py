"""``sequester setup ids``: give root the range of subordinate ids its episodes map.

A root caller's episodes map 65,536 ids (:mod:`sequester.sandbox.idmap`): its own as root,
and a subordinate range for the image's other users. The range comes from ``[episodes]
id_range`` or from root's entry in ``/etc/subuid`` and ``/etc/subgid``, which this command
adds with the field's own tool (``usermod --add-subuids/--add-subgids``, from ``passwd``)
at the first free range past every other entry. Nothing else makes it: without it, an
episode maps one id and says so.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess

from sequester.errors import PolicyError, SequesterError
from sequester.sandbox.idmap import IDS, SUBGID, SUBUID, caller_id_map, free_range, root_range_argv

__all__ = ["add_setup_command"]


def add_setup_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "setup",
        help="one-time host set-up (ids: root's subordinate id range)",
        description="One-time set-up of this host for sequester.",
    )
    what = p.add_subparsers(dest="what", required=True)
    ids = what.add_parser(
        "ids",
        help="give root a range of 65,536 subordinate ids in /etc/subuid and /etc/subgid",
        description=(
            "Give root the range of subordinate ids its episodes map (apt's _apt, useradd's users): "
            "65,536 ids in /etc/subuid and /etc/subgid, added with usermod at the first free range. "
            "Does nothing when root has one."
        ),
    )
    ids.add_argument("--dry-run", action="store_true", help="print the usermod command instead of running it")
    ids.set_defaults(func=_setup_ids)


def _setup_ids(args: argparse.Namespace) -> int:
    if os.getuid() != 0:
        raise PolicyError(
            "sequester setup ids is for root: an ordinary user's range is in /etc/subuid and /etc/subgid "
            "(useradd gives each new user one; an administrator adds one with usermod --add-subuids)"
        )
    have, why = caller_id_map()
    if have is not None:
        print(f"root already has a range: {have.describe()}")
        return 0
    texts = []
    for path in (SUBUID, SUBGID):
        try:
            texts.append(path.read_text())
        except FileNotFoundError:
            texts.append("")
    argv = root_range_argv(free_range(texts[0], texts[1]))
    if args.dry_run:
        print(" ".join(argv))
        return 0
    if shutil.which("usermod") is None:
        raise SequesterError(f"usermod (Debian's passwd) is missing; run the equivalent of: {' '.join(argv)}")
    for path in (SUBUID, SUBGID):
        if not path.exists():
            path.touch(mode=0o644)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise SequesterError(f"{' '.join(argv)} failed: {done.stderr.strip() or done.returncode}")
    have, why = caller_id_map()
    if have is None:
        raise SequesterError(f"the range was added, but episodes still map one id: {why}")
    print(f"root's episodes now map {IDS} ids: {have.describe()}")
    return 0
