"""Which shared libraries a set of ELF files loads, asked of the host's own loader.

Run on the host while the runner's tree is built, never inside a view: the host's files
are the trusted source the tree is copied from. ``ldd`` (glibc's, part of every glibc
system) prints the whole transitive closure for each file.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sequester.errors import SandboxError

__all__ = ["Library", "parse_ldd", "library_closure"]

# "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or "/lib64/ld-linux-x86-64.so.2 (0x...)"
_LINE = re.compile(r"^\s*(?P<name>\S+)(?:\s+=>\s+(?P<path>\S+))?\s+\(0x[0-9a-f]+\)\s*$")


@dataclass(frozen=True)
class Library:
    name: str  # the name programs ask for (DT_NEEDED), e.g. libtinfo.so.6
    path: Path  # where the host resolved it


def parse_ldd(text: str) -> tuple[list[Library], Path | None, list[str]]:
    """(libraries, the loader, names that were not found) from ``ldd`` output."""
    libs: list[Library] = []
    loader: Path | None = None
    missing: list[str] = []
    for line in text.splitlines():
        if "=> not found" in line:
            missing.append(line.split()[0])
            continue
        m = _LINE.match(line)
        if not m:
            continue
        name, path = m.group("name"), m.group("path")
        if path is None:
            if name.startswith("/") and "ld-" in Path(name).name:
                loader = Path(name)
            continue  # linux-vdso.so.1 and the like have no file
        libs.append(Library(name, Path(path)))
    return libs, loader, missing


def library_closure(files: Iterable[Path]) -> tuple[dict[str, Path], Path]:
    """Every library ``files`` load (name -> host path) and the loader they use."""
    found: dict[str, Path] = {}
    loader: Path | None = None
    for path in files:
        proc = subprocess.run(
            ["ldd", str(path)], capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"}
        )
        if proc.returncode != 0:
            if "not a dynamic executable" in proc.stdout + proc.stderr:
                continue  # static: loads nothing
            raise SandboxError(f"ldd {path} failed: {(proc.stderr or proc.stdout).strip()[:300]}")
        libs, its_loader, missing = parse_ldd(proc.stdout)
        if missing:
            raise SandboxError(f"{path} needs libraries this host lacks: {', '.join(missing)}")
        for lib in libs:
            found.setdefault(lib.name, lib.path)
        loader = loader or its_loader
    if loader is None:
        raise SandboxError("could not find the host's dynamic loader (is this a glibc system?)")
    return found, loader
