"""The floor plan holds: no package of sequester imports, at module level, a package that
imports it back (directly or through others), and no module imports another package's
private names. Imports inside functions (lazy: optional dependencies, the kernel's start
path) and under ``if TYPE_CHECKING:`` are left out, as are the kept old import paths
(modules that only re-export lazily through ``__getattr__``)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import sequester

ROOT = Path(sequester.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports run when the module is imported: its body, and inside module-level
    ``if``/``try`` blocks, except ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    walk(node.body)
                walk(node.orelse)
            elif isinstance(node, ast.Try):
                walk(node.body)
                for handler in node.handlers:
                    walk(handler.body)
                walk(node.orelse)
                walk(node.finalbody)

    walk(tree.body)
    return found


def _imported(node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> list[tuple[str, str | None]]:
    """``(module, name)`` pairs: the sequester module each import loads, and the name it
    takes from it (None for ``import x`` or a submodule)."""
    out = []
    if isinstance(node, ast.Import):
        return [(a.name, None) for a in node.names if a.name.startswith("sequester")]
    assert node.level == 0, "relative imports are banned (ruff TID252)"
    if not (node.module or "").startswith("sequester"):
        return []
    for alias in node.names:
        full = f"{node.module}.{alias.name}"
        out.append((full, None) if full in modules else (node.module, alias.name))
    return out


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "sequester"


def _graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], list[str]], list[str]]:
    modules = _modules()
    edges: dict[str, set[str]] = defaultdict(set)
    why: dict[tuple[str, str], list[str]] = defaultdict(list)
    private: list[str] = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        for node in _top_level_imports(tree):
            for target, taken in _imported(node, modules):
                if taken is not None and taken.startswith("_") and not taken.startswith("__"):
                    if _package(target) != _package(name):
                        private.append(f"{name} imports {target}.{taken}")
                here, there = _package(name), _package(target)
                if here != there and there != "sequester":
                    edges[here].add(there)
                    why[(here, there)].append(f"{name} -> {target}")
    return edges, why, private


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one package (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_package_cycle_at_module_level():
    edges, why, _ = _graph()
    cycles = _cycles(edges)
    detail = [f"{cycle}: " + "; ".join(why[(a, b)][0] for a in cycle for b in cycle if why.get((a, b))) for cycle in cycles]
    assert not cycles, "package cycles at module level:\n" + "\n".join(detail)


def test_no_module_takes_another_packages_private_names():
    _, _, private = _graph()
    assert not private, "\n".join(private)


def test_the_scan_sees_a_cycle_when_there_is_one():
    """The scan itself: a cycle made by hand is found (so a passing scan means something)."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_scan_reads_real_imports():
    """The graph has the layers' real edges (a scan that read nothing would pass)."""
    edges, _, _ = _graph()
    assert "sandbox" in edges["kernel"] and "sandbox" in edges["environments"] and "errors" in edges["tasks"]
    assert "environments" not in edges.get("sandbox", set()) and "kernel" not in edges.get("sandbox", set())
