"""The kernel's first stage: confine this process, then become the cell runner.

Started by the host as ``python -I -S -B -c STAGE_ONE PACKAGE_ROOT IN_FD OUT_FD`` (inside
the sandbox, or on the host in guard-only mode): isolated (no ``PYTHON*`` variables, no
site, no user site) and with nothing imported but what confining needs, since this
stage is on every kernel's start-up path. It reads the bootstrap configuration from
``IN_FD`` (from the host, in :mod:`marshal`: no ``json``/``base64`` to import; nothing
the kernel sends is ever read with marshal), applies it in a fixed order, and ``execve``-s
``python -c STAGE_TWO PACKAGE_ROOT IN_FD OUT_FD STAGE2`` (see
:mod:`sequester.guard.handoff` for why a second image, and why that one ``execve`` is
the only one the filter lets through). If anything fails it tells the host on
``OUT_FD`` and exits: fail closed.

The order is the security argument:

1. ctypes: this stage needs it, and it is not in the view (the host passes the
   ``_ctypes`` library as an open file; in guard-only mode Landlock withholds it later);
2. (sandbox) the kernel's own mount and network namespaces: the workspace, ``/dev/shm``
   and nothing else writable, all ``noexec``; loopback up; every port bindable
   (:mod:`sequester.guard.namespaces`, planned on the host, applied by
   :mod:`sequester.guard.workspace`);
3. resource limits;
4. privileges: no nested user namespaces, then nobody (root flow) or no capabilities;
5. Landlock: (sandbox) the write lock, nothing writable but the workspace and the device
   nodes (a thread's ``/proc/<tid>/mem`` would otherwise let a cell write its own code);
   (guard only) the filesystem boundary, and ``_ctypes`` unreadable;
6. seccomp (no process creation, no ``execve`` but the handoff), then the handoff.
"""

from __future__ import annotations

import os
import sys
import time

TYPE_CHECKING = False  # not ``typing``: this stage imports as little as it can
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any

# The host's ``-c`` program: the package root is its first argument (``-I -S``: not on
# sys.path otherwise; appended, so it never shadows the standard library).
STAGE_ONE = (
    "import sys,time;t=time.monotonic_ns();sys.path.append(sys.argv.pop(1));"
    "from sequester.kernel.boot import main;main(started=t)"
)
# The cell runner's ``-c`` program (not ``-m``: runpy imports importlib.util, contextlib,
# ... milliseconds of every start), same convention.
STAGE_TWO = "import sys;sys.path.append(sys.argv.pop(1));from sequester.kernel.server import main;main()"
_HEADER = 4


