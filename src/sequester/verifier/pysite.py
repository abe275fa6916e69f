"""The runner's Pythons import from their own files first, whatever the view holds.

``site`` is frozen into the interpreter (3.11+), so its code cannot be changed on disk;
what it runs from disk is ``sitecustomize``, found on ``sys.path`` as it stands while
``site`` runs: the Python's standard library and the running environment's
site-packages only. The runner's environment never holds ``PYTHONPATH`` (a task's
``PYTHONPATH=/app`` would put the agent's folder ahead of the standard library at that
moment); it passes it as ``SEQUESTER_PYTHONPATH`` instead, and the tree's
``sitecustomize`` (written here into each Python's standard library):

* puts a finder first on ``sys.meta_path`` that looks for every top-level module on the
  ``sys.path`` entries of the tree, of the running environment (the uv tool environment
  pytest runs in) and of ``/tests`` before all others: the working folder (``python -m``
  adds ``/app``, after ``site`` ran) and the task's ``PYTHONPATH`` stay importable for
  the tests, but a module the agent planted there cannot shadow the standard library,
  pytest or its plugins;
* appends the task's ``PYTHONPATH`` entries to ``sys.path`` and passes them on under
  ``SEQUESTER_PYTHONPATH`` only: a runner Python the tests start (through the shims or as
  ``sys.executable``) appends them the same way; a program that is not one does not get
  them (red team: given back as ``PYTHONPATH``, they put the agent's
  ``/app/sitecustomize.py`` ahead of the runner's in a runner Python started directly);
* appends the image's site folders when the runner's ``python3``, ``pip`` or ``pytest``
  started it (``SEQUESTER_IMAGE_SITE``, see :mod:`.image_python`): the image's numpy is
  found, after everything of the runner's, with the folders their ``.pth`` files name
  (a ``.pth`` line that imports, code to run at start-up, is never run: it is told to
  the host and named in the trial's notes);
* lets only the distributions of the tree and the running environment offer ``pytest11``
  entry points, in every runner Python however pytest is started (a ``*.dist-info`` with
  one in ``/app`` or the image's site folders would load the agent's plugin); their other
  entry points stay;
* answers every lookup over all of ``sys.path`` itself (``PathFinder.find_spec(name)``,
  as pytest's assertion-rewriting finder makes): trusted folders first there too;
* lets a name the runner's own code tries (numpy for pytest's ``approx``) come from the
  image's site folders only when the code asking is not the runner's.

No user site: the runner's virtual environments disable it, and the ``python3`` in the
tree's ``bin/`` runs with ``-s`` (its ``.pth`` files, the agent's to write, would run
before ``sitecustomize``).
"""

from __future__ import annotations

import ast
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from sequester.verifier.layout import LIB, RUNNER_MOUNT, SCRATCH, TASK_LIBS

__all__ = [
    "SITECUSTOMIZE",
    "write_sitecustomize",
    "probed_names",
    "UV_PROBED",
    "runner_sources",
    "PYTHONPATH_VAR",
    "RUNNER_FD_VAR",
    "SITE_VAR",
    "LD_SAVED_VAR",
]

PYTHONPATH_VAR = "SEQUESTER_PYTHONPATH"
# The image's site folders (sequester.verifier.image_python), set by the runner's python3,
# pip and pytest shims only: appended last, and not passed on to the programs it starts.
SITE_VAR = "SEQUESTER_IMAGE_SITE"
RUNNER_FD_VAR = "SEQUESTER_RUNNER_FD"  # the pipe on which the runner says how far it got
# The LD_LIBRARY_PATH the runner's shims found ("=" and its value), which they took out
# for the runner's own programs (see shims.py): the programs this Python starts get it
# back, as in the task's container.
LD_SAVED_VAR = "SEQUESTER_LD_SAVED"

