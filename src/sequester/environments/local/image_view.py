"""The filesystem an agent sees in an episode on an image, as mount operations. Pure.

Like a container on the task's image, with the guarantees of the host-mode view
(:mod:`.view`):

* every top-level folder of the merged image is an **overlay**: the image's layer folders
  of that name (from the store, shared read-only by every episode on the image) beneath a
  per-episode writable layer; the image's top-level symlinks (``/bin -> usr/bin``) are
  made as such; an overlay of ``/`` itself is refused by the kernel, hence one per folder;
* top-level folders the task needs and the image lacks are fresh writable folders;
* ``/tests`` and ``/logs`` are empty **read-only mount points**, whatever the image has
  there: the verifier mounts its own over them in a namespace only it has;
* a fresh ``/proc``, ``/dev``, ``/dev/shm``, ``/tmp``, ``/run``; the CPU part of ``/sys``;
* read-only at its own path: the verifier's runner, whose ``bash`` is also the episode's
  init and the agent's shell of last resort (it brings its own loader and libraries, so
  it runs in any image, one without a shell or Python included).

Nothing of the host's system is in this view: not its ``/usr``, not its Python, not the
task's folder. The init is the only host program in it, and the runner is read-only.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from sequester.environments.local.state import EpisodeDirs
from sequester.environments.local.view import TOOLCHAIN_MOUNT, VERIFIER_POINTS, sandbox_mounts
from sequester.images.stack import TopEntry
from sequester.sandbox.mounts import MountKind, MountOp

__all__ = ["plan_image_view", "overlay_option_bytes", "OVERLAY_OPTIONS_LIMIT"]

_REPLACED = frozenset({"dev", "proc", "sys", "tmp", "run"})
_VERIFIER_NAMES = frozenset(p.name for p in VERIFIER_POINTS)
# The kernel takes a mount's options in one page; bwrap prefixes every folder with /oldroot.
OVERLAY_OPTIONS_LIMIT = 4000


def overlay_option_bytes(op: MountOp) -> int:
    """How long the overlay's option string will be (``lowerdir=...,upperdir=...``)."""
    paths = [*op.lowers, op.upper, op.work]
    return sum(len(f"/oldroot{p}") + 12 for p in paths if p is not None)


def plan_image_view(
    tops: Iterable[TopEntry],
    dirs: EpisodeDirs,
    *,
    toolchain: Path,
    new_tops: Iterable[str] = (),
    sys_cpu: Path | None = None,
) -> tuple[MountOp, ...]:
    """``tops``: the merged image's top level (:func:`~sequester.images.stack.merge_tops`);
    ``new_tops``: top-level folders the task needs (its working directory's)."""
    ops: list[tuple[int, int, MountOp]] = []

    def add(op: MountOp, rank: int) -> None:
        ops.append((len(op.dest.parts), rank, op))

    have = set()
    for top in tops:
        if top.name in _REPLACED or top.name in _VERIFIER_NAMES:
            continue
        have.add(top.name)
        dest = Path("/") / top.name
        if top.kind == "dir":
            add(
                MountOp(
                    MountKind.OVERLAY, dest, lowers=top.lowers, upper=dirs.upper(top.name), work=dirs.work(top.name)
                ),
                0,
            )
        elif top.kind == "symlink":
            add(MountOp(MountKind.SYMLINK, dest, target=top.target), 0)
        else:
            add(MountOp(MountKind.READONLY, dest, source=top.lowers[0]), 0)
    for name in sorted(set(new_tops) - have - _REPLACED - _VERIFIER_NAMES):
        add(MountOp(MountKind.BIND, Path("/") / name, source=dirs.new(name)), 0)
    for op, rank in sandbox_mounts(sys_cpu):
        add(op, rank)
    add(MountOp(MountKind.READONLY, TOOLCHAIN_MOUNT, source=toolchain), 3)
    return tuple(op for _, _, op in sorted(ops, key=lambda t: (t[0], t[1], str(t[2].dest))))
