"""The README and the manual in docs/ hold (issue #7): the README's example runs, and
docs/ documents every command-line option, every config key and every module, names
only Python paths that import, and links only to files (and headings) that exist."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import sequester
from sequester.cli import build_parser
from sequester.config import TABLES
from sequester.environments.base import ExecResult
from sequester.environments.docker import engine as docker_engine
from sequester.environments.settings import EpisodeSettings
from sequester.images.image_settings import ImageSettings
from sequester.policy import Limits, Policy
from sequester.serve.serve_settings import ServeSettings

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
README = (REPO / "README.md").read_text()
README_MAX_LINES = 250
SOURCE = REPO / "src" / "sequester"


def page(name: str) -> str:
    return (DOCS / name).read_text()


def doc_pages() -> dict[Path, str]:
    """docs/*.md, by path."""
    return {p: p.read_text() for p in sorted(DOCS.glob("*.md"))}


def docs_text() -> str:
    return "\n".join(doc_pages().values())


def code_blocks(language: str, text: str = README) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


# -- the README ---------------------------------------------------------------------------


def test_the_first_python_example_runs_as_it_stands():
    """Pasted into a Python in the repository's folder (where the set-up steps leave you)."""
    block = code_blocks("python")[0]
    r = subprocess.run([sys.executable, "-"], input=block, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    # Each `print(...)  # shown` line of the example shows what it says.
    shown = [m.group(1).strip() for m in re.finditer(r"^\s*print\(.*\)\s+#\s*(.*)$", block, flags=re.M)]
    assert shown and r.stdout.splitlines() == shown, (r.stdout, shown)


def test_the_readme_is_the_front_door():
    lines = README.count("\n") + (not README.endswith("\n"))
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; at most {README_MAX_LINES} (the manual is docs/)"


# -- the command line ---------------------------------------------------------------------


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    return dict(action.choices) if action else {}


def subcommands() -> dict[str, argparse.ArgumentParser]:
    return subparsers(build_parser())


def every_parser() -> dict[str, argparse.ArgumentParser]:
    """``""`` (the command itself), ``"run"``, ..., ``"image pull"``, ...: every parser there is."""
    found, todo = {}, [("", build_parser())]
    while todo:
        name, parser = todo.pop()
        found[name] = parser
        todo += [(f"{name} {sub}".strip(), p) for sub, p in subparsers(parser).items()]
    return found


def options(parser: argparse.ArgumentParser) -> list[list[str]]:
    """Each option's strings (``["-n", "--concurrency"]``), help left out."""
    return [
        list(a.option_strings) for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)
    ]


# Where each command's synopsis is (a ``sequester COMMAND [-...`` line in an sh block).
SYNOPSIS_PAGES = {
    "exec": "kernels.md",
    "check": "kernels.md",
    "run": "running-tasks.md",
    "calibrate": "running-tasks.md",
    "build": "running-tasks.md",
    "serve": "server.md",
    "image pull": "running-tasks.md",
    "image import": "running-tasks.md",
    "image ls": "running-tasks.md",
    "image rm": "running-tasks.md",
    "image prune": "running-tasks.md",
    "setup ids": "running-tasks.md",
}


def synopsis(command: str, text: str) -> str:
    """``sequester COMMAND [-...`` in the page's sh blocks, continuation lines included (of
    several, the one with the most options: an overview may show a few)."""
    found = []
    for block in code_blocks("sh", text):
        lines = block.splitlines()
        for i, line in enumerate(lines):
            if line.startswith(f"sequester {command} ") and "[-" in line:  # not an example
                more = []
                for x in lines[i + 1 :]:
                    if not (x.startswith(" ") and x.strip().startswith("[")):
                        break
                    more.append(x.strip())
                found.append(" ".join([line, *more]))
    assert found, f"no synopsis of 'sequester {command}' in its page"
    return max(found, key=lambda s: s.count("[-"))


def test_every_command_has_a_synopsis_page():
    commands = {name for name, parser in every_parser().items() if name and not subparsers(parser)}
    assert commands == set(SYNOPSIS_PAGES), "a command was added or removed: give it a synopsis in docs/"


@pytest.mark.parametrize("command", sorted(SYNOPSIS_PAGES))
def test_every_option_is_in_the_synopsis(command):
    text = synopsis(command, page(SYNOPSIS_PAGES[command]))
    for strings in options(every_parser()[command]):
        assert any(re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", text) for o in strings), (command, strings)


def test_every_option_of_every_command_is_documented():
    """Each option string, backquoted (`--exec-timeout`, `--exec-timeout S`), somewhere in docs/."""
    text = docs_text()
    missing = [
        (name or "sequester", o)
        for name, parser in every_parser().items()
        for strings in options(parser)
        for o in strings
        if not re.search(rf"`{re.escape(o)}(?![\w-])", text)
    ]
    assert not missing, f"options not documented (backquoted) in docs/: {missing}"


def test_version_is_documented():
    assert "sequester --version" in docs_text()


def test_what_exec_returns_is_documented():
    text = page("running-tasks.md")
    for field in dataclasses.fields(ExecResult):
        assert f"`{field.name}`" in text, field.name
    assert re.search(r"read_file\([^)]*\)` returns[^.]*`bytes`", text)


@pytest.mark.parametrize("name", ["kernels.md", "running-tasks.md"])
def test_every_exit_status_is_documented(name):
    text = page(name)
    for status in ("0", "1", "2", "3", "130"):
        assert re.search(rf"^\| {status} \|", text, flags=re.M), (name, status)


def test_every_image_subcommand_and_option_is_documented():
    text = page("running-tasks.md")
    for name, parser in subparsers(subcommands()["image"]).items():
        assert f"sequester image {name}" in text, name
        for strings in options(parser):
            assert any(o in text for o in strings), (name, strings)


# -- the config file ----------------------------------------------------------------------

EXPECTED_TABLES = ("runtime", "limits", "episodes", "images", "serve")


def config_keys() -> dict[str, dict[str, dataclasses.Field]]:
    """Each table's keys, from the dataclasses that hold them."""
    policy = {f.name: f for f in dataclasses.fields(Policy)}
    # [runtime]: the Policy's fields, but its [limits] (a table of its own) and ``hide``
    # (written ``isolation = {hide = [...]}``).
    runtime = {k: f for k, f in policy.items() if k not in ("limits", "hide")}
    runtime["isolation.hide"] = policy["hide"]
    episodes = {f.name: f for f in dataclasses.fields(EpisodeSettings)}
    assert episodes.pop("images").type in ("ImageSettings", ImageSettings)  # [images], a table of its own
    return {
        "runtime": runtime,
        "limits": {f.name: f for f in dataclasses.fields(Limits)},
        "episodes": episodes,
        "images": {f.name: f for f in dataclasses.fields(ImageSettings)},
        "serve": {f.name: f for f in dataclasses.fields(ServeSettings)},
    }


def split_cells(row: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


def key_rows(table: str) -> dict[str, list[str]]:
    """The rows of the ``| key | type | default | meaning |`` table in configuration.md's
    section of ``[table]``, by key."""
    sections = re.split(r"^## ", without_code_blocks(page("configuration.md")), flags=re.M)
    section = next((s for s in sections if s.splitlines()[0].strip() == f"`[{table}]`"), None)
    assert section is not None, f"configuration.md has no section '## `[{table}]`'"
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if split_cells(line) == ["key", "type", "default", "meaning"])
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = split_cells(line)
        key = re.fullmatch(r"`([^`]+)`", cells[0])
        assert key, f"[{table}]: {line!r} does not start with a backquoted key"
        rows[key.group(1)] = cells
    return rows


def test_the_config_tables_are_the_documented_ones():
    assert TABLES == EXPECTED_TABLES, "a config table was added or removed: document it in docs/configuration.md"


@pytest.mark.parametrize("table", EXPECTED_TABLES)
def test_every_config_key_is_documented(table):
    """Every key has a row (type, default, meaning), and every row is a key (or a part of one)."""
    expected = config_keys()[table]
    rows = key_rows(table)
    missing = sorted(set(expected) - set(rows))
    assert not missing, f"[{table}] keys not in docs/configuration.md: {missing}"
    stale = sorted(k for k in rows if k not in expected and k.split(".")[0] not in expected)
    assert not stale, f"[{table}] rows in docs/configuration.md that are no key: {stale}"
    for key, cells in rows.items():
        assert len(cells) == 4 and all(cells), f"[{table}] {key}: a row needs a type, a default and a meaning"


def plain_default(field: dataclasses.Field) -> object:
    """The field's default when it is plain TOML data (else ``None``: a path, an enum, unset)."""
    value = field.default if field.default is not dataclasses.MISSING else field.default_factory()
    if isinstance(value, tuple):
        value = list(value)
    return value if isinstance(value, (bool, int, float, str, list, dict)) else None


@pytest.mark.parametrize("table", EXPECTED_TABLES)
def test_every_documented_default_is_the_default(table):
    """The default column's first code span is the dataclass's default, as TOML."""
    for key, field in config_keys()[table].items():
        default = plain_default(field)
        if default is None:
            continue
        span = re.search(r"`([^`]*)`", key_rows(table)[key][2])
        assert span, f"[{table}] {key}: no default shown"
        shown = tomllib.loads(f"v = {span.group(1)}")["v"]
        assert shown == default, f"[{table}] {key}: the docs say {span.group(1)}, the default is {default!r}"


# -- links and names ----------------------------------------------------------------------


def markdown_files() -> dict[Path, str]:
    return {REPO / "README.md": README, **doc_pages()}


def slugs(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings."""
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.*)$", without_code_blocks(text), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n, candidate = 0, slug
        while candidate in found:
            n += 1
            candidate = f"{slug}-{n}"
        found.add(candidate)
    return found


def test_every_relative_link_leads_somewhere():
    broken = []
    for path, text in markdown_files().items():
        for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", without_code_blocks(text)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            where = (path.parent / file).resolve() if file else path
            if not where.exists():
                broken.append(f"{path.relative_to(REPO)}: {target} (no such file)")
            elif anchor and where.suffix == ".md" and anchor not in slugs(where.read_text()):
                broken.append(f"{path.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, broken


REPOSITORY_FOLDERS = ("tests", "benchmarks", "examples", "configs", "src", ".ci", "docs")
TASK_FILES = {"tests/test.sh"}  # a task's own tests/ folder, not the repository's


def test_every_file_of_the_repository_named_exists():
    """Backquoted paths (`tests/helpers/engine.py`, `examples/tasks`, `kernel/stage0.c`)
    name files that are there: from the repository's folder, or, for a package's files,
    from src/sequester/."""
    packages = {p.name for p in SOURCE.iterdir() if (p / "__init__.py").exists()}
    missing = []
    for path, text in markdown_files().items():
        for span in re.findall(r"`([^`\s]+)`", text):
            first = span.split("/")[0]
            if "/" not in span or span in TASK_FILES or re.search(r"[<>*]|\.\.\.", span):
                continue
            if first in REPOSITORY_FOLDERS:
                where = REPO / span
            elif first in packages and re.search(r"\.(py|c|h)$", span):
                where = SOURCE / span
            else:
                continue
            if not where.exists():
                missing.append(f"{path.relative_to(REPO)}: {span}")
    assert not missing, missing


DOCKER_LABELS = {docker_engine.MANAGED, docker_engine.OWNER, docker_engine.ROLE}  # sequester.managed, ...: labels


# Optional dependencies the project's venv does not have (Harbor needs Python >= 3.12;
# Inspect is large): a path needing one is checked in its own venv (tests/harbor/, tests/inspect/).
OPTIONAL_ONLY = {"harbor", "inspect_ai"}


def resolve(dotted: str) -> object:
    """The module or attribute a dotted path names (raises if there is none)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
                continue  # not a module: an attribute of a shorter one
            raise
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def dotted_paths() -> set[str]:
    text = "\n".join(markdown_files().values())
    return set(re.findall(r"(?<![\w./-])sequester(?:\.[A-Za-z_]\w*)+", text)) - DOCKER_LABELS


def test_every_python_path_named_imports():
    paths = dotted_paths()
    assert "sequester.kernel.launch.run_confined" in paths  # the search finds them
    bad = []
    for dotted in sorted(paths):
        try:
            resolve(dotted)
        except ModuleNotFoundError as exc:
            if exc.name in OPTIONAL_ONLY:
                continue  # needs an optional dependency this venv cannot have (tests/harbor/ import it there)
            bad.append(f"{dotted}: {exc}")
        except (ImportError, AttributeError) as exc:
            bad.append(f"{dotted}: {exc}")
    assert not bad, bad


def test_every_import_in_the_examples_works():
    bad = []
    for text in markdown_files().values():
        for block in code_blocks("python", text):
            for node in ast.walk(ast.parse(block)):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "sequester":
                    for alias in node.names:
                        try:
                            resolve(f"{node.module}.{alias.name}")
                        except ModuleNotFoundError as exc:
                            if exc.name not in OPTIONAL_ONLY:  # (checked where it is installed)
                                bad.append(f"from {node.module} import {alias.name}: {exc}")
                        except (ImportError, AttributeError) as exc:
                            bad.append(f"from {node.module} import {alias.name}: {exc}")
    assert not bad, bad


def test_every_public_name_is_documented():
    text = docs_text()
    missing = [name for name in sequester.__all__ if f"`sequester.{name}`" not in text]
    assert not missing, f"public names not in docs/ (as `sequester.NAME`): {missing}"


# -- the map of the source tree -----------------------------------------------------------


def package_entries(folder: Path) -> set[str]:
    """What a package holds: its modules (``pool``), subpackages (``nsexec/``) and other
    source files (``stage0.c``)."""
    found = set()
    for entry in folder.iterdir():
        if entry.name.startswith(".") or entry.name == "__pycache__":
            continue
        if entry.is_dir() and (entry / "__init__.py").exists():
            found.add(entry.name + "/")
        elif entry.suffix == ".py" and entry.stem != "__init__":  # the package's own section
            found.add(entry.stem)
        elif entry.suffix in (".c", ".h", ".toml"):
            found.add(entry.name)
    return found


def mapped_packages() -> dict[str, set[str]]:
    """architecture.md's sections (``## `sequester.kernel```) and the names their tables list."""
    found = {}
    for section in re.split(r"^#{2,3} ", without_code_blocks(page("architecture.md")), flags=re.M)[1:]:
        title = re.fullmatch(r"`(sequester(?:\.\w+)*)`", section.splitlines()[0].strip())
        if title:
            found[title.group(1)] = set(re.findall(r"^\| `([^`]+)` \|", section, flags=re.M)) - {"__init__"}
    return found


def test_every_package_and_module_is_on_the_map():
    mapped = mapped_packages()
    packages = {
        ".".join(("sequester", *p.parent.relative_to(SOURCE).parts)): p.parent
        for p in SOURCE.rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert set(mapped) == set(packages), "docs/architecture.md: one section per package"
    for name, folder in packages.items():
        names = package_entries(folder)
        missing, stale = sorted(names - mapped[name]), sorted(mapped[name] - names)
        assert not missing and not stale, f"docs/architecture.md, {name}: missing {missing}, no such module {stale}"
