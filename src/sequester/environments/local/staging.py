"""Place a task's environment files where its Dockerfile's COPY/ADD lines put them.

Done on the host, before the agent's sandbox starts, by writing into the episode's
writable layers: a file bound for ``/usr/local/bin/tool`` goes to the overlay's upper
folder of ``/usr``, one bound for ``/app/x`` to the fresh ``/app`` folder. The task
directory is only read.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from sequester.environments.local.state import EpisodeDirs
from sequester.errors import SandboxError
from sequester.tasks import Task, resolve_copies

__all__ = ["top_of", "tops_needed", "stage_environment"]


def top_of(path: str) -> str:
    parts = PurePosixPath(path).parts
    if len(parts) < 2 or parts[0] != "/":
        raise SandboxError(f"{path!r} is not an absolute path below /")
    return parts[1]


def tops_needed(task: Task, workdir: str | None) -> set[str]:
    """Top-level folder names the environment files and the working directory land in."""
    tops = {top_of(workdir)} if workdir else set()
    if task.dockerfile is not None:
        tops |= {top_of(step.dest) for step in task.dockerfile.copies}
    return tops


class _Layers:
    def __init__(self, dirs: EpisodeDirs, fresh: set[str]):
        self.dirs, self.fresh = dirs, fresh

    def host_path(self, dest: str) -> tuple[Path, Path]:
        """(layer root, host path) that stands for ``dest`` in the agent's view."""
        top = top_of(dest)
        root = self.dirs.new(top) if top in self.fresh else self.dirs.upper(top)
        return root, root.joinpath(*PurePosixPath(dest).parts[2:])

    def make_dirs(self, dest: str) -> Path:
        """Create ``dest`` (and parents) in its layer, with the host's modes where the host has them."""
        root, target = self.host_path(dest)
        root.mkdir(parents=True, exist_ok=True)
        lower = Path("/") / top_of(dest)
        for part in PurePosixPath(dest).parts[2:]:
            lower = lower / part
            root = root / part
            if not root.exists():
                mode = lower.stat().st_mode & 0o7777 if lower.is_dir() and top_of(dest) not in self.fresh else 0o755
                root.mkdir()
                os.chmod(root, mode)
        return target


def stage_environment(task: Task, dirs: EpisodeDirs, fresh: set[str], workdir: str | None) -> list[str]:
    """Copy the task's environment files into the layers; returns notes for the report."""
    layers = _Layers(dirs, fresh)
    notes: list[str] = []
    plan = task.dockerfile
    pairs: Iterable[tuple[Path, str]] = resolve_copies(plan, task.environment_dir) if plan and plan.copies else ()
    # --chmod applies to everything a step copies: the last step whose destination
    # covers a path decides (a later COPY over the same path wins, as in Docker).
    chmods: list[tuple[str, int]] = []
    for step in plan.copies if plan else ():
        if step.chmod:
            try:
                chmods.append((step.dest.rstrip("/") or "/", int(step.chmod, 8)))
            except ValueError:
                assert plan is not None  # a step is one of its copies
                notes.append(f"{plan.source}:{step.line}: --chmod={step.chmod} not applied (only octal modes are)")
    for src, dest in pairs:
        if src.is_symlink():
            parent = layers.make_dirs(str(PurePosixPath(dest).parent))
            target = parent / PurePosixPath(dest).name
            if target.exists() or target.is_symlink():
                target.unlink()
            os.symlink(os.readlink(src), target)
        elif src.is_dir():
            layers.make_dirs(dest)
        else:
            target = layers.make_dirs(str(PurePosixPath(dest).parent)) / PurePosixPath(dest).name
            if target.is_dir():
                shutil.rmtree(target)
            shutil.copy2(src, target)
            mode = next((m for d, m in reversed(chmods) if dest == d or dest.startswith(d.rstrip("/") + "/")), None)
            if mode is not None:
                os.chmod(target, mode)
    for step in plan.copies if plan else ():
        if step.chown:
            assert plan is not None  # a step is one of its copies
            notes.append(f"{plan.source}:{step.line}: --chown={step.chown} not applied (files belong to root)")
    if workdir:
        layers.make_dirs(workdir)
    return notes
