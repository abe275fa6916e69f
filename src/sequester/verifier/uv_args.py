"""uv's command line, read as uv reads it (options, their values, the first positional). Pure.

Shared by :mod:`.wheel_pins` (which wheels a script pins) and :mod:`.ahead` (which of its
``uvx`` tools the runner installs before the script runs).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

__all__ = ["scan", "AT_VERSION", "PYTHON_COMMAND"]

# uv's options that take a value (the others are flags), long and short.
_LONG_VALUE = set(
    """
    with with-editable with-requirements from python index default-index index-url extra-index-url find-links
    index-strategy keyring-provider config-setting resolution prerelease fork-strategy exclude-newer
    exclude-newer-package link-mode cache-dir directory project color config-file upgrade-package reinstall-package
    no-binary-package no-build-package refresh-package env-file build-constraints build-constraint constraints
    constraint overrides override python-platform python-version torch-backend allow-insecure-host requirements
    requirement target prefix extra group only-group no-group package script editable optional tag branch rev
    bounds marker no-binary only-binary""".split()
)
_SHORT_VALUE = set("wpifCPcbre")
AT_VERSION = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)@([0-9][A-Za-z0-9.+!_-]*)$")  # uvx pytest@8.4.1
PYTHON_COMMAND = re.compile(r"^c?python(?:3(?:\.\d+)?)?$")  # "uvx python" runs an interpreter, no package


def scan(args: list[str], *, stop: bool) -> Iterator[tuple[str | None, str | None, int]]:
    """uv's command line as (option, value, end): value None for a flag, option None for a
    positional, ``end`` the index after the item; with ``stop``, nothing after the first
    positional (``--`` ends the options)."""
    i = 0
    while i < len(args):
        arg, i = args[i], i + 1
        if arg == "--":
            yield from ((None, args[k], k + 1) for k in range(i, min(len(args), i + 1 if stop else len(args))))
            return
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            takes, attached = name[2:] in _LONG_VALUE, value if eq else ""
        elif arg.startswith("-") and len(arg) > 1:
            name, takes, attached = arg[:2], arg[1] in _SHORT_VALUE, arg[2:].removeprefix("=")
            name = name if takes else arg
        else:
            yield None, arg, i
            if stop:
                return
            continue
        if takes and not attached and not (arg.startswith("--") and "=" in arg):
            attached, i = (args[i] if i < len(args) else ""), i + 1
        yield name, (attached if takes or "=" in arg else None), i
