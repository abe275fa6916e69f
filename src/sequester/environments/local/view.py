"""The filesystem an agent sees in an episode, as mount operations. Pure.

Like a container on the host's own system:

* every visible top-level folder of the host is an **overlay**: the host's folder read-only
  beneath a per-episode writable layer, so the agent can install packages and write
  anywhere while nothing reaches the host or the next episode;
* top-level folders the policy hides (the caller's home; for root, everything that is not
  the OS) and folders the task creates (``/app``) are **fresh writable folders**;
* hidden below the top level: the task's own folder (its ``tests/`` and ``solution/``),
  the folders of other tasks, the jobs folder (verifier outputs), the episodes' state
  folder, root-only secrets: covered by empty read-only tmpfs (or ``/dev/null``);
* ``/tests`` and ``/logs`` are empty **read-only mount points**: the agent can neither
  write there nor replace them with a symlink; the verifier mounts its own over them in a
  namespace only it has. Below ``/logs``, ``/logs/agent`` and ``/logs/artifacts`` are the
  agent's to write (as Harbor has them: an agent's logs, the files it leaves for the job),
  folders of the episode's state, never ``/logs/verifier``;
* a fresh ``/proc``, ``/dev``, ``/tmp``, ``/var/tmp``, ``/run``, ``/dev/shm``; the CPU part of ``/sys``;
* read-only: the host's Python installation (the episode's init runs on it) and the
  verifier's runner (:mod:`sequester.verifier`: the verifier mounts its own copy);
* a top-level folder with other mounts below it (container storage under ``/var/lib``,
  anything bound below ``/opt``) cannot be one overlay (the kernel refuses a lower folder
  holding mounts it cannot clone in a user namespace): it is *composed* of an overlay on a
  skeleton plus one overlay per part that holds no mount, and every mount point below it
  is an empty placeholder (see :mod:`.submounts`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from sequester.environments.local.state import EpisodeDirs
from sequester.environments.local.submounts import Composite, Submounts, plan_composite
from sequester.sandbox.host import HostFacts
from sequester.sandbox.mounts import MountKind, MountOp
from sequester.verifier.layout import RUNNER_MOUNT

__all__ = [
    "plan_episode_view",
    "plan_episode_layout",
    "sandbox_mounts",
    "AGENT_LOG_POINTS",
    "TOOLCHAIN_MOUNT",
    "VERIFIER_POINTS",
]

TOOLCHAIN_MOUNT = Path(str(RUNNER_MOUNT))  # the verifier's runner tree, read-only everywhere
VERIFIER_POINTS = (Path("/tests"), Path("/logs"))
# Harbor's folders of the agent below /logs: writable by every user of the episode (Harbor
# makes them mode 0777 in its containers), kept with the trial. /logs/verifier is not one.
AGENT_LOG_POINTS = (Path("/logs/agent"), Path("/logs/artifacts"))
_VERIFIER_NAMES = frozenset(p.name for p in VERIFIER_POINTS)
_REPLACED = frozenset({"dev", "proc", "sys", "tmp", "run"})


def sandbox_mounts(sys_cpu: Path | None, dirs: EpisodeDirs) -> list[tuple[MountOp, int]]:
    """What every episode's view gets of the sandbox's own, whatever its system (the host's
    or an image's), with its rank among mounts of one depth: ``/tests`` and ``/logs`` as
    empty read-only points, the agent's log folders below ``/logs`` (writable folders of
    the episode's state, :meth:`EpisodeDirs.agent_logs`), a fresh ``/proc``, ``/dev``,
    ``/dev/shm``, ``/tmp``, ``/run``, and of ``/sys`` only the CPU part (``sys_cpu``, read-only)."""
    ops = [(MountOp(MountKind.HIDE_DIR, point, mode=0o555), 0) for point in VERIFIER_POINTS]
    ops += [(MountOp(MountKind.BIND, point, source=dirs.agent_logs(point.name)), 0) for point in AGENT_LOG_POINTS]
    ops += [
        (MountOp(MountKind.PROC, Path("/proc")), 0),
        (MountOp(MountKind.DEV, Path("/dev")), 0),
        (MountOp(MountKind.TMPFS, Path("/dev/shm"), mode=0o1777), 1),
        (MountOp(MountKind.TMPFS, Path("/tmp"), mode=0o1777), 0),
        (MountOp(MountKind.TMPFS, Path("/run"), mode=0o755), 0),
        (MountOp(MountKind.DIR, Path("/sys"), mode=0o755), 0),
    ]
    if sys_cpu is not None:
        ops += [
            (MountOp(MountKind.DIR, parent, mode=0o755), 1)
            for parent in reversed(sys_cpu.parents)
            if len(parent.parts) > 2
        ]
        ops.append((MountOp(MountKind.READONLY, sys_cpu, source=sys_cpu), 1))
    return ops


def plan_episode_view(
    facts: HostFacts,
    dirs: EpisodeDirs,
    *,
    hidden_top: Iterable[Path],
    hidden: Iterable[tuple[Path, bool]],
    new_tops: Iterable[str] = (),
    toolchain: Path | None = None,
    scratch: Iterable[Path] = (),
    submounts: Mapping[Path, Submounts] | None = None,
    staged: Mapping[Path, Mapping[str, frozenset[str]]] | None = None,
) -> tuple[MountOp, ...]:
    """``hidden_top``: top-level folders the agent gets empty; ``hidden``: deeper paths to
    cover, as ``(path, is_dir)`` of paths that exist; ``new_tops``: top-level folder names
    the task needs; ``scratch``: deeper folders the agent gets empty and writable;
    ``submounts``: the top-level folders with mounts below them
    (:func:`~.submounts.gather_submounts`), ``staged``: :func:`~.submounts.staged_names` of each."""
    return plan_episode_layout(
        facts,
        dirs,
        hidden_top=hidden_top,
        hidden=hidden,
        new_tops=new_tops,
        toolchain=toolchain,
        scratch=scratch,
        submounts=submounts,
        staged=staged,
    )[0]


def plan_episode_layout(
    facts: HostFacts,
    dirs: EpisodeDirs,
    *,
    hidden_top: Iterable[Path],
    hidden: Iterable[tuple[Path, bool]],
    new_tops: Iterable[str] = (),
    toolchain: Path | None = None,
    scratch: Iterable[Path] = (),
    submounts: Mapping[Path, Submounts] | None = None,
    staged: Mapping[Path, Mapping[str, frozenset[str]]] | None = None,
) -> tuple[tuple[MountOp, ...], tuple[Composite, ...]]:
    """:func:`plan_episode_view`'s mounts and the composed folders (whose skeletons and upper
    folders :func:`~.submounts.make_skeleton` makes on the host before bwrap starts)."""
    hidden_top = {p for p in hidden_top if len(p.parts) == 2}
    hidden = list(hidden)
    scratch = tuple(scratch)
    submounts = submounts or {}
    # What the rest of the view mounts over anyway: a composed folder makes no part there.
    covered = {
        Path("/var/tmp"),
        *(p for p, _ in hidden),
        *scratch,
        *facts.python_roots,
        *((TOOLCHAIN_MOUNT,) if toolchain is not None else ()),
    }
    composites: list[Composite] = []
    ops: dict[tuple[MountKind, Path], tuple[int, int, MountOp]] = {}

    def add(op: MountOp, rank: int) -> None:
        ops.setdefault((op.kind, op.dest), (len(op.dest.parts), rank, op))

    fresh = set(new_tops) - _VERIFIER_NAMES
    for e in facts.entries:
        if e.path.parent != Path("/") or e.path.name in _REPLACED or e.path in VERIFIER_POINTS:
            continue
        name = e.path.name
        if e.is_symlink:
            add(MountOp(MountKind.SYMLINK, e.path, target=e.link_target), 0)
        elif e.path in hidden_top or name in fresh:
            if e.is_dir or name in fresh:
                fresh.add(name)
        elif e.is_dir and e.path in submounts:
            composite = plan_composite(
                submounts[e.path], dirs, covered=covered, is_root=facts.is_root, staged=(staged or {}).get(e.path)
            )
            composites.append(composite)
            for op, rank in composite.ops:
                add(op, rank)
        elif e.is_dir:
            add(MountOp(MountKind.OVERLAY, e.path, source=e.path, upper=dirs.upper(name), work=dirs.work(name)), 0)
        else:
            add(MountOp(MountKind.READONLY, e.path, source=e.path), 0)
    for name in sorted(fresh):
        add(MountOp(MountKind.BIND, Path("/") / name, source=dirs.new(name)), 0)
    for op, rank in sandbox_mounts(facts.sys_cpu, dirs):
        add(op, rank)
    # The host's scratch space holds anything anyone left there (task copies included).
    add(MountOp(MountKind.TMPFS, Path("/var/tmp"), mode=0o1777), 2)
    for path, is_dir in hidden:
        if len(path.parts) <= 2 or path.parts[1] in fresh or path.parts[1] in _REPLACED:
            continue  # a fresh or replaced top-level folder holds nothing of the host anyway
        if is_dir:
            add(MountOp(MountKind.HIDE_DIR, path, mode=0o755), 2)
        else:
            add(MountOp(MountKind.HIDE_FILE, path, source=Path("/dev/null")), 2)
    for path in scratch:
        add(MountOp(MountKind.TMPFS, path, mode=0o755), 2)
    for root in facts.python_roots:
        add(MountOp(MountKind.READONLY, root, source=root), 3)
    if toolchain is not None:
        add(MountOp(MountKind.READONLY, TOOLCHAIN_MOUNT, source=toolchain), 3)
    mounts = tuple(op for _, _, op in sorted(ops.values(), key=lambda t: (t[0], t[1], str(t[2].dest))))
    return mounts, tuple(composites)
