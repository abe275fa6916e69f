"""The first message a kernel reads: what its first stage must do, computed once on the
host from the policy (the seccomp program, the workspace's mounts, the write lock, the
identity to drop to). The native stage gets it as a plan (:mod:`~sequester.guard.native_plan`),
the Python stage as this configuration (:mod:`sequester.kernel.boot`)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from sequester.guard import landlock, seccomp
from sequester.guard.namespaces import plan_workspace
from sequester.guard.privileges import NOBODY
from sequester.guard.workspace import steps_for_kernel
from sequester.policy import Isolation, Policy
from sequester.sandbox.mounts import WORKSPACE

__all__ = ["bootstrap_config"]


def bootstrap_config(
    policy: Policy,
    mode: Isolation,
    *,
    root_flow: bool = False,
    bridge: dict[str, Any] | None = None,
    landlock_spec: dict[str, Any] | None = None,
    audit_network: dict[str, Any] | None = None,
    ctypes_fd: int | None = None,
    keep_below_tmp: tuple[Path, ...] = (),
    template_ids: tuple[int, int] | None = None,
    warm: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The first message a kernel reads: what its bootstrap must do. Everything in it
    that depends only on the policy and the host (the seccomp program, the workspace's
    mounts) is computed here, once, so the kernel's first stage only applies it.

    ``warm`` (a view template's kernel only): a warm kernel, which forks kernels
    (:mod:`sequester.kernel.fork`): ``{"module": its path in the view, "channel_fd": N}``.
    It gets the ``warm`` filter, and its forks the kernel's (``fork_seccomp``)."""
    limits = policy.limits
    config: dict[str, Any] = {
        "mode": mode.value,
        "limits": {
            "memory_bytes": limits.memory_mb * 1024 * 1024,
            "max_threads": limits.max_threads,
            "file_bytes": limits.workspace_mb * 1024 * 1024,
            "output_bytes": limits.output_bytes,
        },
    }
    if mode is Isolation.OFF:
        return config
    profile = "guard" if mode is Isolation.GUARD else "kernel"
    config["seccomp"] = {"bpf": seccomp.compile_filter(profile), "nr": seccomp.syscall_number("seccomp")}
    if warm:
        if mode is not Isolation.SANDBOX or not template_ids:
            raise ValueError("a warm kernel is a view template's kernel")
        config["fork_seccomp"] = config["seccomp"]["bpf"]
        config["seccomp"] = {"bpf": seccomp.compile_filter("warm"), "nr": config["seccomp"]["nr"]}
        config["warm"] = dict(warm)
    if mode is Isolation.SANDBOX:
        # The kernel's own noexec tmpfs for /tmp and /dev/shm together (see guard.namespaces).
        # A view template's kernel (native stage only) makes the /proc and /dev/pts bwrap would.
        # ``template_ids``: the kernel enters a view template (native stage only), so it
        # makes the /proc and /dev/pts bwrap would, and a user namespace whose ids are these.
        steps = plan_workspace(
            limits.workspace_mb * 1024 * 1024,
            WORKSPACE,
            keep_below_tmp,
            own_proc=_proc_covers() if template_ids else None,
        )
        config["workspace"] = {"steps": steps_for_kernel(steps), "path": str(WORKSPACE)}
        if template_ids:
            config.update(template=True, template_ids=list(template_ids))
        # Attack (red team): /proc/self/mem is covered, but a thread's /proc/<tid>/mem is
        # not listed and still opens: a cell wrote its own code through it. With Landlock,
        # nothing is writable but the workspace and the device nodes (reads are the view's).
        abi = _landlock_abi()
        if abi:
            config["write_lock"] = {
                "handled": landlock.write_rights(abi),
                "paths": ["/tmp", "/dev/shm", "/dev"],
                "abi": abi,
            }
    if ctypes_fd is not None:
        config["ctypes_fd"] = ctypes_fd
    if root_flow:
        config.update(root_flow=True, drop_to_uid=NOBODY, chown=[str(WORKSPACE)])
    if bridge:
        config["bridge"] = bridge
    if landlock_spec:
        config["landlock"] = landlock_spec
    if audit_network:
        config["audit_network"] = audit_network
    return config


@lru_cache(maxsize=1)
def _landlock_abi() -> int:
    return landlock.abi_version()


@lru_cache(maxsize=1)
def _proc_covers() -> tuple[Path, ...]:
    """What bwrap covers read-only in a sandbox's /proc, where this kernel has it."""
    return tuple(p for p in (Path("/proc/irq"), Path("/proc/bus")) if p.exists())
