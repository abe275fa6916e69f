"""The README's own examples and synopses hold (issue #7)."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sequester.cli import build_parser
from sequester.environments.base import ExecResult

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.S | re.M)


def test_the_first_python_example_runs_as_it_stands():
    """Pasted into a Python in the repository's folder (where the set-up steps leave you)."""
    block = code_blocks("python")[0]
    r = subprocess.run([sys.executable, "-"], input=block, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    # Each `print(...)  # shown` line of the example shows what it says.
    shown = [m.group(1).strip() for m in re.finditer(r"^\s*print\(.*\)\s+#\s*(.*)$", block, flags=re.M)]
    assert shown and r.stdout.splitlines() == shown, (r.stdout, shown)


def subcommands() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def synopsis(command: str) -> str:
    """``sequester COMMAND ...`` in the README's sh blocks, continuation lines included."""
    for block in code_blocks("sh"):
        lines = block.splitlines()
        for i, line in enumerate(lines):
            if line.startswith(f"sequester {command} ") and "[-" in line:  # not an example
                more = [x for x in lines[i + 1:] if x.startswith(" ") and x.strip().startswith("[")]
                return " ".join([line, *[x.strip() for x in more]])
    raise AssertionError(f"no synopsis of 'sequester {command}' in the README")


@pytest.mark.parametrize("command", ["exec", "check", "run"])
def test_every_option_is_in_the_synopsis(command):
    text = synopsis(command)
    for action in subcommands()[command]._actions:
        if action.option_strings and "-h" not in action.option_strings:
            assert any(re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", text) for o in action.option_strings), \
                (command, action.option_strings)


def test_version_is_documented():
    assert "sequester --version" in README


def test_what_exec_returns_is_documented():
    for field in dataclasses.fields(ExecResult):
        assert f"`{field.name}`" in README, field.name
    assert re.search(r"read_file\([^)]*\)` returns[^.]*`bytes`", README)


def test_every_exit_status_is_documented():
    for status in ("0", "1", "2", "3", "130"):
        assert re.search(rf"^\| {status} \|", README, flags=re.M), status


def test_every_image_subcommand_and_option_is_documented():
    image = subcommands()["image"]
    action = next(a for a in image._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in action.choices.items():
        assert f"sequester image {name}" in README, name
        for option in parser._actions:
            if option.option_strings and "-h" not in option.option_strings and "--config" not in option.option_strings:
                assert any(o in README for o in option.option_strings), (name, option.option_strings)