def package_root() -> str:
    """The sys.path entry this copy of sequester was imported from."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def server_command(executable: str, in_fd: int, out_fd: int, *extra: str) -> list[str]:
    """The cell runner's command line. -s: no user site; -B: no .pyc writes; -P: never
    put the (writable) cwd on sys.path."""
    return [executable, "-s", "-B", "-P", "-c", STAGE_TWO, package_root(), str(in_fd), str(out_fd), *extra]


def encode_config(config: dict[str, Any]) -> bytes:
    """The bootstrap configuration as the host sends it: 4-byte big-endian length, then
    :mod:`marshal` (host to kernel only: the host is trusted, the kernel's words are not)."""
    import marshal

    body = marshal.dumps(config)
    return len(body).to_bytes(_HEADER, "big") + body


def read_config(fd: int) -> dict[str, Any] | None:
    """Blocking read of :func:`encode_config`'s frame; ``None`` at end of file."""
    import marshal

    from sequester.kernel.fdread import read_exactly

    what = "the bootstrap configuration"
    header = read_exactly(fd, _HEADER, what=what)
    if header is None:
        return None
    body = read_exactly(fd, int.from_bytes(header, "big"), what=what)
    if body is None:
        raise EOFError("end of file inside the bootstrap configuration")
    config = marshal.loads(body)
    if not isinstance(config, dict):
        raise TypeError("the bootstrap configuration is not a dict")
    return config


def _load_ctypes(fd: int | None) -> None:
    """Import ctypes; in the sandbox its ``_ctypes`` comes from the file the host opened."""
    if fd is not None:
        # importlib.machinery, not importlib.util (which imports contextlib, collections,
        # functools: milliseconds): a spec with a location, what spec_from_file_location makes.
        from importlib.machinery import ExtensionFileLoader, ModuleSpec

        path = f"/proc/self/fd/{fd}"
        loader = ExtensionFileLoader("_ctypes", path)
        spec = ModuleSpec("_ctypes", loader, origin=path)
        spec.has_location = True
        module = loader.create_module(spec)
        module.__spec__, module.__loader__ = spec, loader
        sys.modules["_ctypes"] = module
        loader.exec_module(module)
        os.close(fd)
    import ctypes  # noqa: F401


def confine(cfg: dict[str, Any], marks: list | None = None) -> dict[str, Any]:
    """Steps 1-5 above; returns what the second stage reports (e.g. the Landlock ABI)."""
    from sequester.guard import privileges

    mark = marks.append if marks is not None else (lambda _: None)
    report: dict[str, Any] = {}
    _load_ctypes(cfg.get("ctypes_fd"))
    mark(("ctypes", time.monotonic_ns()))
    limits = cfg["limits"]
    threads_now = len(os.listdir("/proc/self/task"))  # before the workspace's mounts hide the folder
    workspace = cfg.get("workspace")
    if workspace:
        from sequester.guard.workspace import apply_workspace

        apply_workspace(workspace["steps"], workspace["path"])
        mark(("namespaces", time.monotonic_ns()))
    # The bridge's thread runs in the second stage and counts against the thread cap.
    privileges.apply_rlimits(
        memory_bytes=limits["memory_bytes"],
        max_threads=limits["max_threads"] + bool(cfg.get("bridge")),
        file_bytes=limits["file_bytes"],
        threads_now=threads_now,
    )
    if cfg.get("root_flow"):
        privileges.disable_nested_userns()
    if cfg["mode"] == "sandbox" or os.geteuid() == 0:
        privileges.drop_privileges(to_uid=cfg.get("drop_to_uid"), chown=tuple(cfg.get("chown", ())))
    if cfg.get("write_lock"):
        from sequester.guard import landlock

        lock = cfg["write_lock"]
        _no_new_privs()
        report["landlock_abi"] = landlock.restrict_self(
            read=(), write=lock["paths"], connect_ports=None, handled_fs=lock["handled"], scoped=False
        )
    if cfg.get("landlock"):
        from sequester.guard import landlock

        spec = cfg["landlock"]
        _no_new_privs()
        report["landlock_abi"] = landlock.restrict_self(
            read=spec["read"],
            write=spec["write"],
            connect_ports=spec.get("connect_ports"),
            list_only=spec.get("list_only", ()),
        )
    mark(("privileges", time.monotonic_ns()))
    return report


def _no_new_privs() -> None:
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(38, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")


def stage_two(cfg: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """What the cell runner needs of the configuration (it never sees the rest)."""
    keep = ("mode", "bridge", "audit_network", "warm")
    return {**{k: cfg[k] for k in keep if k in cfg}, "output_bytes": cfg["limits"]["output_bytes"], "report": report}


def encode_stage_two(config: dict[str, Any]) -> str:
    """``config`` as the cell runner's last argument (marshal, in hex: an argv is text)."""
    import marshal

    return marshal.dumps(config).hex()


def decode_stage_two(text: str) -> dict[str, Any]:
    import marshal

    config = marshal.loads(bytes.fromhex(text))
    if not isinstance(config, dict):
        raise TypeError("the stage-two configuration is not a dict")
    return config


def main(argv: list[str] | None = None, *, started: int | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    in_fd, out_fd = int(args[0]), int(args[1])
    # Start-up timestamps (CLOCK_MONOTONIC, shared with the host): the host's phases.
    marks: list = [("stage_one", started if started is not None else time.monotonic_ns())]
    try:
        marks.append(("imported", time.monotonic_ns()))
        cfg = read_config(in_fd)
        if cfg is None:
            return
        marks.append(("config", time.monotonic_ns()))
        report = confine(cfg, marks)
        from sequester.guard import seccomp
        from sequester.guard.handoff import Handoff

        second = stage_two(cfg, report)
        marks.append(("handoff", time.monotonic_ns()))  # what is left: the filter and the execve
        second["timing"] = marks
        handoff = Handoff(
            sys.executable, server_command(sys.executable, in_fd, out_fd, encode_stage_two(second)), dict(os.environ)
        )
        seccomp.load_filter(cfg["seccomp"]["bpf"], cfg["seccomp"]["nr"])
        handoff.execute()
    except BaseException as exc:  # noqa: BLE001 - tell the host why, then die: fail closed
        import traceback

        from sequester.kernel.protocol import write_message

        where = "".join(traceback.format_exception(exc)[-3:])
        write_message(out_fd, {"op": "failed", "error": f"{type(exc).__name__}: {exc}\n{where}"})
        os._exit(70)


if __name__ == "__main__":
    main()
