"""The host folders an episode keeps its writable layers in, and their cleanup.

``<state_dir>/<pid>-<random>/`` per episode (``pid`` is the host process that owns it):
``upper/<top>`` and ``work/<top>`` for the overlay on each visible top-level folder,
``new/<top>`` for top-level folders the agent gets fresh (``/app``, ``/root``, ...).
Nothing of the task's tests is ever written here. A folder left by a process that died
is removed the next time episodes start, with any sandbox still starting on it: a process
killed while a reset was under way left bwrap's half-started sandbox (its PID 1, waiting
for a go-ahead its killed parent never gave, and which no parent-death signal reaches yet:
bwrap sets it later) for good (issue #25, a thousand-episode benchmark killed mid-start).
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sequester.sandbox.idspace import remove_mapped_tree
from sequester.sandbox.remove import RemovalError

__all__ = ["EpisodeDirs", "RemovalError", "kill_stragglers", "remove_stale"]

log = logging.getLogger("sequester.environments.local")


@dataclass(frozen=True)
class EpisodeDirs:
    root: Path

    @classmethod
    def create(cls, base: Path) -> EpisodeDirs:
        base.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(base, 0o700)
        return cls(Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=base)))

    @property
    def upper_root(self) -> Path:
        """The writable layer of an episode on an image: one for its whole tree."""
        return self.root / "upper"

    @property
    def work_root(self) -> Path:
        return self.root / "work"

    def upper(self, top: str) -> Path:
        return self.root / "upper" / top

    @property
    def runner_skeleton(self) -> Path:
        """A lower layer of an episode on an image holding only the runner's mount point
        and its parent (see :func:`.image_view.plan_image_view`)."""
        return self.root / "runner-skeleton"

    def work(self, top: str) -> Path:
        return self.root / "work" / top

    def new(self, top: str) -> Path:
        return self.root / "new" / top

    def agent_logs(self, name: str) -> Path:
        """The folder the agent sees at ``/logs/<name>`` (``agent``, ``artifacts``)."""
        return self.root / "logs" / name

    def make_agent_logs(self, names: Iterable[str]) -> None:
        """Make the agent's log folders, open to every user of the episode (mode 0777, as
        Harbor makes them: an agent may run as the task's own user)."""
        for name in names:
            folder = self.agent_logs(name)
            folder.mkdir(parents=True, exist_ok=True)
            os.chmod(folder, 0o777)

    def remove(self) -> None:
        """Remove the episode's folder and everything the agent left in it (see
        :func:`~sequester.sandbox.remove.remove_tree`: no recursion, no symlink followed, modes opened up).
        Raises :class:`~sequester.sandbox.remove.RemovalError` only for what truly cannot go (a mount point
        still mounted), after removing everything else."""
        remove_mapped_tree(self.root)


def remove_stale(base: Path) -> list[Path]:
    """Remove episode folders whose owning process is gone. Returns what was removed.

    Never raises because of one folder: whatever an agent left in a layer (which made
    ``shutil.rmtree`` raise and then failed every later job of that user), the folder is
    logged and the others are still removed; it is tried again next time."""
    removed: list[Path] = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    stale = [
        name
        for name in names
        if not name.startswith("skeleton-")
        and name.split("-", 1)[0].isdigit()
        and int(name.split("-", 1)[0]) != os.getpid()
        and not _alive(int(name.split("-", 1)[0]))
    ]
    if stale:
        kill_stragglers(base, stale)
    for name in names:
        if name.startswith("skeleton-"):  # a composed folder's skeleton (see submounts.py)
            if _older_than(base / name, SKELETON_MAX_AGE):
                removed += _remove_logged(base / name)
            continue
        pid_text = name.split("-", 1)[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid() or _alive(int(pid_text)):
            continue
        try:
            remove_mapped_tree(base / name)
        except Exception as exc:  # noqa: BLE001 - one bad folder must not fail a later job
            log.warning("could not remove the stale episode folder %s: %s", base / name, exc)
            continue
        removed.append(base / name)
    return removed


def kill_stragglers(base: Path, names: Iterable[str]) -> list[int]:
    """SIGKILL every ``bwrap`` whose command line names one of the folders ``names`` of
    ``base`` (episodes of dead processes): the sandboxes a killed process left while they
    started (see the module). Only bwrap, only those folders; what cannot be signalled
    (another user's) is left. Returns the pids killed. One walk of ``/proc``, when there
    are stale folders at all."""
    marks = [os.fsencode(f"{base}/{name}/") for name in names]
    killed: list[int] = []
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return killed
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm", "rb") as f:
                if f.read().strip() != b"bwrap":
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                line = f.read()
            if not any(mark in line for mark in marks):
                continue
            fd = os.pidfd_open(pid)  # (the pid checked above is the one signalled: no reuse between)
        except OSError:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read() != line:
                    continue
            signal.pidfd_send_signal(fd, signal.SIGKILL)
            killed.append(pid)
            log.info("killed a sandbox left starting by a dead process (pid %d)", pid)
        except OSError:
            pass
        finally:
            os.close(fd)
    return killed


# Skeletons are shared by the episodes of one host layout and rebuilt when missing; one
# untouched this long belongs to a layout long gone (a mount since removed).
SKELETON_MAX_AGE = 24 * 3600


def _older_than(path: Path, seconds: float) -> bool:
    try:
        return time.time() - path.lstat().st_mtime > seconds
    except OSError:
        return False


def _remove_logged(path: Path) -> list[Path]:
    try:
        remove_mapped_tree(path)
    except Exception as exc:  # noqa: BLE001 - one bad folder must not fail a later job
        log.warning("could not remove %s: %s", path, exc)
        return []
    return [path]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