SITECUSTOMIZE = f'''"""sequester verifier runner: import from the runner's own files first (see
sequester/verifier/pysite.py)."""

import os
import sys


def _seal():
    # Attack: a program the tests run (the agent's) attaching with ptrace to the runner's
    # Python that started it (pytest, or the python3 running a test file), or opening its
    # /proc/PID/mem, and changing the outcome. Not dumpable from here on: no process
    # without CAP_SYS_PTRACE (the tests' programs have none) may attach or open its memory.
    # One traced already (a program that raced this start) is refused.
    try:
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
        with open("/proc/self/status") as status:
            traced = any(line.split()[1:2] != ["0"] for line in status if line.startswith("TracerPid:"))
    except (ImportError, OSError):
        return
    if traced:
        os.write(2, b"sequester: a program traced the verifier's Python from its start: refused\\n")
        os._exit(125)


_seal()
del _seal
import _imp
from importlib.machinery import PathFinder as _PathFinder

# What this Python tells the host, on a pipe the programs it starts never get (see
# RUNNER_FD_VAR): "pytest" (the tests' pytest started), "runner-lacks:NAME" (an import of
# a module the runner must provide and does not), "agent-import:PATH" (the tests imported
# a module from the agent's folders).
_said = os.environ.get({RUNNER_FD_VAR!r}, "")
_said = int(_said) if _said.isdigit() else None
if _said is not None:
    try:
        os.set_inheritable(_said, False)
    except OSError:
        _said = None


def _say(word):
    if _said is not None:
        try:
            line = "".join("?" if c.isspace() else c for c in word)[:300] + "\\n"
            os.write(_said, line.encode("utf-8", "backslashreplace"))
        except Exception:  # (a name the agent chose, not UTF-8: never an end of this start-up)
            pass


class _TrustedFirst:
    trusted = ({str(RUNNER_MOUNT)!r}, sys.prefix, sys.base_prefix, sys.exec_prefix, "/tests")
    # Names that only ever come from the runner: the standard library's and the test tools'.
    # One the runner lacks is an ImportError, never a module of that name in the working
    # folder, the view or PYTHONPATH.
    # (Not "test", CPython's own test suite, which runners leave out and no tool imports.)
    tools = frozenset({{"pytest", "_pytest", "pluggy", "iniconfig", "py"}})
    # And every name the runner's own code imports in a try (an optional module: copy's
    # `from org.python.core import ...`, pytest's pygments): found by reading the runner's
    # standard library and wheels when the tree was built (see probed_names).
    probed = frozenset(__PROBED__)
    protected = (frozenset(sys.stdlib_module_names) - {{"test"}}) | tools | probed
    # The image's site folders, when the runner's python3 stands for the image's (see
    # SITE_VAR): a probed name the runner lacks (numpy, which pytest tries) comes from
    # there as the image's python3 would import it, never from the working folder or
    # PYTHONPATH; the standard library's and the tools' names never do.
    image_site = ()
    seen = set()

    @classmethod
    def _runner_asks(cls):
        # Attack (red team): pytest's approx tries `import numpy` on every comparison; an
        # agent's numpy in the image's site folder then ran inside the runner's pytest. A
        # name the runner's own code tries comes from the image only when the code asking
        # is not the runner's (the tests' own files, under /tests, are not the runner's).
        frame = sys._getframe(2)
        while frame is not None and (
            frame.f_code.co_filename.startswith("<frozen importlib")
            or "/importlib/" in frame.f_code.co_filename
            or frame.f_code.co_name == "importorskip"  # (pytest.importorskip: the test's own import)
        ):
            frame = frame.f_back
        where = frame.f_code.co_filename if frame is not None else ""
        return cls._ours(where) and not (where == "/tests" or where.startswith("/tests/"))

    @classmethod
    def _ours(cls, entry):
        path = os.path.abspath(entry) if isinstance(entry, str) and entry else ""
        return bool(path) and any(path == t or path.startswith(t.rstrip("/") + "/") for t in cls.trusted)

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if path is not None or name in sys.builtin_module_names or _imp.is_frozen(name):
            return None  # a submodule (its package's own __path__ decides), or the interpreter's own
        spec = _path_finder_find_spec(name, [p for p in sys.path if cls._ours(p)], target)
        if spec is not None:
            return spec
        if (
            name in cls.probed
            and name not in cls.tools
            and name not in sys.stdlib_module_names
            and cls.image_site
            and not cls._runner_asks()
        ):
            spec = _path_finder_find_spec(name, list(cls.image_site), target)
            if spec is not None:
                if name not in cls.seen:
                    cls.seen.add(name)
                    _say("agent-import:" + str(spec.origin or name))
                return spec
        if name in cls.protected:
            if name not in cls.seen and name in cls.tools:  # (the standard library's are often probed)
                cls.seen.add(name)
                _say("runner-lacks:" + name)
            if _path_finder_find_spec(name, list(sys.path), target) is None:
                return None  # nowhere: not found, as for any Python (importlib.util.find_spec gives None)
            raise ModuleNotFoundError(
                f"No module named {{name!r}} (the verifier's Python has none, and one of that name in "
                "the working folder, the view or PYTHONPATH is never imported in its place)",
                name=name,
            )
        spec = _path_finder_find_spec(name, list(sys.path), target)  # the tests' own: the agent's folders
        if spec is not None and name not in cls.seen:
            cls.seen.add(name)
            _say("agent-import:" + str(spec.origin or (list(spec.submodule_search_locations or []) or [name])[0]))
        return spec

    @classmethod
    def invalidate_caches(cls):
        pass


def _hide_untrusted_plugins(metadata):
    # pytest (through pluggy) loads every installed distribution's "pytest11" entry point as
    # a plugin, however it was started (python -m pytest, pytest.main() in a script): only
    # the tree's and the running environment's distributions offer any (an *.dist-info in
    # /app, on PYTHONPATH or in the image's site folders would plant one). Their other entry
    # points stay as they are (a library finding its backends).
    original = metadata.Distribution.entry_points

    def entry_points(self):
        points = original.fget(self)
        where = getattr(self, "_path", None)
        if where is not None and _TrustedFirst._ours(str(where)):
            return points
        return metadata.EntryPoints(p for p in points if p.group != "pytest11")

    metadata.Distribution.entry_points = property(entry_points)


class _Patched:
    """The loader of importlib.metadata, which applies _hide_untrusted_plugins once the
    module is made (it is imported only when something asks for it: no cost otherwise)."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _hide_untrusted_plugins(module)


class _SubmodulesOnly:
    """In place of the path finder on sys.meta_path: a top-level name is _TrustedFirst's
    to answer, finally (its None is not looked up again on sys.path, where an agent's
    module may have appeared since); submodules are found in their package's path."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if path is None:
            return None
        spec = _path_finder_find_spec(name, path, target)
        if name == "importlib.metadata" and spec is not None and spec.loader is not None:
            spec.loader = _Patched(spec.loader)
        return spec

    @classmethod
    def invalidate_caches(cls):
        _PathFinder.invalidate_caches()

    @classmethod
    def find_distributions(cls, *args, **kwargs):  # importlib.metadata asks the meta path's finders
        return _PathFinder.find_distributions(*args, **kwargs)


sys.meta_path[:] = [_TrustedFirst, *(_SubmodulesOnly if f is _PathFinder else f for f in sys.meta_path)]
# Attack (red team): pytest's assertion-rewriting finder, first on sys.meta_path, looks a
# module up with PathFinder.find_spec(name, None): all of sys.path, the working folder
# first (an agent's /app/ctrf in place of the runner's ctrf plugin). A lookup over all of
# sys.path is _TrustedFirst's; one over a package's own path is the path finder's.
_path_finder_find_spec = _PathFinder.find_spec


def _trusted_find_spec(cls, name, path=None, target=None):
    if path is None:
        return _TrustedFirst.find_spec(name, None, target)
    return _path_finder_find_spec(name, path, target)


# (A classmethod, as the path finder's own: a copy kept on another class, as pytest keeps
# one, stays bound to the path finder.)
_PathFinder.find_spec = classmethod(_trusted_find_spec)



# ctypes.util.find_library in the runner: the standard one runs the view's ldconfig (then
# gcc, ld, objdump from PATH) and takes the name it prints, slashes and all: an agent's
# ldconfig named /app/evil.so and the tests' CDLL loaded it into the runner (red team).
# Here it names only what the runner's own loaders can load, found in their folders (the
# tests' installed libraries, then the tree's), by file name, never running anything.
def _find_library(name):
    import re

    if not isinstance(name, str) or not name or "/" in name:
        return None
    wanted = re.compile(r"lib" + re.escape(name) + r"\\.so(\\.[0-9][0-9.]*)?$")
    for folder in ({str(TASK_LIBS)!r}, {str(LIB)!r}):
        try:
            names = [n for n in os.listdir(folder) if wanted.match(n)]
        except OSError:
            continue
        if names:  # the soname (libz.so.1) before a longer version, before the bare .so
            return min(names, key=lambda n: (n.endswith(".so"), len(n), n))
    return None


class _CtypesUtil:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != "ctypes.util":
            return None
        spec = _PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            module.find_library = _find_library

        spec.loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _CtypesUtil)

# A C extension that needs a system library the runner does not carry (opencv's libGL):
# the runner's loader has no system folders and says "/: cannot read file data" (see
# sequester.verifier.elf). The runner's shortfall, never the agent's 0: told to the host
# ("runner-lacks-library:NAME"), whose pristine re-run decides.
from importlib.machinery import ExtensionFileLoader as _ExtensionFileLoader

_create_extension = _ExtensionFileLoader.create_module


def _create_module(self, spec):
    try:
        return _create_extension(self, spec)
    except ImportError as exc:
        # A library none of the runner's folders has (its loader has no system folders of
        # the view's), one newer than the runner's C library, or a version a library of
        # the runner's own folders (the tests' installed ones) needs of another: the
        # runner's lack, not the agent's 0 (the pristine re-run settles a forged one).
        _msg = str(exc)
        if (
            "cannot read file data: Is a directory" in _msg
            or "version `GLIBC_" in _msg
            or ("version `" in _msg and "(required by {RUNNER_MOUNT}/" in _msg)
        ):
            _say("runner-lacks-library:" + str(spec.name))
        raise


_ExtensionFileLoader.create_module = _create_module
# No user site in the Pythons this one starts either (the shims give the runner's their
# -s): a runner Python the tests start as sys.executable ran the .pth import lines of the
# agent's ~/.local/lib/pythonX.Y/site-packages at start-up (red team round 2). (site is
# frozen into the interpreter: its ENABLE_USER_SITE cannot be changed on disk.)
os.environ["PYTHONNOUSERSITE"] = "1"
_ld = os.environ.pop({LD_SAVED_VAR!r}, None)
if _ld is not None:
    if _ld.startswith("="):
        os.environ["LD_LIBRARY_PATH"] = _ld[1:]
    else:
        os.environ.pop("LD_LIBRARY_PATH", None)
del _ld
_extra = os.environ.get({PYTHONPATH_VAR!r})
if _extra is not None:
    # After the runner's own folders; passed on under the same name, never as PYTHONPATH:
    # a runner Python the tests start directly (sys.executable: multiprocessing, xdist)
    # looks its sitecustomize up on PYTHONPATH's folders first (red team: the image's
    # PYTHONPATH=/app ran the agent's /app/sitecustomize.py in one). A program that is not
    # a runner Python does not get it.
    sys.path.extend(p for p in _extra.split(os.pathsep) if p and p not in sys.path)


def _image_site(folders):
    """The image's site folders and the folders their .pth files name, as the image's
    Python's site would add them; a .pth line that imports (code to run at start-up, the
    agent's to write) is not run, and told to the host. Bounded: 200 files of 64 kB, 1000
    folders."""
    found, seen, files = [], set(), 0
    for folder in folders:
        folder = os.path.abspath(folder)
        if folder in seen or not os.path.isdir(folder):
            continue
        seen.add(folder)
        found.append(folder)
        try:
            names = sorted(n for n in os.listdir(folder) if n.endswith(".pth") and not n.startswith("."))
        except OSError:
            continue
        for name in names:
            files += 1
            if files > 200:
                return found
            try:
                with open(os.path.join(folder, name), "rb") as f:
                    text = f.read(65536).decode("utf-8-sig", "replace")
            except OSError:
                continue
            for line in text.splitlines():
                line = line.rstrip()
                if not line or line.startswith("#"):
                    continue
                if line.startswith(("import ", "import\t")):
                    _say("pth-skipped:" + os.path.join(folder, name))
                    continue
                entry = os.path.abspath(os.path.join(folder, line))
                if entry not in seen and os.path.exists(entry):  # (a folder, or a zip or egg file)
                    seen.add(entry)
                    found.append(entry)
                    if len(found) >= 1000:
                        return found
    return found


_extra = os.environ.pop({SITE_VAR!r}, None)
if _extra:
    try:
        _TrustedFirst.image_site = tuple(_image_site(p for p in _extra.split(os.pathsep) if p.startswith("/")))
    except BaseException:  # noqa: BLE001 - what the agent wrote never ends this start-up
        _TrustedFirst.image_site = ()
        _say("image-site-unread")
    sys.path.extend(p for p in _TrustedFirst.image_site if p not in sys.path)
del _extra


def _runs_pytest(argv):
    # The interpreter's own options first (the runner's shims add -s; -W, -X take a value),
    # then `-m pytest` or a pytest script: a red team's `python3 -m pytest` went past a check
    # of argv[1:3] alone.
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "-m":
            return argv[i + 1 : i + 2] in (["pytest"], ["py.test"])
        if arg == "-c" or arg == "-" or not arg.startswith("-"):
            return arg != "-c" and os.path.basename(arg) in ("pytest", "py.test")
        i += 2 if arg in ("-W", "-X", "--check-hash-based-pycs") else 1
    return False


_argv = getattr(sys, "orig_argv", [])
_is_pytest = _runs_pytest(_argv)
del _runs_pytest
if _is_pytest:  # the tests' pytest started: its bootstrap worked
    _say("pytest")
del _argv, _is_pytest
# Native code from outside the runner's folders in this process: an LD_PRELOAD or LD_AUDIT
# it started with (the test script's own export, naming the agent's library: the loader
# honoured it before any of this ran), a library the tests' imports loaded from the system
# they check (a plugin folder of the view, a module named in the agent's HOME). The tests'
# own choice, as under Docker (docs/security.md, residual risks): told to the host, which
# names it in the trial's notes. Information only: code that ran in here can silence it.
for _var in ("LD_PRELOAD", "LD_AUDIT"):
    if os.environ.get(_var):
        _say("agent-preload:" + _var + "=" + os.environ[_var])
del _var


def _native_outside():
    trusted, scratch, seen = ({str(RUNNER_MOUNT)!r} + "/", "/tests/"), {str(SCRATCH)!r} + "/", []
    try:
        with open("/proc/self/maps", "rb") as maps:
            for n, line in enumerate(maps):
                fields = line.split(None, 5)
                if n > 65536 or len(seen) >= 16:
                    break
                if len(fields) < 6 or b"x" not in fields[1] or not fields[5].startswith(b"/"):
                    continue  # not executable, or not a file ([vdso], anonymous)
                path = fields[5].rstrip(b"\\n").decode("utf-8", "backslashreplace")
                if (not path.startswith(trusted) or path.startswith(scratch)) and path not in seen:
                    seen.append(path)
    except (OSError, ValueError):
        return
    for path in seen:
        _say("agent-native:" + path)


import atexit as _atexit

_atexit.register(_native_outside)
'''


