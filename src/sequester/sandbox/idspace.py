"""Work on the host's files as an episode's root: a short-lived process in a user namespace
of its own that maps the episode's ids (:mod:`.idmap`), where it holds every capability
over files those ids own.

An ordinary caller's episodes leave files owned by its subordinate ids (``apt``'s ``_apt``,
a ``useradd``-ed user): on the host the caller may not remove a folder of theirs, nor give
an unpacked layer's files their owners. Root does both directly; an ordinary caller runs
the same code here (``remove_tree``, a layer's unpack), and the kernel's map does the rest.
The worker imports sequester from this process's own installation and nothing else of
the caller's environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sequester.errors import SandboxError
from sequester.sandbox.idmap import IdMap, write_id_map

__all__ = ["run_in_id_space", "remove_mapped_tree"]

_RESULT_LIMIT = 1 << 20  # bytes of a call's JSON result

# The worker: its own user namespace, told when its map is written, then the call.
_BOOT = r"""
import importlib, json, os, sys
ready, go = int(sys.argv[1]), int(sys.argv[2])
root, module, function, args = sys.argv[3], sys.argv[4], sys.argv[5], json.loads(sys.argv[6])
if hasattr(os, "unshare"):  # Python 3.12
    os.unshare(os.CLONE_NEWUSER)
else:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x10000000) != 0:
        err = ctypes.get_errno()
        raise OSError(err, "unshare(CLONE_NEWUSER): " + os.strerror(err))
os.write(ready, b"u")
os.close(ready)
if os.read(go, 1) != b"g":
    sys.exit(70)
os.close(go)
sys.path.insert(0, root)
result = getattr(importlib.import_module(module), function)(*args)
sys.stdout.write(json.dumps(result))
"""

_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent.parent)


def run_in_id_space(ids: IdMap, module: str, function: str, *args: object, timeout: float = 600) -> object:
    """``module.function(*args)`` (arguments and result JSON-able) in a process that is root
    of a user namespace mapping ``ids``; returns its result. Raises :class:`SandboxError`
    with its error when it fails."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    argv = [
        sys.executable,
        "-I",
        "-c",
        _BOOT,
        str(ready_w),
        str(go_r),
        _PACKAGE_ROOT,
        module,
        function,
        json.dumps(list(args)),
    ]
    try:
        proc = subprocess.Popen(
            argv,
            pass_fds=(ready_w, go_r),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        )
    finally:
        os.close(ready_w)
        os.close(go_r)
    mapping_error = ""
    try:
        if os.read(ready_r, 1) == b"u":
            try:
                write_id_map(proc.pid, ids)
                os.write(go_w, b"g")
            except (OSError, SandboxError) as e:
                mapping_error = str(e)  # the worker ends at the closed pipe
        os.close(go_w)
        go_w = -1
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise SandboxError(f"{module}.{function} in the episodes' ids ran over {timeout:g} s") from None
    finally:
        os.close(ready_r)
        if go_w >= 0:
            os.close(go_w)
    if mapping_error:
        raise SandboxError(f"{module}.{function} in the episodes' ids: {mapping_error}")
    if proc.returncode != 0:
        said = err.decode(errors="replace").strip().splitlines()
        raise SandboxError(f"{module}.{function} in the episodes' ids failed: {said[-1] if said else proc.returncode}")
    if len(out) > _RESULT_LIMIT:
        raise SandboxError(f"{module}.{function} in the episodes' ids: its result is over {_RESULT_LIMIT} bytes")
    try:
        return json.loads(out) if out else None
    except ValueError:
        raise SandboxError(f"{module}.{function} in the episodes' ids: its result is not JSON") from None


def remove_mapped_tree(path: Path) -> None:
    """:func:`~sequester.sandbox.remove.remove_tree`, and what an ordinary caller could not
    remove (a folder an episode gave one of its subordinate ids, a layer's ``_apt`` folder)
    again as root of a namespace that maps them."""
    from sequester.sandbox.idmap import configured_id_map
    from sequester.sandbox.remove import RemovalError, remove_tree

    try:
        remove_tree(path)
        return
    except RemovalError as first:
        ids = configured_id_map(None) if os.getuid() != 0 else None
        if ids is None or not os.path.lexists(path):
            raise
        failed = first
    try:
        run_in_id_space(ids, "sequester.sandbox.remove", "remove_tree", str(path))
    except SandboxError as exc:
        raise RemovalError(path, [*failed.left, f"as the episode's root: {exc}"], failed.count + 1) from None
