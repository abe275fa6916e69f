"""Which wheels a task's test script pins: its ``uvx``/``uv``/``pip`` invocations, read. Pure.

The requirements of every ``uvx``, ``uv tool run``, ``uv run --with``, ``uv pip install``,
``uv add`` and ``pip install`` (``pip3``, ``python3 -m pip``) of a script, and the Python
asked for (``-p 3.13``). Exact pins
(``name==version``) are what :mod:`.wheels` fetches; **unpinned** ones (``-w pandas``,
``numpy>=2``, URLs, paths) never are (they cannot be fetched reproducibly).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from sequester.verifier.script_commands import commands, program_words
from sequester.verifier.tree import PINNED
from sequester.verifier.uv_args import AT_VERSION, PYTHON_COMMAND, scan

__all__ = ["VerifierPins", "verifier_pins"]


# -- reading a test script (pure) ---------------------------------------------------------


@dataclass(frozen=True)
class VerifierPins:
    """What a test script's uv invocations ask for."""

    requirements: tuple[str, ...] = ()  # exact pins, "name==version" (canonical names), sorted
    unpinned: tuple[str, ...] = ()  # as written: no exact version, a URL or a path: never fetched
    pythons: tuple[str, ...] = ()  # "3.13": the versions asked for (-p/--python), in order
    default_python: bool = False  # an invocation with requirements named none: uv's default
    requirement_files: tuple[str, ...] = ()  # --with-requirements / -r files named

    @property
    def python(self) -> str | None:
        """The Python version asked for, when the script asks for exactly one."""
        return self.pythons[0] if len(self.pythons) == 1 and not self.default_python else None

    @property
    def extra(self) -> tuple[str, ...]:
        """The pins the runner's own wheels (PINNED) do not cover."""
        return tuple(r for r in self.requirements if r not in PINNED)


_PIN = re.compile(
    r"^([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)\s*(?:\[([A-Za-z0-9._,\s-]*)\])?\s*===?\s*"
    r"([A-Za-z0-9][A-Za-z0-9.+!_-]*)$"
)
_PYTHON_VERSION = re.compile(r"(?<![\d.])3\.(\d{1,2})(?!\d)")

Found = tuple[list[str], "str | None", list[str]]  # an invocation's requirements, Python, requirement files


def verifier_pins(script: str) -> VerifierPins:
    """The requirements and Pythons a test script's uv invocations ask for (see the module)."""
    pins: list[str] = []
    unpinned: list[str] = []
    pythons: list[str] = []
    files: list[str] = []
    default = False
    for command in commands(script):
        found = _invocation(command)
        if found is None:
            continue
        reqs, python, req_files = found
        files += req_files
        exact = {spec: _exact_pin(spec) for spec in reqs}
        pins += [pin for pin in exact.values() if pin]
        names = {pin.split("[")[0].split("==")[0] for pin in exact.values() if pin}
        # A bare tool name (uvx ... pytest) that a -w of the same invocation pins is pinned.
        unpinned += [spec for spec, pin in exact.items() if pin is None and _canonical(spec) not in names]
        version = _PYTHON_VERSION.search(python) if python else None
        if version is not None:
            pythons.append(f"3.{version[1]}")
        elif reqs:
            default = True
    return VerifierPins(
        tuple(sorted(set(pins))),
        tuple(dict.fromkeys(unpinned)),
        tuple(dict.fromkeys(pythons)),
        default,
        tuple(dict.fromkeys(files)),
    )


def _invocation(words: list[str]) -> Found | None:
    """What one command installs, if it is a uv command that installs anything."""
    assigned, words = program_words(words)
    python: str | None = assigned.get("UV_PYTHON")
    if not words:
        return None
    program, args = os.path.basename(words[0]), words[1:]
    if program == "uvx":
        return _tool_run(args, python)
    if PYTHON_COMMAND.match(program) and args[:3] == ["-m", "pip", "install"]:
        program, args = "pip", args[2:]
    if program in ("pip", "pip3") and args[:1] == ["install"]:  # the runner's pip (see shims): its default Python
        return _collect(args[1:], python, stop=False)
    scanned = list(scan(args, stop=True))  # uv's global options, then the subcommand
    if program != "uv" or not scanned or scanned[-1][0] is not None:
        return None
    sub, rest = scanned[-1][1], args[scanned[-1][2] :]
    if sub == "tool" and rest[:1] == ["run"]:
        return _tool_run(rest[1:], python)
    if sub in ("run", "add") or (sub == "pip" and rest[:1] == ["install"]):
        return _collect(rest[1:] if sub == "pip" else rest, python, stop=sub == "run")
    return None


def _collect(args: list[str], python: str | None, *, stop: bool) -> Found:
    """``uv run`` (``stop``: the command after the options is not a requirement),
    ``uv pip install`` and ``uv add`` (the positionals are requirements)."""
    reqs: list[str] = []
    files: list[str] = []
    for option, value, _ in scan(args, stop=stop):
        if value is None:
            continue
        if option in ("-w", "--with"):
            reqs += _split_commas(value)
        elif option in ("--with-requirements", "-r", "--requirements", "--requirement"):
            files.append(value)
        elif option in ("-p", "--python"):
            python = value
        elif option is None and not stop:
            reqs.append(value)
    return reqs, python, files


def _tool_run(args: list[str], python: str | None) -> Found:
    """``uvx``/``uv tool run``: the ``--with`` requirements, plus the tool's own package
    (``--from``'s, else the command's: ``pytest``, ``pytest==8.4.1``, ``pytest@8.4.1``)."""
    reqs, python, files = _collect(args, python, stop=True)
    scanned = list(scan(args, stop=True))
    source = next((v for o, v, _ in scanned if o == "--from" and v), None)
    tool = source or (scanned[-1][1] if scanned and scanned[-1][0] is None else None)
    if tool and not (source is None and PYTHON_COMMAND.match(tool)):
        at = AT_VERSION.match(tool)
        reqs.append(f"{at[1]}=={at[2]}" if at else tool.removesuffix("@latest"))
    return reqs, python, files


def _split_commas(value: str) -> list[str]:
    """uv's comma-separated requirements: a part that starts with a version operator
    belongs to the one before (``pandas>=2,<3``); no split inside ``[extras]``."""
    parts: list[str] = []
    depth, current = 0, ""
    for ch in value + ",":
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth <= 0:
            piece, current = current.strip(), ""
            if parts and piece[:1] in ("<", ">", "=", "!", "~"):
                parts[-1] += "," + piece
            elif piece:
                parts.append(piece)
        else:
            current += ch
    return parts


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def _exact_pin(spec: str) -> str | None:
    """``name[extras]==version`` (canonical name, sorted extras), or None if ``spec`` is not one."""
    match = _PIN.match(spec.strip())
    if match is None or "*" in match[3]:
        return None
    extras = sorted({_canonical(e) for e in (match[2] or "").split(",") if e.strip()})
    return f"{_canonical(match[1])}{'[' + ','.join(extras) + ']' if extras else ''}=={match[3]}"