def write_sitecustomize(stdlib: Path, probed: Iterable[str] = ()) -> None:
    """``probed``: the optional modules the runner's own code tries (:func:`probed_names`)."""
    target = stdlib / "sitecustomize.py"
    text = SITECUSTOMIZE.replace("__PROBED__", repr(sorted(set(probed))))
    # A sitecustomize that does not compile is only a warning to Python ("Error in
    # sitecustomize"), and the runner would run without every guard here: no tree then.
    compile(text, str(target), "exec")
    target.unlink(missing_ok=True)  # never write through whatever was there
    target.write_text(text)


_IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


# What uv's own interpreter query (get_interpreter_info.py, inside the uv binary: no source
# of the tree's to read) tries and does without: packaging's ``_manylinux`` (red team: an
# image whose ENV PYTHONPATH names /app had uv run the agent's /app/_manylinux.py).
UV_PROBED = frozenset({"_manylinux"})


def probed_names(sources: Iterable[tuple[str, bytes]]) -> set[str]:
    """The top-level modules that Python ``sources`` (name, text) import inside a ``try``
    whose handlers catch an ImportError (or a bare ``except``): the optional modules a
    program tries and does without. Pure; a source that does not parse is skipped."""
    found: set[str] = set()
    for name, text in sources:
        try:
            tree = ast.parse(text, filename=name)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Try):
                continue
            caught = set()
            for handler in node.handlers:
                if handler.type is None:
                    caught.add("BaseException")
                for part in handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]:
                    if isinstance(part, ast.Name):
                        caught.add(part.id)
                    elif isinstance(part, ast.Attribute):
                        caught.add(part.attr)
            if not caught & _IMPORT_ERRORS:
                continue
            for stmt in node.body:
                for sub in ast.walk(stmt):
                    if isinstance(sub, ast.Import):
                        found.update(alias.name.split(".")[0] for alias in sub.names)
                    elif isinstance(sub, ast.ImportFrom) and sub.level == 0 and sub.module:
                        found.add(sub.module.split(".")[0])
    return found


def runner_sources(stdlib: Path, wheels: Iterable[Path]) -> Iterator[tuple[str, bytes]]:
    """The Python files of a runner Python's standard library and of the runner's wheels."""
    for path in sorted(stdlib.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.relative_to(stdlib).parts[:1]:
            continue
        try:
            yield str(path), path.read_bytes()
        except OSError:
            continue
    for wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as archive:
                for member in archive.namelist():
                    if member.endswith(".py"):
                        yield f"{wheel.name}/{member}", archive.read(member)
        except (OSError, zipfile.BadZipFile):
            continue
