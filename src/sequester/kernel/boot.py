"""The kernel's first stage: confine this process, then become the cell runner.

Started by the host as ``python -s -B -P -m sequester.kernel.boot IN_FD OUT_FD`` (inside
the sandbox, or on the host in guard-only mode). It reads the bootstrap configuration
from ``IN_FD``, applies it in a fixed order, and ``execve``-s
``python -m sequester.kernel.server IN_FD OUT_FD STAGE2_JSON`` (see
:mod:`sequester.guard.handoff` for why a second image, and why that one ``execve`` is
the only one the filter lets through). If anything fails it tells the host on
``OUT_FD`` and exits: fail closed.

The order is the security argument:

1. ctypes: this stage needs it, and it is not in the view (the host passes the
   ``_ctypes`` library as an open file; in guard-only mode Landlock withholds it later);
2. (sandbox) the kernel's own mount and network namespaces: the workspace, ``/dev/shm``
   and nothing else writable, all ``noexec``; loopback up; every port bindable
   (:mod:`sequester.guard.namespaces`);
3. resource limits;
4. privileges: no nested user namespaces, then nobody (root flow) or no capabilities;
5. (guard only) Landlock: the filesystem boundary, and ``_ctypes`` unreadable;
6. seccomp (no process creation, no ``execve`` but the handoff), then the handoff.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from sequester.kernel.protocol import read_message, write_message

SERVER_MODULE = "sequester.kernel.server"


def _load_ctypes(fd: int | None) -> None:
    """Import ctypes; in the sandbox its ``_ctypes`` comes from the file the host opened."""
    if fd is not None:
        import importlib.machinery
        import importlib.util

        path = f"/proc/self/fd/{fd}"
        loader = importlib.machinery.ExtensionFileLoader("_ctypes", path)
        spec = importlib.util.spec_from_file_location("_ctypes", path, loader=loader)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["_ctypes"] = module
        loader.exec_module(module)
        os.close(fd)
    import ctypes  # noqa: F401


def confine(cfg: dict[str, Any]) -> dict[str, Any]:
    """Steps 1-5 above; returns what the second stage reports (e.g. the Landlock ABI)."""
    from pathlib import Path

    from sequester.guard import privileges

    report: dict[str, Any] = {}
    _load_ctypes(cfg.get("ctypes_fd"))
    limits = cfg["limits"]
    workspace = cfg.get("workspace")
    if workspace:
        from sequester.guard.namespaces import enter_private_namespaces

        enter_private_namespaces(int(workspace["size"]), Path(workspace["path"]),
                                 tuple(Path(p) for p in workspace.get("keep", ())))
    # The bridge's thread runs in the second stage and counts against the thread cap.
    privileges.apply_rlimits(memory_bytes=limits["memory_bytes"], max_threads=limits["max_threads"] + bool(cfg.get("bridge")),
                             file_bytes=limits["file_bytes"])
    if cfg.get("root_flow"):
        privileges.disable_nested_userns()
    if cfg["mode"] == "sandbox" or os.geteuid() == 0:
        privileges.drop_privileges(to_uid=cfg.get("drop_to_uid"), chown=tuple(cfg.get("chown", ())))
    if cfg.get("landlock"):
        from sequester.guard import landlock

        spec = cfg["landlock"]
        _no_new_privs()
        report["landlock_abi"] = landlock.restrict_self(
            read=spec["read"], write=spec["write"], connect_ports=spec.get("connect_ports"),
            list_only=spec.get("list_only", ()),
        )
    return report


def _no_new_privs() -> None:
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(38, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")


def stage_two(cfg: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """What the cell runner needs of the configuration (it never sees the rest)."""
    keep = ("mode", "bridge", "audit_network")
    return {**{k: cfg[k] for k in keep if k in cfg}, "output_bytes": cfg["limits"]["output_bytes"], "report": report}


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    in_fd, out_fd = int(args[0]), int(args[1])
    try:
        cfg = read_message(in_fd)
        if cfg is None:
            return
        report = confine(cfg)
        from sequester.guard import seccomp
        from sequester.guard.handoff import Handoff

        import base64

        handoff = Handoff(sys.executable, [sys.executable, "-s", "-B", "-P", "-m", SERVER_MODULE, str(in_fd), str(out_fd),
                                           json.dumps(stage_two(cfg, report))], dict(os.environ))
        seccomp.load_filter(base64.b64decode(cfg["seccomp"]["bpf"]), cfg["seccomp"]["nr"])
        handoff.execute()
    except BaseException as exc:  # noqa: BLE001 - tell the host why, then die: fail closed
        import traceback

        where = "".join(traceback.format_exception(exc)[-3:])
        write_message(out_fd, {"op": "failed", "error": f"{type(exc).__name__}: {exc}\n{where}"})
        os._exit(70)


if __name__ == "__main__":
    main()
