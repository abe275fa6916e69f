"""The filesystem an agent sees in an episode on an image, as mount operations. Pure.

Like a container on the task's image, with the guarantees of the host-mode view
(:mod:`.view`):

* **one overlay at** ``/``: the image's layer folders (from the store, shared read-only
  by every episode on the image) beneath a per-episode writable layer, so the tree is one
  filesystem as a container's root is (a rename from ``/app`` into ``/tmp`` or ``/root``
  works; Docker has no mount there either);
* ``/tmp`` and ``/run`` are the image's folders, unless the image declares them a
  ``VOLUME`` (an anonymous volume of Docker is a filesystem of its own: here a tmpfs);
* ``/tests`` and ``/logs`` are empty **read-only mount points**, whatever the image has
  there: the verifier mounts its own over them in a namespace only it has; below ``/logs``,
  the agent's log folders (``/logs/agent``, ``/logs/artifacts``) are its to write;
* a fresh ``/proc``, ``/dev``, ``/dev/shm``; the CPU part of ``/sys``;
* read-only at its own path: the verifier's runner, whose ``bash`` is also the episode's
  init and the agent's shell of last resort (it brings its own loader and libraries, so
  it runs in any image, one without a shell or Python included).

The folders the sandbox mounts over (:data:`SANDBOX_POINTS`) are made in the writable
layer before the start, as fresh opaque folders (:func:`upper_folders`): the image's
content there is hidden, and no link of the image can lead bwrap's mount point out of the
view. Nothing of the host's system is in this view: not its ``/usr``, not its Python, not
the task's folder. The init is the only host program in it, and the runner is read-only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from sequester.environments.local.state import EpisodeDirs
from sequester.environments.local.view import TOOLCHAIN_MOUNT, VERIFIER_POINTS, sandbox_mounts
from sequester.sandbox.mounts import MountKind, MountOp

__all__ = ["plan_image_view", "upper_folders", "overlay_option_bytes", "OVERLAY_OPTIONS_LIMIT", "SANDBOX_POINTS"]

# Top-level folders the sandbox mounts its own over: made fresh and opaque in the upper layer.
SANDBOX_POINTS = ("proc", "dev", "sys", *(p.name for p in VERIFIER_POINTS))
# The kernel takes a mount's options in one page; bwrap prefixes every folder with /oldroot.
OVERLAY_OPTIONS_LIMIT = 4000


def overlay_option_bytes(op: MountOp) -> int:
    """How long the overlay's option string will be (``lowerdir=...,upperdir=...``)."""
    paths = [*op.lowers, op.upper, op.work]
    return sum(len(f"/oldroot{p}") + 12 for p in paths if p is not None)


def plan_image_view(
    layers: Sequence[Path],
    dirs: EpisodeDirs,
    *,
    toolchain: Path,
    new_tops: Iterable[str] = (),
    sys_cpu: Path | None = None,
    volumes: Iterable[str] = (),
) -> tuple[MountOp, ...]:
    """``layers``: the image's layer folders (and a checkpoint's sealed ones), lowest
    first; ``new_tops``: top-level folders the task needs (its working directory's) that
    the image may lack; ``volumes``: the image config's ``Volumes``.

    Above them all, the episode's runner skeleton (``dirs.runner_skeleton``: the runner's
    mount point and its parent, folders no agent ever wrote): the path bwrap mounts the
    runner on, and the verifier finds it by, is a folder of a lower layer, never the
    agent's. A folder of a lower layer cannot be renamed in the view (overlayfs without
    ``redirect_dir``: ``EXDEV``) and a mount point cannot be removed, so no agent process
    can move the runner's mount aside and put a link of its own there, however the image
    is made (red team: an image without ``/opt`` had it made in the writable layer, which
    the agent renamed), and no link a sealed layer holds there is followed."""
    ops: list[tuple[int, int, MountOp]] = []

    def add(op: MountOp, rank: int) -> None:
        ops.append((len(op.dest.parts), rank, op))

    lowers = (*layers, dirs.runner_skeleton)
    add(MountOp(MountKind.OVERLAY, Path("/"), lowers=lowers, upper=dirs.upper_root, work=dirs.work_root), 0)
    declared = {v.rstrip("/") or "/" for v in volumes}
    for op, rank in sandbox_mounts(sys_cpu, dirs):
        if op.dest in (Path("/tmp"), Path("/run")) and str(op.dest) not in declared:
            continue  # the image's own folder, in the one filesystem
        add(op, rank)
    for name in sorted(set(new_tops) - set(SANDBOX_POINTS) - {"tmp", "run"}):
        add(MountOp(MountKind.DIR, Path("/") / name, mode=0o755), 0)
    add(MountOp(MountKind.READONLY, TOOLCHAIN_MOUNT, source=toolchain), 3)
    return tuple(op for _, _, op in sorted(ops, key=lambda t: (t[0], t[1], str(t[2].dest))))


def upper_folders(kinds: Mapping[str, str]) -> dict[str, tuple[int, bool]]:
    """The top-level folders to make in the writable layer before the start, by name:
    ``(mode, opaque)``. ``kinds``: what the image has at each top-level name (``"dir"``,
    ``"other"``, ``"none"``, see :func:`~sequester.images.stack.image_path_kind`).

    Every sandbox mount point, fresh and opaque; ``/tmp`` where the image has none. (The
    runner's folder is the runner skeleton's, a lower layer: :func:`plan_image_view`.)"""
    out = {name: (0o755, True) for name in SANDBOX_POINTS}
    if kinds.get("tmp", "none") == "none":
        out["tmp"] = (0o1777, False)
    return out
