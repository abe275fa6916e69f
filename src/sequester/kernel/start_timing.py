"""Where a kernel's start went: the host's marks and the kernel's, as phases in order.

The host stamps its steps (``KernelProcess.timing``); the kernel stamps its own (its
clock is the host's CLOCK_MONOTONIC) and reports them with ``ready``. Diagnostics only:
the kernel's timestamps are its word.
"""

from __future__ import annotations

from typing import Any

__all__ = ["phases"]

PHASES = (
    ("host: facts", "launch", "facts"),
    ("host: plan (network, broker, mounts)", "facts", "planned"),
    ("template: the view (kept after a policy's first kernel)", "facts", "t:view"),
    ("template: network and plan", "t:view", "t:planned"),
    ("template: the keeper's clone", "t:planned", "k:stage0"),
    ("bwrap: spawn", "planned", "spawned"),
    ("bwrap: namespaces (+ uid map)", "spawned", "sandbox"),
    ("bwrap: view + exec of the native stage", "sandbox", "k:stage0"),
    ("native stage: confine", "k:stage0", "k:exec0"),
    ("execve, python start", "k:exec0", "k:server"),
    ("bwrap: view + exec, python start", "sandbox", "k:stage_one"),
    ("stage 1: imports", "k:stage_one", "k:imported"),
    ("stage 1: config", "k:imported", "k:config"),
    ("stage 1: ctypes", "k:config", "k:ctypes"),
    ("stage 1: namespaces, workspace", "k:ctypes", "k:namespaces"),
    ("stage 1: limits, privileges", "k:namespaces", "k:privileges"),
    ("stage 1: handoff prepared", "k:privileges", "k:handoff"),
    ("seccomp + execve, python start", "k:handoff", "k:server"),
    ("stage 2: imports", "k:server", "k:server_imported"),
    ("stage 2: bridge, audit hook", "k:server_imported", "k:started"),
    ("ready message", "k:started", "ready"),
)


def phases(host: dict[str, int], kernel: Any, ready_ns: int) -> dict[str, float]:
    marks: dict[str, int] = {**host, "ready": ready_ns}
    if isinstance(kernel, list):
        for item in kernel:
            if isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], int):
                name = "k:" + item[0]
                marks[name + "2" if name in marks else name] = item[1]
    out = {phase: (marks[b] - marks[a]) / 1e6 for phase, a, b in PHASES if a in marks and b in marks}
    if "launch" in marks:
        out["total"] = (ready_ns - marks["launch"]) / 1e6
    return out
