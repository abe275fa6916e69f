"""The Python installations the runner carries, found on the host and copied without
their site-packages.

Test scripts ask for a version (``uvx -p 3.13``, Terminal-Bench 2's standard) or just
``python3``. The runner offers the Python that runs sequester and, when the host has
one, Python 3.13; uv sees them as its *managed* installations and nothing else (see
:mod:`.environ`), so a version the runner lacks fails to bootstrap instead of
falling back to an interpreter of the agent's.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["HostPython", "find_pythons", "copy_python", "WANTED_VERSIONS"]

WANTED_VERSIONS = ("3.13",)  # besides the running one: TB2's test scripts ask for 3.13
# Not needed to run tests, and large; never site-packages: the runner's Pythons hold
# nothing but their standard library (test dependencies come from pinned wheels).
_SKIP = {
    "site-packages",
    "dist-packages",
    "test",
    "idlelib",
    "tkinter",
    "turtledemo",
    "ensurepip",
    "lib2to3",
    "__phello__",
}


@dataclass(frozen=True)
class HostPython:
    version: str  # "3.13.0"
    executable: Path  # the real binary (symlinks resolved)
    stdlib: Path  # the folder holding os.py
    libdir: Path  # where libpythonX.Y.so lives (may not hold one: static builds)

    @property
    def short(self) -> str:
        return ".".join(self.version.split(".")[:2])

    @property
    def dir_name(self) -> str:
        """The folder name uv recognises as a managed installation."""
        arch = platform.machine().replace("amd64", "x86_64")
        return f"cpython-{self.version}-linux-{arch}-gnu"


_QUERY = (
    "import json, sys, sysconfig; print(json.dumps([sys.version.split()[0], sys.executable, "
    "sysconfig.get_path('stdlib'), sysconfig.get_config_var('LIBDIR') or '']))"
)


def _describe(executable: str) -> HostPython | None:
    try:
        proc = subprocess.run([executable, "-I", "-S", "-c", _QUERY], capture_output=True, text=True, timeout=30)
        version, exe, stdlib, libdir = json.loads(proc.stdout)
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0 or not Path(stdlib, "os.py").exists():
        return None
    return HostPython(version, Path(exe).resolve(), Path(stdlib), Path(libdir or Path(stdlib).parent))


def _candidates(short: str) -> list[str]:
    found = []
    for folder in ("/usr/local/bin", "/usr/bin"):
        found.append(f"{folder}/python{short}")
    for root in (os.environ.get("PYENV_ROOT"), Path.home() / ".pyenv", "/root/.pyenv", "/opt/pyenv"):
        try:  # another user's folders may not even be searchable: then they are not ours to use
            versions = sorted(Path(root, "versions").iterdir(), reverse=True) if root else []
        except OSError:
            continue
        found += [str(v / "bin" / f"python{short}") for v in versions if v.name.startswith(short + ".")]
    try:
        uv_dir = Path.home() / ".local" / "share" / "uv" / "python"
        found += [str(p / "bin" / f"python{short}") for p in sorted(uv_dir.glob(f"cpython-{short}.*"), reverse=True)]
    except OSError:
        pass
    return [p for p in found if os.access(p, os.X_OK)]


def find_pythons() -> list[HostPython]:
    """The running Python (its base installation) first, then one of each wanted version."""
    own = _describe(getattr(sys, "_base_executable", sys.executable)) or _describe(sys.executable)
    out = [own] if own else []
    for short in WANTED_VERSIONS:
        if any(p.short == short for p in out):
            continue
        for candidate in _candidates(short):
            found = _describe(candidate)
            if found and found.short == short:
                out.append(found)
                break
    return out


def _libpythons(py: HostPython) -> list[Path]:
    """The shared libpython files of ``py``: in its configured LIBDIR, or (a relocated
    build, whose LIBDIR names where it was built) next to its standard library."""
    for folder in dict.fromkeys((py.libdir, py.stdlib.parent)):
        try:
            found = sorted(p for p in folder.glob(f"libpython{py.short}*.so*") if p.is_file())
        except OSError:  # not ours to read (another user's build folder)
            continue
        if found:
            return found
    return []


def copy_python(py: HostPython, dest: Path) -> list[Path]:
    """Copy ``py`` to ``dest`` as ``bin/pythonX.Y``, ``lib/pythonX.Y/`` (no site-packages:
    an empty one), and its ``libpython``; returns the ELF files copied (to be patched)."""
    (dest / "bin").mkdir(parents=True)
    (dest / "lib").mkdir()
    binary = dest / "bin" / f"python{py.short}"
    shutil.copy2(py.executable, binary)
    for alias in ("python3", "python"):
        os.symlink(binary.name, dest / "bin" / alias)
    elves = [binary]
    stdlib = dest / "lib" / f"python{py.short}"
    # Links are copied as what they point to: a link of the host's standard library (Debian's
    # sitecustomize.py -> /etc/python3.11/...) would point into the agent's view.
    shutil.copytree(
        py.stdlib,
        stdlib,
        symlinks=False,
        ignore_dangling_symlinks=True,
        ignore=lambda d, names: [n for n in names if n in _SKIP],
    )
    (stdlib / "site-packages").mkdir()
    for so in _libpythons(py):
        shutil.copy2(so, dest / "lib" / so.name, follow_symlinks=True)
        elves.append(dest / "lib" / so.name)
    for so in sorted(stdlib.rglob("*.so")):
        if so.name.startswith("_tkinter"):  # a GUI: X11 and Tk, never used by tests
            so.unlink()
        elif so.is_file() and not so.is_symlink():
            elves.append(so)
    return elves
