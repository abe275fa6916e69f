"""The host folders an episode keeps its writable layers in, and their cleanup.

``<state_dir>/<pid>-<random>/`` per episode (``pid`` is the host process that owns it):
``upper/<top>`` and ``work/<top>`` for the overlay on each visible top-level folder,
``new/<top>`` for top-level folders the agent gets fresh (``/app``, ``/root``, ...).
Nothing of the task's tests is ever written here. A folder left by a process that died
is removed the next time episodes start.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["EpisodeDirs", "remove_stale"]


@dataclass(frozen=True)
class EpisodeDirs:
    root: Path

    @classmethod
    def create(cls, base: Path) -> EpisodeDirs:
        base.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(base, 0o700)
        return cls(Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=base)))

    def upper(self, top: str) -> Path:
        return self.root / "upper" / top

    def work(self, top: str) -> Path:
        return self.root / "work" / top

    def new(self, top: str) -> Path:
        return self.root / "new" / top

    def layer_roots(self) -> list[tuple[str, Path]]:
        """(top-level name, host folder) of every writable layer that exists."""
        out = []
        for kind in ("upper", "new"):
            folder = self.root / kind
            if folder.is_dir():
                out += [(name, folder / name) for name in sorted(os.listdir(folder))]
        return out

    def remove(self) -> None:
        _rmtree(self.root)


def _rmtree(path: Path) -> None:
    """Remove an episode's folder, whatever modes the agent or overlayfs left inside
    (overlayfs leaves ``work/work`` at mode 000)."""
    if not path.exists():
        return
    for root, dirs, _ in os.walk(path):  # top-down: a folder is opened up before it is entered
        for name in dirs:
            try:
                os.chmod(os.path.join(root, name), stat.S_IRWXU, follow_symlinks=False)
            except OSError:
                pass
    shutil.rmtree(path)


def remove_stale(base: Path) -> list[Path]:
    """Remove episode folders whose owning process is gone. Returns what was removed."""
    removed = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    for name in names:
        pid_text = name.split("-", 1)[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid() or _alive(int(pid_text)):
            continue
        _rmtree(base / name)
        removed.append(base / name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
