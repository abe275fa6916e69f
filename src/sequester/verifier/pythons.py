"""The Python installations the runner carries, found on the host and copied without
their site-packages.

Test scripts ask for a version (``uvx -p 3.13``, Terminal-Bench 2's standard) or just
``python3``. The runner offers the version of the Python that runs sequester, 3.11 and 3.13;
uv sees them as its *managed* installations and nothing else (see :mod:`.environ`), so a
version the runner lacks fails to bootstrap instead of falling back to an interpreter of
the agent's. Each version is Debian's optimised build where Debian has one
(:mod:`.debian_python`: bookworm's 3.11, trixie's 3.13), else a host build: the one
running sequester for its own version, for 3.13 only an optimised one
(:func:`optimised`), never a slow stand-in.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "HostPython",
    "find_pythons",
    "copy_python",
    "host_builds",
    "optimised",
    "runner_versions",
    "WANTED_VERSIONS",
]

# Besides the running one: TB2's test scripts ask for 3.13, others for 3.11; both are
# Debian's optimised builds, so a script's version does not depend on which Python runs
# sequester (Harbor's own needs 3.12: before, `uvx -p 3.11` failed to bootstrap there).
WANTED_VERSIONS = ("3.11", "3.13")
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
    sysroot: Path | None = None  # Debian's packages unpacked: its loader and libraries go with it
    optimised: bool = False  # built with profile-guided or link-time optimisation

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
    "sysconfig.get_path('stdlib'), sysconfig.get_config_var('LIBDIR') or '', "
    "' '.join(str(sysconfig.get_config_var(v) or '') for v in ('CONFIG_ARGS', 'PY_CFLAGS', 'PY_LDFLAGS_NODIST', "
    "'PGO_PROF_USE_FLAG'))]))"
)


def optimised(build_flags: str) -> bool:
    """Whether a CPython's configure arguments and compiler flags say profile-guided or
    link-time optimisation (``--enable-optimizations``, ``--with-lto``, ``-flto``,
    ``-fprofile-use``): Debian's, python-build-standalone's and the Docker images' builds
    are; pyenv's default is not."""
    return any(flag in build_flags for flag in ("--enable-optimizations", "--with-lto", "-flto", "-fprofile-use"))


def _describe(executable: str, *, via: list[str] | None = None, sysroot: Path | None = None) -> HostPython | None:
    """``executable`` asked about itself (``via``: the loader command to start it with)."""
    try:
        proc = subprocess.run(
            [*(via or []), executable, "-I", "-S", "-c", _QUERY], capture_output=True, text=True, timeout=30
        )
        version, exe, stdlib, libdir, flags = json.loads(proc.stdout)
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0 or not Path(stdlib, "os.py").exists():
        return None
    if sysroot is not None:
        libdir = str(sysroot / "usr" / "lib" / _triplet())
    return HostPython(
        version,
        Path(exe).resolve(),
        Path(stdlib),
        Path(libdir or Path(stdlib).parent),
        sysroot=sysroot,
        optimised=optimised(flags),
    )


def _triplet() -> str:
    return f"{platform.machine().replace('amd64', 'x86_64')}-linux-gnu"


def _debian(folder: Path, short: str) -> HostPython | None:
    """Debian's ``python{short}`` (:mod:`.debian_python`), started with its own loader."""
    from sequester.verifier.debian_python import ensure_debian_python

    root = ensure_debian_python(folder, short)
    if root is None:
        return None
    libs = [root / "usr" / "lib" / _triplet(), root / "lib" / _triplet()]  # (a release before merged /usr: both)
    loaders = sorted(p for folder in libs for p in folder.glob("ld-linux*.so.*"))
    if not loaders:
        return None
    found = _describe(
        str(root / "usr" / "bin" / f"python{short}"),
        via=[str(loaders[0]), "--library-path", ":".join(map(str, libs))],
        sysroot=root,
    )
    if found is None or found.short != short:
        return None
    # (Debian builds with profile-guided and link-time optimisation through its own make
    # targets, which its sysconfig does not record: measured 25-40 % faster than pyenv's
    # default build on a loop benchmark, benchmarks/verifier_python_bench.py)
    return dataclasses.replace(found, optimised=True)


def host_builds(short: str) -> list[str]:
    """The host's ``python{short}`` programs, in the order they are tried."""
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


def runner_versions() -> tuple[str, ...]:
    """``X.Y`` of each Python the runner means to offer (the running one's first)."""
    return tuple(dict.fromkeys([".".join(map(str, sys.version_info[:2])), *WANTED_VERSIONS]))


def find_pythons(debian: Path | None = None) -> list[HostPython]:
    """One Python of each of :func:`runner_versions`, the running one's version first:
    Debian's build (downloaded into ``debian``, when given) where it can be had; else
    the running Python (its base installation) for its own version, and for the others
    an optimised host build only."""
    own = _describe(getattr(sys, "_base_executable", sys.executable)) or _describe(sys.executable)
    out: list[HostPython] = []
    for short in runner_versions():
        found = _debian(debian, short) if debian is not None else None
        if found is None and own is not None and own.short == short:
            found = own
        if found is None:
            for candidate in host_builds(short):
                host = _describe(candidate)
                if host and host.short == short and host.optimised:
                    found = host
                    break
        if found is not None:
            out.append(found)
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
