"""Carrying out one filesystem step of a build: RUN, COPY/ADD, WORKDIR, each in its own
sandbox on the stage's layers so far (:mod:`.step_sandbox`), producing the folder that
becomes the step's layer (:mod:`.layer`).

``RUN`` runs the image's own programs as the Dockerfile's ``USER``. ``COPY``, ``ADD`` and
``WORKDIR`` run the copier (:mod:`._copier_main`) under the verifier runner's Python,
mounted read-only at its own path, so they work on any image (one with no shell or
Python included) and resolve every path inside the image, never on the host.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sequester.errors import BuildError, BuildTimeout, ImageError, SandboxError
from sequester.imagebuild.context import context_sources
from sequester.imagebuild.step_sandbox import AUX, StepOutcome, StepRun, run_step
from sequester.imagebuild.steps import CopyStep, RunStep, WorkdirStep
from sequester.images.stack import image_path_kind, resolve_user
from sequester.sandbox.idmap import IdMap
from sequester.sandbox.mounts import MountKind, MountOp
from sequester.verifier.layout import RUNNER_MOUNT

__all__ = ["StepContext", "execute_step", "step_failure"]

log = logging.getLogger("sequester.imagebuild")

_COPIER = Path(__file__).with_name("_copier_main.py")
_SRC, _PLAN, _PROGRAM = AUX / "src", AUX / "plan.json", AUX / "copy.py"
_TAIL_SHOWN = 3000
_CA_BUNDLE = RUNNER_MOUNT / "etc" / "ca-certificates.crt"  # the host's, copied when the runner was built


@dataclass
class StepContext:
    """What every step of one build shares."""

    source: str  # the Dockerfile, for messages
    context: Path  # the build context folder
    runner: Path | None  # the verifier runner's tree (for the copier)
    proxy_factory: Callable[[], object] | None  # a fresh BuildProxy per step, or None: no network
    deadline: float | None  # time.monotonic() at which the build times out
    on_output: Callable[[bytes], None] | None = None
    stage_layers: Callable[[int], Sequence[Path]] = field(default=lambda i: ())  # COPY --from=<stage>
    image_layers: Callable[[str], Sequence[Path]] = field(default=lambda ref: ())  # COPY --from=<image>
    ids: IdMap | None = None  # the ids every step maps (BuildOptions.ids)


def _left(ctx: StepContext) -> float | None:
    if ctx.deadline is None:
        return None
    return max(0.0, ctx.deadline - time.monotonic())


def _check_mount_points(lowers: Sequence[Path], paths: Sequence[str], where: str) -> None:
    """Attack: an earlier step (or the base image) made ``/proc`` or ``/opt`` a link; bwrap
    makes its mount points before it enters the new root, so it would follow the link
    out of it. Every mount point must be a folder in the layers, or absent."""
    for rel in paths:
        if image_path_kind(lowers, rel) not in ("dir", "none"):
            raise BuildError(
                f"{where}: the image's /{rel} is not a folder (a link or a file); the build's "
                "sandbox cannot be made on it"
            )


def step_failure(ctx: StepContext, line: int, text: str, outcome: StepOutcome) -> BuildError:
    tail = outcome.tail.decode(errors="replace")[-_TAIL_SHOWN:].rstrip()
    short = text if len(text) <= 200 else text[:197] + "..."
    if outcome.timed_out:
        return BuildTimeout(f"{ctx.source}:{line}: the build timed out during {short!r}; last output:\n{tail}")
    refused = "".join(f"\n  network refused: {r}" for r in outcome.refusals[:5])
    return BuildError(
        f"{ctx.source}:{line}: {short!r} failed with exit status {outcome.status}"
        f"{refused}\nlast output:\n{tail or '(none)'}"
    )


def execute_step(
    step: RunStep | CopyStep | WorkdirStep, lowers: Sequence[Path], upper: Path, work: Path, ctx: StepContext
) -> StepOutcome:
    """Run ``step`` on ``lowers`` writing into ``upper``; :class:`BuildError` if it fails."""
    where = f"{ctx.source}:{step.line}"
    try:
        if isinstance(step, RunStep):
            return _run(step, lowers, upper, work, ctx, where)
        if isinstance(step, WorkdirStep) and image_path_kind(lowers, step.path) == "dir":
            upper.mkdir(parents=True, exist_ok=True)  # nothing to make: an empty layer
            return StepOutcome(0, b"", 0.0)
        return _copy(step, lowers, upper, work, ctx, where)
    except SandboxError as exc:
        raise BuildError(f"{where}: the step's sandbox could not be made: {exc}") from None


def _run(step: RunStep, lowers: Sequence[Path], upper: Path, work: Path, ctx: StepContext, where: str) -> StepOutcome:
    _check_mount_points(lowers, ("proc", "dev"), where)
    try:
        uid, gid, home = resolve_user(lowers, step.user)
    except ImageError as exc:
        raise BuildError(f"{where}: USER {step.user!r}: {exc}") from None
    env = dict(step.env)
    env.setdefault("HOME", home or ("/root" if uid == 0 else "/"))
    proxy_factory = ctx.proxy_factory if step.network != "none" else None  # None: no network
    run = StepRun(
        tuple(lowers),
        upper,
        work,
        step.argv,
        env,
        cwd=step.workdir if _is_dir(lowers, step.workdir) else "/",
        uid=uid,
        gid=gid,
        id_map=ctx.ids,
    )
    outcome = run_step(
        run, timeout=_left(ctx), proxy=proxy_factory() if proxy_factory is not None else None, on_output=ctx.on_output
    )
    if outcome.status != 0:
        raise step_failure(ctx, step.line, step.text, outcome)
    return outcome


def _is_dir(lowers: Sequence[Path], path: str) -> bool:
    return image_path_kind(lowers, path) == "dir"


def _copy(
    step: CopyStep | WorkdirStep, lowers: Sequence[Path], upper: Path, work: Path, ctx: StepContext, where: str
) -> StepOutcome:
    if ctx.runner is None:
        raise BuildError(
            f"{where}: COPY, ADD and WORKDIR need the verifier's runner (its Python does the "
            "copying), and it could not be built: see the log"
        )
    runner_rel = str(RUNNER_MOUNT).lstrip("/")
    _check_mount_points(lowers, ("proc", "dev", runner_rel.split("/")[0], runner_rel), where)
    if image_path_kind(lowers, runner_rel) != "none":
        raise BuildError(f"{where}: the image has {RUNNER_MOUNT}, where the build mounts its copier")
    mounts = [MountOp(MountKind.READONLY, Path(RUNNER_MOUNT), source=ctx.runner)]
    ops: list[dict] = []
    network = False
    if isinstance(step, WorkdirStep):
        ops.append({"kind": "mkdir", "path": step.path})
    else:
        chmod = int(step.chmod, 8) if step.chmod else None
        urls = [s for s in step.sources if step.add and s.startswith(("http://", "https://"))]
        local = tuple(s for s in step.sources if s not in urls)
        into = step.dest_is_dir or len(step.sources) > 1
        for url in urls:
            ops.append(
                {
                    "kind": "fetch",
                    "url": url,
                    "dest": step.dest,
                    "dest_is_dir": into,
                    "chmod": chmod,
                    "checksum": getattr(step, "checksum", None),
                    "cafile": str(_CA_BUNDLE),
                }
            )
            network = True
        if local and step.from_stage is None and step.from_image is None:
            found = context_sources(step, ctx.context, ctx.source)
            mounts.append(MountOp(MountKind.READONLY, _SRC, source=found.root))
            if found.copies:
                ops.append(
                    {
                        "kind": "copy",
                        "root": str(_SRC),
                        "sources": list(found.copies),
                        "dest": step.dest,
                        "dest_is_dir": into,
                        "chmod": chmod,
                    }
                )
            for archive in found.archives:
                ops.append({"kind": "extract", "source": f"{_SRC}{archive}", "dest": step.dest})
        elif local:
            layers = (
                ctx.stage_layers(step.from_stage)
                if step.from_stage is not None
                else ctx.image_layers(step.from_image or "")
            )
            if not layers:  # an empty stage (FROM scratch, nothing added): nothing to copy from
                mounts.append(MountOp(MountKind.TMPFS, _SRC))
            elif len(layers) == 1:
                mounts.append(MountOp(MountKind.READONLY, _SRC, source=layers[0]))
            else:
                mounts.append(MountOp(MountKind.OVERLAY, _SRC, lowers=tuple(layers)))
            ops.append(
                {
                    "kind": "copy",
                    "root": str(_SRC),
                    "sources": list(local),
                    "dest": step.dest,
                    "dest_is_dir": into,
                    "chmod": chmod,
                }
            )
    run = StepRun(
        tuple(lowers),
        upper,
        work,
        (f"{RUNNER_MOUNT}/bin/python3", "-I", "-S", str(_PROGRAM), str(_PLAN)),
        {"HOME": "/root"},
        extra_mounts=tuple(mounts),
        data_files={_PROGRAM: _COPIER.read_text(), _PLAN: json.dumps({"ops": ops})},
        id_map=ctx.ids,
    )
    proxy = ctx.proxy_factory() if network and ctx.proxy_factory is not None else None
    outcome = run_step(run, timeout=_left(ctx), proxy=proxy, on_output=ctx.on_output)
    if outcome.status != 0:
        raise step_failure(ctx, step.line, step.text, outcome)
    return outcome
