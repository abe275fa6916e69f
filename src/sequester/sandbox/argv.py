"""Turn a sandbox specification into a bubblewrap command line. Pure.

Who the sandboxed process is (``SandboxSpec.identity``):

* ``CALLER`` (a kernel started by an ordinary user): bwrap makes the user namespace
  itself, maps the caller to itself and disables nested user namespaces; the kernel's
  bootstrap drops the last capabilities.
* ``NOBODY`` (a kernel started by root): running sandboxed code as host root would let it
  read every root-only file the view leaves visible (``/etc/shadow``, host keys), because
  it would own them. So bwrap waits (``--userns-block-fd``) while the launcher writes a
  uid map that also maps ``nobody``, keeps only the capabilities needed to leave root,
  and the kernel's bootstrap switches to ``nobody`` and drops the rest before any model
  code runs.
* ``ROOT`` (an agent's episode): root inside its user namespace, mapped to the caller,
  with a container's usual capabilities (``spec.caps``) and no nested user namespaces.
  With an ``id_map`` (:mod:`sequester.sandbox.idmap`) the namespace maps 65,536 ids, the
  caller as root and its subordinate range for the rest: bwrap waits
  (``--userns-block-fd``) while the launcher writes the map.

The environment is not on the command line (API keys would show in ``ps``): the
launcher hands it to bwrap as its own environment, and bwrap passes it on.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sequester.sandbox.idmap import IdMap
from sequester.sandbox.mounts import WORKSPACE, MountKind, MountOp

__all__ = [
    "TEMPLATE_CAPS",
    "BOOTSTRAP_CAPS",
    "CONTAINER_CAPS",
    "ROOT_BOOTSTRAP_CAPS",
    "Identity",
    "SandboxSpec",
    "LaunchFds",
    "build_argv",
]

# Kept until the kernel's first stage drops them, before any model code runs: it makes
# its own mount and network namespaces with a noexec workspace (SYS_ADMIN), brings up
# their loopback and lets every port be bound there (NET_ADMIN; see
# sequester.guard.namespaces), and empties the bounding set (SETPCAP).
BOOTSTRAP_CAPS = ("CAP_SYS_ADMIN", "CAP_NET_ADMIN", "CAP_SETPCAP")
# The root flow also disables nested user namespaces (SYS_RESOURCE), gives the workspace
# to nobody (CHOWN) and switches to nobody (SETGID, SETUID), which clears the rest.
ROOT_BOOTSTRAP_CAPS = (*BOOTSTRAP_CAPS, "CAP_SYS_RESOURCE", "CAP_CHOWN", "CAP_SETGID", "CAP_SETUID")
# An ordinary caller's view template: its kernels map the keeper's uid 0 (the caller) into
# user namespaces of their own, which the kernel allows only to a creator holding SETFCAP.
TEMPLATE_CAPS = (*BOOTSTRAP_CAPS, "CAP_SETFCAP")
# An agent's root: what a container gets by default (Docker's set). Notably not
# SYS_ADMIN (mounts), SYS_PTRACE, NET_ADMIN or SYS_MODULE.
CONTAINER_CAPS = (
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
)

# ... and the resource limits a container's processes start with (Docker since 25:
# 1024 open files, soft; 524,288 hard, or the caller's own hard limit when lower).
CONTAINER_RLIMITS: dict[str, list[int]] = {"RLIMIT_NOFILE": [1024, 524288]}


class Identity(enum.Enum):
    CALLER = "caller"
    NOBODY = "nobody"
    ROOT = "root"


@dataclass(frozen=True)
class SandboxSpec:
    mounts: tuple[MountOp, ...]
    command: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: Path = WORKSPACE
    identity: Identity = Identity.CALLER
    caps: tuple[str, ...] = BOOTSTRAP_CAPS
    hostname: str = "sequester"
    # Run the command as the namespace's init (immune to signals from inside), and
    # leave the terminal session alone (the command makes its own).
    as_pid_1: bool = False
    new_session: bool = True
    # The assembled root (bwrap's tmpfs) read-only at the end. An episode keeps it
    # writable, as a container's: new top-level folders live in that tmpfs.
    readonly_root: bool = True
    # ROOT: who the agent is in its namespace (an image's ``User``): the caller maps to it.
    uid: int = 0
    gid: int = 0
    # ROOT: the ids the namespace maps (the caller as root, its subordinate range for the
    # rest), written by the launcher; None: the caller alone, mapped to ``uid``/``gid``.
    id_map: IdMap | None = None
    # A seccomp filter (BPF) bwrap loads just before it runs the command: an episode's
    # init gets the agent's, so a process the agent takes over by ptrace gains nothing.
    seccomp: bytes | None = None
    # Hold the command until the launcher releases it (bwrap's --block-fd): a build's RUN
    # waits while the host opens its proxy listener inside the sandbox's network namespace.
    hold: bool = False
    # The command may make user namespaces (no --disable-userns): a view template's keeper,
    # whose kernels each make their own and forbid any below it (see sandbox.template).
    allow_userns: bool = False


@dataclass(frozen=True)
class LaunchFds:
    """File descriptors the launcher opened for bwrap, by purpose."""

    data: Mapping[Path, int] = field(default_factory=dict)
    info: int | None = None
    userns_block: int | None = None
    seccomp: int | None = None
    hold: int | None = None


def _mount_args(op: MountOp, fds: LaunchFds) -> list[str]:
    mode = ["--perms", f"{op.mode:o}"] if op.mode is not None else []
    size = ["--size", str(op.size)] if op.size is not None else []
    match op.kind:
        case MountKind.READONLY:
            return ["--ro-bind", str(op.source), str(op.dest)]
        case MountKind.BIND:
            return ["--bind", str(op.source), str(op.dest)]
        case MountKind.OVERLAY:
            # bwrap stacks its --overlay-src folders in order: the last is the topmost.
            sources = [arg for lower in (op.lowers or (op.source,)) for arg in ("--overlay-src", str(lower))]
            if op.upper is None:  # read-only: a build's COPY --from a stage's merged layers
                return [*sources, "--ro-overlay", str(op.dest)]
            return [*sources, "--overlay", str(op.upper), str(op.work), str(op.dest)]
        case MountKind.SYMLINK:
            return ["--symlink", str(op.target), str(op.dest)]
        case MountKind.HIDE_FILE:
            return ["--ro-bind", str(op.source), str(op.dest)]
        case MountKind.HIDE_DIR:
            return [*mode, "--tmpfs", str(op.dest)]
        case MountKind.TMPFS:
            return [*mode, *size, "--tmpfs", str(op.dest)]
        case MountKind.PROC:
            return ["--proc", str(op.dest)]
        case MountKind.DEV:
            return ["--dev", str(op.dest)]
        case MountKind.DIR:
            return [*mode, "--dir", str(op.dest)]
        case MountKind.DEV_BIND:
            return ["--dev-bind", str(op.source), str(op.dest)]
        case MountKind.DATA:
            if op.dest not in fds.data:
                raise ValueError(f"no file descriptor for the data of {op.dest}")
            return ["--perms", "444", "--ro-bind-data", str(fds.data[op.dest]), str(op.dest)]
    raise ValueError(f"unknown mount kind {op.kind}")  # pragma: no cover


def build_argv(bwrap: str, spec: SandboxSpec, fds: LaunchFds) -> list[str]:
    """The full bwrap argv for ``spec``; ``fds`` names descriptors the launcher opened."""
    argv = [bwrap, "--unshare-user"]
    if fds.info is not None:
        argv += ["--info-fd", str(fds.info)]
    if spec.identity is Identity.NOBODY or (spec.identity is Identity.ROOT and spec.id_map is not None):
        if fds.info is None or fds.userns_block is None:
            raise ValueError("a map written by the launcher needs an info fd and a userns block fd")
        argv += ["--userns-block-fd", str(fds.userns_block)]
    if spec.identity is not Identity.NOBODY:
        # (bwrap refuses --disable-userns beside --userns-block-fd: with a map of the
        # launcher's, the namespace helper forbids nested ones when it hardens the view.)
        if not spec.allow_userns and spec.id_map is None:
            argv += ["--disable-userns"]
        if spec.identity is Identity.ROOT:
            argv += ["--uid", str(spec.uid), "--gid", str(spec.gid)]
    argv += ["--cap-drop", "ALL"]
    for cap in spec.caps:
        argv += ["--cap-add", cap]
    argv += [
        "--unshare-ipc",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-uts",
        "--hostname",
        spec.hostname,
        "--die-with-parent",  # die with the host process
    ]
    if spec.new_session:
        # Own session, so the sandbox cannot push input into the host's terminal (TIOCSTI).
        argv.append("--new-session")
    if spec.as_pid_1:
        argv.append("--as-pid-1")
    for op in spec.mounts:
        argv += _mount_args(op, fds)
    # Read-only last: bwrap must first create the mount points of the mount-backs
    # inside the assembled root and inside hidden folders. Not needed for NOBODY: every
    # folder bwrap makes belongs to the namespace's root (0755), which nobody cannot
    # write to, and the kernel checks it holds no capability before it runs anything.
    # (Each remount is a mount syscall, and they are most of a sandbox's start-up.)
    if spec.identity is not Identity.NOBODY:
        for op in spec.mounts:
            if op.kind is MountKind.HIDE_DIR:
                argv += ["--remount-ro", str(op.dest)]
        if spec.readonly_root:
            argv += ["--remount-ro", "/"]
    if spec.seccomp is not None:
        if fds.seccomp is None:
            raise ValueError("a seccomp filter needs its file descriptor")
        argv += ["--seccomp", str(fds.seccomp)]
    if spec.hold:
        if fds.hold is None:
            raise ValueError("holding the command needs its block file descriptor")
        argv += ["--block-fd", str(fds.hold)]
    argv += ["--chdir", str(spec.cwd), "--", *spec.command]
    return argv
