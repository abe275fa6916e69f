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
* appends the task's ``PYTHONPATH`` entries to ``sys.path`` and puts ``PYTHONPATH`` back
  in the environment, so the programs the tests start get it as the task wrote it;
* in pytest, lets only the distributions of the tree and the running environment count
  for plugin autoloading (a ``*.dist-info`` with a ``pytest11`` entry point in ``/app``
  would otherwise load the agent's plugin into the verifier's pytest).

No user site: the runner's virtual environments disable it, and the ``python3`` in the
tree's ``bin/`` runs with ``-s`` (its ``.pth`` files, the agent's to write, would run
before ``sitecustomize``).
"""

from __future__ import annotations

from pathlib import Path

from sequester.verifier.layout import RUNNER_MOUNT

__all__ = ["SITECUSTOMIZE", "write_sitecustomize", "PYTHONPATH_VAR", "RUNNER_FD_VAR"]

PYTHONPATH_VAR = "SEQUESTER_PYTHONPATH"
RUNNER_FD_VAR = "SEQUESTER_RUNNER_FD"  # the pipe on which the runner says how far it got

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
            os.write(_said, ("".join("?" if c.isspace() else c for c in word)[:300] + "\\n").encode())
        except OSError:
            pass


class _TrustedFirst:
    trusted = ({str(RUNNER_MOUNT)!r}, sys.prefix, sys.base_prefix, sys.exec_prefix, "/tests")
    # Names that only ever come from the runner: the standard library's and the test tools'.
    # One the runner lacks is an ImportError, never a module of that name in the working
    # folder, the view or PYTHONPATH.
    # (Not "test", CPython's own test suite, which runners leave out and no tool imports.)
    tools = frozenset({{"pytest", "_pytest", "pluggy", "iniconfig", "py"}})
    protected = (frozenset(sys.stdlib_module_names) - {{"test"}}) | tools
    seen = set()

    @classmethod
    def _ours(cls, entry):
        path = os.path.abspath(entry) if isinstance(entry, str) and entry else ""
        return bool(path) and any(path == t or path.startswith(t.rstrip("/") + "/") for t in cls.trusted)

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if path is not None or name in sys.builtin_module_names or _imp.is_frozen(name):
            return None  # a submodule (its package's own __path__ decides), or the interpreter's own
        spec = _PathFinder.find_spec(name, [p for p in sys.path if cls._ours(p)], target)
        if spec is not None:
            return spec
        if name in cls.protected:
            if name not in cls.seen and name in cls.tools:  # (the standard library's are often probed)
                cls.seen.add(name)
                _say("runner-lacks:" + name)
            raise ModuleNotFoundError(
                f"No module named {{name!r}} (the verifier's Python has none, and one of that name in "
                "the working folder, the view or PYTHONPATH is never imported in its place)",
                name=name,
            )
        spec = _PathFinder.find_spec(name, sys.path, target)  # the tests' own: the agent's folders
        if spec is not None and name not in cls.seen:
            cls.seen.add(name)
            _say("agent-import:" + str(spec.origin or (list(spec.submodule_search_locations or []) or [name])[0]))
        return spec

    @classmethod
    def invalidate_caches(cls):
        pass


sys.meta_path.insert(0, _TrustedFirst)
_extra = os.environ.pop({PYTHONPATH_VAR!r}, None)
if _extra is not None:
    sys.path.extend(p for p in _extra.split(os.pathsep) if p and p not in sys.path)
    os.environ["PYTHONPATH"] = _extra
del _extra
_argv = getattr(sys, "orig_argv", [])
_is_pytest = (len(_argv) > 1 and os.path.basename(_argv[1]) in ("pytest", "py.test")) or _argv[1:3] == ["-m", "pytest"]
if _is_pytest:
    # pytest loads every installed distribution's "pytest11" entry point as a plugin: only
    # those of the tree and the running environment count (an *.dist-info folder in /app,
    # on a task's PYTHONPATH or the working folder, would plant one).
    import importlib.metadata as _metadata

    def _trusted_distributions(_all=_metadata.distributions, **kwargs):
        for dist in _all(**kwargs):
            where = getattr(dist, "_path", None)
            if where is None or _TrustedFirst._ours(str(where)):
                yield dist

    _metadata.distributions = _trusted_distributions
if _is_pytest:  # the tests' pytest started: its bootstrap worked
    _say("pytest")
del _argv, _is_pytest
'''


def write_sitecustomize(stdlib: Path) -> None:
    target = stdlib / "sitecustomize.py"
    target.unlink(missing_ok=True)  # never write through whatever was there
    target.write_text(SITECUSTOMIZE)
