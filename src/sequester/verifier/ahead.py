"""What the runner installs for a test script before the script runs, read from its text. Pure.

Attack: a program the script runs (the agent's ``make``, before the script's ``uvx
pytest``) writes into the runner's uv cache or pip environment, so that the later step
runs its pytest, or a program pytest starts rewrites a module of the running pytest's
own environment. Nothing the script runs may change a runner environment, so they are
made before it runs anything, from the script's own text (the task's: never the agent's),
and then the folder that holds them is read-only for the script and everything it starts
(:mod:`sequester.sandbox.nsexec.server`):

* every ``uvx`` command whose words before the command are plain text (no ``$``, no
  glob, nothing a shell would expand): its tool environment, made by ``uv tool run`` with
  the same options and the runner's own ``env`` as the command (``PATH`` is the runner's
  ``bin`` only while it installs: nothing of the agent's view runs before the folder is
  sealed), whose ``PATH`` begins with the environment's ``bin`` (accepted only inside the
  runner's cache). The runner's ``uvx`` finds its own words there and runs the
  command from that folder, as uvx would (its ``bin`` first on ``PATH``, ``UV`` set);
* every ``pip install`` line (``pip``, ``pip3``), in the script's order, into the runner's
  pip environment, and pinned pytest there when the script runs ``pytest`` or
  ``python -m pytest``. The runner's ``python3``, ``pytest`` and ``pip`` use that
  environment only; a ``pip install`` that was not read ahead (``pip install "$PKG"``)
  is refused, a set-up failure (an environment anything the script ran could have
  written first is never the runner's).

A ``uvx`` or ``uv`` command that could not be read ahead (``uvx -w "$PKG" ...``, ``uv venv``)
is made as the script runs, with uv's cache in a writable folder of its own, where the
programs the script ran before could write: the trial says so.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from sequester.verifier import layout
from sequester.verifier.image_python import IMAGE_PYTHON_VAR
from sequester.verifier.script_commands import commands, program_words
from sequester.verifier.uv_args import AT_VERSION, PYTHON_COMMAND, scan

__all__ = ["Ahead", "Tool", "plan", "request", "install_env", "SEPARATOR"]

SEPARATOR = "\x1f"  # between the words of an index line (see the shims)
_PLAIN = re.compile(r"^[A-Za-z0-9_@%+=:,./<>!~\[\]-]+$")  # a word no shell expands (quotes already gone)
# A word naming a file (``-r /app/req.txt``, ``/app/pkg``, ``./x.whl``): what it names is
# the agent's, whose code (a setup.py) would run while the runner's folder is writable.
_PATH = re.compile(r"^(?:[./~]|[^:]*/)")
_PYTEST = re.compile(r"^(?:py\.test|pytest)$")
_PYTHON = re.compile(r"^python(?:3(?:\.\d+)?)?$")


@dataclass(frozen=True)
class Tool:
    """One ``uvx`` command: its words up to and including the command (what the runner's
    ``uvx`` compares its arguments with), the program to run from the environment, and
    uv's arguments that make that environment and print its ``PATH``."""

    words: tuple[str, ...]
    command: str
    uv_args: tuple[str, ...]


@dataclass(frozen=True)
class Ahead:
    tools: tuple[Tool, ...] = ()
    pip_lines: tuple[tuple[str, ...], ...] = ()  # what follows ``pip install``, as written
    pytest: bool = False  # the script runs pytest from the runner's pip environment

    def __bool__(self) -> bool:
        return bool(self.tools or self.pip_lines or self.pytest)


def plan(*scripts: str) -> Ahead:
    """What of ``scripts`` (the texts of a test script and the scripts beside it, which it
    may run) the runner installs ahead (see the module)."""
    tools: dict[tuple[str, ...], Tool] = {}
    pip: dict[tuple[str, ...], None] = {}
    pytest = False
    for command in (c for script in scripts for c in commands(script)):
        assigned, words = program_words(command)
        if not words:
            continue
        program, args = os.path.basename(words[0]), words[1:]
        if _PYTEST.match(program) or (_PYTHON.match(program) and args[:2] in (["-m", "pytest"], ["-m", "pip"])):
            pytest = True
        if assigned:  # (UV_PYTHON=3.12 uvx ...: the environment differs; made as the script runs)
            continue
        if program == "uvx":
            tool = _tool(args)
            if tool is not None:
                tools.setdefault(tool.words, tool)
        elif program in ("pip", "pip3") and args[:1] == ["install"] and len(args) > 1:
            if all(_ok(w) for w in args[1:]):
                pip.setdefault(tuple(args[1:]), None)
    return Ahead(tuple(tools.values()), tuple(pip), pytest)


