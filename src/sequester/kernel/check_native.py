"""``sequester check``'s proof that ctypes cannot be loaded, even with the audit hook off.

The audit hook refuses ``import ctypes``, but it is a tripwire: a cell can take the
hook's frame from the traceback of a refusal, blank the closure cell it checks against
and swap its ``__code__`` (:data:`DISABLE_HOOK` does exactly that). What must hold then
is that there is nothing to load: the view covers every ``_ctypes`` library, no copy of
one can be mapped executable from the writable mounts, no memfd can stand in for a file,
and no ctypes type survives in memory from the kernel's first stage.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from sequester.kernel.client import Kernel
from sequester.policy import Isolation

__all__ = ["DISABLE_HOOK", "NATIVE_PROBE", "ctypes_unloadable", "sample_library"]

# Switches the kernel's audit hook off from Python. Leaves
# ``hook_off`` = "disabled" or the reason it could not.
DISABLE_HOOK = r"""
def _disable_hook():
    try:
        import ctypes  # refused: the traceback holds the hook's frame
        return "ctypes imported with the hook on"
    except ImportError as exc:
        if "blocked by the sandbox policy" not in str(exc):
            return "disabled"  # no hook refused it: already off
        tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_name != "hook":
        tb = tb.tb_next
    if tb is None:
        return "no hook frame in the traceback"
    hook = tb.tb_frame.f_locals["hook"]
    free = hook.__code__.co_freevars
    cells = dict(zip(free, hook.__closure__))
    if "hook" in cells:
        cells["hook"].cell_contents = None  # its self-protection compares against this cell
    n = len(free)
    src = ("def outer():\n" + "".join(f"    v{i} = None\n" for i in range(n)) +
           "    def noop(event, args):\n        return (" + "".join(f"v{i}, " for i in range(n)) + ")\n    return noop\n")
    scope = {}
    exec(src, scope)
    hook.__code__ = scope["outer"]().__code__
    return "disabled"
hook_off = _disable_hook()
"""

# Then tries every way back to native code. ``LIBRARIES`` (host paths of _ctypes and
# friends) and ``SAMPLE`` (a harmless extension library of the view) are set before.
NATIVE_PROBE = (
    DISABLE_HOOK
    + r"""
import json, mmap, os, shutil
out = {"hook_off": hook_off}
try:
    import ctypes
    out["import ctypes"] = "LOADED " + repr(ctypes.CDLL(None))
except BaseException as exc:
    out["import ctypes"] = type(exc).__name__ + ": " + str(exc)[:120]
import _imp, importlib.machinery
for path in LIBRARIES:
    try:
        _imp.create_dynamic(importlib.machinery.ModuleSpec("_ctypes", None, origin=path))
        out[path] = "LOADED"
    except BaseException as exc:
        out[path] = type(exc).__name__ + ": " + str(exc)[:120]
for folder in (os.getcwd(), "/dev/shm"):
    copy = os.path.join(folder, "copied.so")
    try:
        shutil.copyfile(SAMPLE, copy)
        with open(copy, "rb") as f:
            mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ | mmap.PROT_EXEC).close()
        out["exec map in " + folder] = "MAPPED"
    except OSError as exc:
        out["exec map in " + folder] = type(exc).__name__ + ": " + (exc.strerror or str(exc))
try:
    os.close(os.memfd_create("x"))
    out["memfd_create"] = "CREATED"
except OSError as exc:
    out["memfd_create"] = exc.strerror
out["ctypes types in memory"] = sorted({c.__name__ for c in object.__subclasses__() if "ctypes" in c.__module__})
print(json.dumps(out))
"""
)


def sample_library() -> str:
    """A harmless extension library of this interpreter (what the probe copies to the
    workspace): the first of ``lib-dynload`` that is not an FFI one."""
    import glob
    import sys

    from sequester.sandbox.native import is_ffi_library

    for folder in sys.path:
        if folder.endswith("lib-dynload"):
            for path in sorted(glob.glob(folder + "/*.so")):
                if not is_ffi_library(Path(path).name):
                    return str(Path(path).resolve())
    raise FileNotFoundError("no extension library in lib-dynload")


def ctypes_unloadable(kernel: Kernel, libraries: Iterable[Path]) -> tuple[bool, str]:
    """The check row's result and evidence. Disables the kernel's audit hook: run it last on a kernel."""
    paths = sorted({str(p) for p in libraries if p.name.startswith("_ctypes.")})
    code = f"LIBRARIES = {paths!r}\nSAMPLE = {sample_library()!r}\n" + NATIVE_PROBE
    result = kernel.run(code, timeout=30)
    if result.error is not None:
        return False, str(result.error)
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    loaded = [k for k, v in seen.items() if isinstance(v, str) and v.startswith(("LOADED", "MAPPED", "CREATED"))]
    if seen["ctypes types in memory"]:
        loaded.append("ctypes types in memory")
    # The attack must have worked for the row to prove anything: no refusal by the hook.
    hook_off = seen["hook_off"] == "disabled" and "blocked by the sandbox policy" not in seen["import ctypes"]
    ok = hook_off and not loaded and bool(paths)
    if not hook_off:
        evidence = f"the probe could not switch the hook off ({seen['hook_off']}; {seen['import ctypes']})"
    elif loaded:
        evidence = "loadable: " + "; ".join(f"{k}: {seen[k]}" for k in loaded)
    else:
        evidence = (
            f"with the audit hook {seen['hook_off']}: import ctypes: {seen['import ctypes']}; dlopen of "
            f"{len(paths)} _ctypes path(s) refused (e.g. {seen[paths[0]] if paths else 'none found'}); "
            f"a library copied to the workspace and /dev/shm cannot be mapped executable; "
            f"memfd_create: {seen['memfd_create']}"
        )
    if kernel.mode is Isolation.GUARD:
        evidence += (
            " (guard only: Landlock withholds _ctypes, but it has no right for executable mappings, so a "
            "library written to the workspace can be loaded)"
        )
    return ok, evidence
