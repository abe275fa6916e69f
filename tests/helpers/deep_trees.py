"""Trees an agent can leave in an episode's folders, made in a test: chains of folders deeper
than PATH_MAX (built by descriptors); and the former removal, the control the removal
tests compare with (the layer and state tests of tests/environments/local/)."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

_DIR = os.O_RDONLY | os.O_DIRECTORY


def chain(top: Path, depth: int, name: str = "d", each=None) -> None:
    """A chain of ``depth`` folders under ``top``, built by descriptors (its paths exceed
    PATH_MAX); ``each(fd, level)`` may add entries at each level."""
    top.mkdir(parents=True, exist_ok=True)
    fd = os.open(top, _DIR)
    cur = fd
    try:
        for level in range(depth):
            os.mkdir(name, dir_fd=cur)
            nxt = os.open(name, _DIR, dir_fd=cur)
            if cur != fd:
                os.close(cur)
            cur = nxt
            if each:
                each(cur, level)
    finally:
        if cur != fd:
            os.close(cur)
        os.close(fd)


def old_rmtree(path: Path) -> None:
    """state.py's former removal (the control)."""
    for root, dirs, _ in os.walk(path):
        for name in dirs:
            os.chmod(os.path.join(root, name), stat.S_IRWXU, follow_symlinks=False)
    shutil.rmtree(path)