def _ok(word: str) -> bool:
    """A word installable ahead: plain text, naming no file (a URL is no file)."""
    return bool(_PLAIN.match(word)) and ("://" in word or not _PATH.match(word))


def _tool(args: list[str]) -> Tool | None:
    """A ``uvx`` command (its arguments ``args``), if it can be installed ahead."""
    scanned = list(scan(args, stop=True))
    if not scanned or scanned[-1][0] is not None:
        return None  # (no command)
    end = scanned[-1][2]
    words, options = tuple(args[:end]), args[: end - 1]
    command_word = args[end - 1]
    if "--" in options or not all(_ok(w) for w in words):
        return None
    source = next((v for o, v, _ in scanned if o == "--from" and v), None)
    if source is None and PYTHON_COMMAND.match(command_word):
        return None  # ("uvx python": an interpreter, no tool environment)
    at = AT_VERSION.match(command_word)
    command = at[1] if at else re.split(r"[@=<>!~\[]", command_word, maxsplit=1)[0]
    if not command or "/" in command:
        return None
    extra = () if source is not None else ("--from", command_word.removesuffix("@latest"))
    return Tool(words, command, ("tool", "run", *options, *extra, str(layout.BIN / "env")))


# What of the runner's environment the installs ahead get (an allowlist): nothing of the
# image's ENV (red team: its PYTHONPATH naming /app had uv's interpreter query import the
# agent's module; a UV_PYTHON could name the agent's interpreter) but the Python version
# the runner's python3 follows.
_INSTALL_KEEP = frozenset(
    {
        "HOME",
        "LANG",
        "TERM",
        "SHELL",
        "UV_OFFLINE",
        "UV_NO_INDEX",
        "UV_NO_CONFIG",
        "UV_FIND_LINKS",
        "UV_PYTHON_INSTALL_DIR",
        "UV_PYTHON_PREFERENCE",
        "UV_PYTHON_DOWNLOADS",
        "UV_NO_PROGRESS",
        IMAGE_PYTHON_VAR,
    }
)


def install_env(runner_env: Mapping[str, str]) -> dict[str, str]:
    """The environment of the installs ahead, from the script's (``runner_env``): only
    :data:`_INSTALL_KEEP`, then the runner's own folders and ``PATH`` (its ``bin`` only:
    nothing of the view runs while the runner's folder is writable)."""
    env = {k: v for k, v in runner_env.items() if k in _INSTALL_KEEP}
    env.update(
        {
            "UV_CACHE_DIR": str(layout.RUN_CACHE),
            "UV_TOOL_DIR": str(layout.RUN_TOOLS),
            "SEQUESTER_PIP_ENV": str(layout.RUN_PIP),
            "PATH": str(layout.BIN),
        }
    )
    return env


def request(ahead: Ahead, runner_env: Mapping[str, str]) -> dict[str, object]:
    """The namespace helper's part of a verify request: the programs to run, in order,
    each with what it records on success (see :func:`sequester.sandbox.nsexec.server`)."""
    uv, pip = str(layout.LIBEXEC / "uv"), str(layout.BIN / "pip")
    steps: list[dict[str, object]] = [
        {"argv": [uv, *t.uv_args], "tool": {"words": list(t.words), "command": t.command}} for t in ahead.tools
    ]
    steps += [{"argv": [pip, "install", *line], "pip_line": list(line)} for line in ahead.pip_lines]
    if ahead.pytest or ahead.pip_lines:
        pinned = next(p for p in layout.PINNED if p.startswith("pytest=="))
        steps.append(
            {"argv": [pip, "install", pinned], "pip_line": [pinned], "unless": str(layout.RUN_PIP / "bin/pytest")}
        )
    return {
        "steps": steps,
        "env": install_env(runner_env),
        "roots": [str(layout.RUN_CACHE), str(layout.RUN_TOOLS)],  # where a tool's bin may be
        "index": str(layout.TOOL_INDEX),  # a line a tool: its bin folder, command, words (SEPARATOR)
        "separator": SEPARATOR,
        "pip_lines": str(layout.PIP_LINES),
    }
