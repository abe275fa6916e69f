"""Starting an episode's sandbox: the view (:mod:`.view`), the environment's files
(:mod:`.staging`), the init under bwrap, its freezer. Used by :mod:`.episode`, which
orders the episode's steps.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sequester.calibration.store import default_store
from sequester.environments.local.layers import view_points
from sequester.environments.local.resolv import place_etc_file, place_resolv_conf
from sequester.environments.local.shell import Shell
from sequester.environments.local.staging import stage_environment, tops_needed
from sequester.environments.local.state import EpisodeDirs
from sequester.environments.local.submounts import describe_mounts_below, gather_submounts, make_skeleton, staged_names
from sequester.environments.local.view import AGENT_LOG_POINTS, plan_episode_layout
from sequester.environments.settings import EpisodeSettings, cluster_cache_dir, episode_id_map
from sequester.errors import SandboxError
from sequester.guard import seccomp
from sequester.net.episode.layout import hosts_file
from sequester.policy import Policy
from sequester.sandbox.argv import CONTAINER_CAPS, Identity, SandboxSpec
from sequester.sandbox.bwrap import StartedBwrap, close_fd, read_pending, start_bwrap
from sequester.sandbox.freeze import Freezer, make_freezer
from sequester.sandbox.gpus import GpuPlan
from sequester.sandbox.host import HostFacts, gather_host_facts
from sequester.sandbox.hostlimits import explain
from sequester.sandbox.idmap import IdMap
from sequester.sandbox.mounts import ROOT_SECRETS, SYSTEM_DIRS, MountKind, MountOp, hidden_paths
from sequester.sandbox.quota import ProjectQuota
from sequester.sandbox.readiness import readable
from sequester.tasks import Task
from sequester.verifier.image_python import ImagePython
from sequester.verifier.tree import runner_tree

if TYPE_CHECKING:
    from sequester.images import ImageLease, ImageRecord
    from sequester.net.episode.session import EpisodeNetwork
    from sequester.sandbox.cgroups.limits import LimitGroups

__all__ = ["RunningEpisode", "start_episode", "launch_init", "hidden_for", "AGENT_PATH", "INIT_SCRIPT", "HOST_SHELL"]

log = logging.getLogger("sequester.environments.local")

# The episode's init: PID 1 of its namespace, which the agent cannot signal (the kernel
# ignores signals to an init that has no handler). bash reaps every orphan it adopts, so
# background processes the agent starts keep running until close() and leave no zombies.
# It says "r" on the ready pipe once bwrap has finished building the view.
_INIT = 'printf r >&"$0"; eval "exec $0>&-"; while :; do sleep 86400 & wait $!; done'
INIT_SCRIPT = _INIT
HOST_SHELL = ("bash", "--noprofile", "--norc", "/dev/fd/3")
AGENT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_REPLACED_TOPS = frozenset({"dev", "proc", "sys", "tmp", "run"})  # the view replaces these wholesale


@dataclass
class RunningEpisode:
    """A started episode: its task, view, init, freezer and shell."""

    task: Task
    workdir: str
    dirs: EpisodeDirs
    bwrap: StartedBwrap
    freezer: Freezer
    env: dict[str, str]
    deadline: float | None
    shell: Shell | None = None
    notes: list[str] = field(default_factory=list)
    symlinks: tuple[MountOp, ...] = ()  # the view's top-level symlinks, as made
    runner: Path | None = None  # the verifier's runner tree on the host
    wheels: Path | None = None  # the wheels the task's test script pins beyond the runner's (on the host)
    installs: Path | None = None  # the tar of what its apt-get install lines install (on the host)
    image_python: ImagePython | None = None  # the image's python3, when the runner has its version
    view_points: frozenset = frozenset()  # where the view's own mounts are (not the agent's changes)
    image: ImageRecord | None = None  # the image the view is made of; None: host mode
    lease: ImageLease | None = None  # held while the episode runs (the store keeps its layers)
    shell_argv: tuple[str, ...] = HOST_SHELL  # the agent's persistent shell (reads /dev/fd/3)
    agent_caps: tuple[str, ...] = CONTAINER_CAPS  # an image's non-root User gets none
    rlimits: dict[str, int] = field(default_factory=dict)  # set on every agent process (see .limits)
    limit_groups: LimitGroups | None = None  # the episode's cgroups (see .cgroup_limits)
    # The ids the episode maps (sandbox.idmap; None: the caller alone), and who the agent
    # becomes inside when that is not the namespace's root (an image's User).
    id_map: IdMap | None = None
    agent_ids: tuple[int, int] | None = None
    gpus: GpuPlan | None = None  # the GPUs bound into the view (sequester.sandbox.gpus)
    storage_quota: ProjectQuota | None = None  # the writable layers' cap (sequester.sandbox.quota)
    network: EpisodeNetwork | None = None  # the episode's network (sequester.net.episode), if it has one
    resolv_placed: bool = False  # its /etc/resolv.conf was put in the view's writable layer before the start
    # Sealed layers of checkpoints (sequester.environments.local.checkpoint) between the
    # image's and the writable one, lowest first; held while the episode runs.
    above: tuple[Path, ...] = ()

    @property
    def layers(self) -> tuple[Path, ...]:
        """Every read-only layer of an episode on an image, lowest first (the image's, then
        the sealed ones); empty in host mode."""
        return (*self.lease.layers, *self.above) if self.lease is not None else ()

    @property
    def agent_cgroups(self) -> list[str]:
        """The ``cgroup.procs`` files every agent process joins on its way in."""
        return list(  # (on cgroup v2 the freezer's cgroup is the limits')
            dict.fromkeys(
                [
                    *([self.freezer.procs_path] if self.freezer.procs_path else []),
                    *(self.limit_groups.procs if self.limit_groups else []),
                ]
            )
        )


def start_episode(
    task: Task,
    workdir: str,
    dirs: EpisodeDirs,
    settings: EpisodeSettings,
    extra_hidden: tuple[Path, ...],
    limits: LimitGroups | None = None,
    resolv_conf: str | None = None,
    *,
    gpus: GpuPlan | None = None,
) -> RunningEpisode:
    """Plan the view, stage the environment's files, start the init under bwrap (with
    ``gpus`` bound in after the view's own ``/dev``). ``resolv_conf``: the agent's
    ``/etc/resolv.conf`` (an episode with a network), put in ``/etc``'s writable layer when
    ``/etc`` is one overlay (see :attr:`RunningEpisode.resolv_placed`)."""
    facts = gather_host_facts()
    hidden_top, hidden_deep = hidden_for(task, facts, settings, extra_hidden)
    fresh = {p.name for p in hidden_top}
    for top in tops_needed(task, workdir):
        if not (Path("/") / top).is_dir() or (Path("/") / top).is_symlink():
            fresh.add(top)
    notes = (
        [
            f"{u.instruction} at {task.dockerfile.source}:{u.line} not applied: {u.reason}"
            for u in task.dockerfile.unsupported
        ]
        if task.dockerfile
        else []
    )
    runner = runner_tree(settings.toolchain_dir)
    # Without a WORKDIR the agent works at the task's own path: an empty writable folder
    # there, instead of the read-only one that hides the task.
    scratch = (Path(workdir),) if workdir == str(task.path) else ()
    hidden_deep = [(p, d) for p, d in hidden_deep if p not in scratch]
    # Issue #7: top-level folders with other mounts below them (container storage) are
    # composed of parts (see .submounts). Staging now comes before planning: a composed
    # folder binds in what staging put at its spine's level.
    overlaid = [
        e.path
        for e in facts.entries
        if e.path.parent == Path("/")
        and e.is_dir
        and not e.is_symlink
        and e.path.name not in fresh
        and e.path.name not in _REPLACED_TOPS
    ]
    submounts = gather_submounts(overlaid)
    notes += stage_environment(task, dirs, fresh, workdir)
    staged = {top: staged_names(sub, dirs) for top, sub in submounts.items()}
    mounts, composites = plan_episode_layout(
        facts,
        dirs,
        hidden_top=hidden_top,
        hidden=hidden_deep,
        new_tops=fresh,
        toolchain=runner,
        scratch=scratch,
        submounts=submounts,
        staged=staged,
    )
    dirs.make_agent_logs(p.name for p in AGENT_LOG_POINTS)
    for op in mounts:
        for folder in (op.upper, op.work, op.source if op.kind.value == "bind" else None):
            if folder is not None and not os.path.lexists(folder):  # (a staged bind's source may be a file)
                folder.mkdir(parents=True, exist_ok=True)
    placed = False
    etc = [op for op in mounts if op.dest == Path("/etc") and op.kind is MountKind.OVERLAY and op.upper]
    etc_upper = etc[0].upper if etc else None
    if etc_upper is not None:  # Docker's /etc/hosts: the episode's hostname resolves without DNS
        place_etc_file(
            etc_upper, "hosts", hosts_file(task.name[:63] or "sequester", resolv_conf is not None), like=Path("/etc")
        )
    if resolv_conf is not None and etc_upper is not None:
        place_resolv_conf(etc_upper, resolv_conf, like=Path("/etc"))
        placed = True
    for c in composites:
        make_skeleton(c)
        if c.hidden:
            shown = ", ".join(str(p) for p in c.hidden[:8]) + (
                f" and {len(c.hidden) - 8} more" if len(c.hidden) > 8 else ""
            )
            notes.append(f"mounted below {c.top}, hidden (empty) in the view: {shown}")
    if workdir == str(task.path):
        notes.append("no WORKDIR: the agent works in an empty folder at the task's path")
    env = {
        "PATH": AGENT_PATH,
        "HOME": "/root",
        "LANG": "C.UTF-8",
        "TERM": "xterm",
        "PWD": workdir,
        **(task.dockerfile.env_map if task.dockerfile else {}),
        **dict(gpus.env if gpus else ()),
    }
    ids, why = episode_id_map(settings)
    if why:
        notes.append(why)
    gpu_ops = gpus.mount_ops() if gpus else ()
    spec = SandboxSpec(
        mounts=(*mounts, *gpu_ops),
        command=("/bin/bash", "--noprofile", "--norc", "-c", _INIT),
        env={"PATH": AGENT_PATH},
        cwd=Path("/"),
        identity=Identity.ROOT,
        id_map=ids,
        caps=CONTAINER_CAPS,
        hostname=task.name[:63] or "sequester",
        as_pid_1=True,
        readonly_root=False,
        seccomp=seccomp.compile_filter("agent"),  # the init too: ptrace of PID 1 gains nothing
    )
    started, freezer = launch_init(spec, overlaid, limits)
    timeout = task.config.agent.timeout_sec
    return RunningEpisode(
        task,
        workdir,
        dirs,
        started,
        freezer,
        env,
        time.monotonic() + timeout if timeout else None,
        notes=notes,
        symlinks=tuple(op for op in mounts if op.kind is MountKind.SYMLINK),
        runner=runner,
        view_points=view_points(
            [*(op.dest for op in (*mounts, *gpu_ops)), *([Path("/etc/hosts")] if etc_upper else [])]
        ),
        id_map=ids,
        resolv_placed=placed,
    )


def launch_init(
    spec: SandboxSpec, overlaid: Sequence[Path] = (), limits: LimitGroups | None = None
) -> tuple[StartedBwrap, Freezer]:
    """Start the episode's init under bwrap and wait until the view is up; its freezer.
    ``overlaid``: the host folders the view overlays (named when bwrap fails on a mount
    below one of them); ``limits``: the cgroups the init joins (while bwrap builds the view)."""
    ready_r, ready_w = os.pipe()
    # The init (and so every agent process) must hold nothing of the host's: not its
    # stdout or stderr, which would let `echo ... > /proc/1/fd/1` forge the operator's
    # output or truncate its log. bwrap's own error messages go to a pipe read until
    # the view is up; after that, writes to it fail.
    err_r, err_w = os.pipe()
    os.set_inheritable(err_r, False)
    try:
        spec = dataclasses.replace(spec, command=(*spec.command, str(ready_w)))
        started = start_bwrap(
            spec, data_files={}, keep_fds=[ready_w], stdout=subprocess.DEVNULL, stderr=err_w, stderr_reader=err_r
        )
    except BaseException:
        close_fd(err_r)
        raise
    finally:
        close_fd(ready_w)
        close_fd(err_w)
    try:
        if limits is not None:
            try:
                limits.enrol(started.pid)
            except ProcessLookupError:
                pass  # bwrap is gone already: its own error (below) says why
            except OSError as exc:
                raise SandboxError(f"the episode's init could not join its cgroups: {exc}") from None
        if not readable(ready_r, 30) or os.read(ready_r, 1) != b"r":
            said = read_pending(err_r, limit=4096).decode(errors="replace").strip()
            below = describe_mounts_below(overlaid)  # name what may have been in the way
            raise SandboxError(
                explain(f"the episode's sandbox did not come up: {said or 'bwrap failed to build the view'}")
                + (f" (mounted below the host folders of the view now: {below})" if below else "")
            )
        freezer = make_freezer(started.pid, cgroup=limits.freezer_cgroup if limits is not None else None)
    except BaseException:
        started.kill()
        raise
    finally:
        close_fd(ready_r)
        close_fd(err_r)
    return started, freezer


def hidden_for(
    task: Task, facts: HostFacts, settings: EpisodeSettings, extra_hidden: tuple[Path, ...]
) -> tuple[set[Path], list[tuple[Path, bool]]]:
    """Top-level folders to give fresh, and deeper paths to cover.

    Whoever the caller, an agent's world is the operating system's folders (root's
    rule, :data:`SYSTEM_DIRS`) plus fresh ones: other users' and other programs' data
    (``/home``, ``/srv``, ``/mnt``, ...) is not part of a task's environment. Below
    those, the caller's own hidden paths (its home and folders, for an ordinary user).
    """
    from sequester.verifier.apt_pins import TASK_INSTALLS_DIR
    from sequester.verifier.wheels import TASK_WHEELS_DIR  # (here: the build package imports the episodes')

    dirs, files = hidden_paths(Policy(), facts)
    top = {
        e.path
        for e in facts.entries
        if e.path.parent == Path("/") and not e.is_symlink and e.path.name not in SYSTEM_DIRS
    }
    # The tasks' pinned test wheels are the verifier's only (root's toolchain folder is in
    # /var, which the view shows): made now, so one fetched during the episode stays hidden.
    wheels = settings.toolchain_dir / TASK_WHEELS_DIR
    installs = settings.toolchain_dir / TASK_INSTALLS_DIR  # (the tests' apt installs: the same)
    for folder in (wheels, installs):
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            pass  # not ours to make: then nothing is fetched there either
    # The cluster cache holds every task a node was shipped, tests and solutions: hidden
    # from every episode on the machine, not only those the cluster starts (attack: a
    # local `sequester run` on a machine that is also a Ray node, whose agent found a
    # shipped copy of its own task's solve.sh below /var/cache and ran it).
    deep = [
        *dirs,
        *files,
        task.path.resolve(),
        settings.state_dir,
        wheels,
        installs,
        cluster_cache_dir(),
        default_store().root,  # the calibration records (sequester.calibration)
        *extra_hidden,
    ]
    if facts.is_root:
        deep += ROOT_SECRETS
    found: list[tuple[Path, bool]] = []
    for path in dict.fromkeys(deep):
        if len(path.parts) > 2 and (path.exists() or path.is_symlink()):
            found.append((path, path.is_dir() and not path.is_symlink()))
    return top, found
