"""What the machine and the caller allow the tests: a folder sandboxes show, root."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest


def _visible_dir() -> str | None:
    """A folder sandboxes show and the tests may write in: where tests put host files a
    sandbox could see unless told otherwise (not scratch space like /tmp or /var/tmp, which
    sandboxes replace).

    Root: ``/opt`` (part of the OS for root's rule). An ordinary user owns no folder the
    sandbox shows as it is (its home and its top-level folders are hidden), except what is
    mounted back read-only: sequester's own source folder (an editable install) or the
    Python installation (a virtual environment), when the user can write there. None: no
    such folder, and the tests that need one are skipped.
    """
    if os.geteuid() == 0:
        return "/opt"
    import sequester

    for candidate in (Path(sequester.__file__).resolve().parent.parent, Path(sys.prefix).resolve()):
        if os.access(candidate, os.W_OK | os.X_OK):
            return str(candidate)
    return None


VISIBLE_DIR = _visible_dir()
# Folders the tests make in VISIBLE_DIR carry this prefix and the pid of the run that
# made them: a killed run's folders (a task's tests and solution among them) would
# otherwise stay where every later episode sees them (an oracle a thief test finds).
VISIBLE_PREFIX = "seqtest-visible-"


def visible_tempdir(name: str, fallback: str | os.PathLike | None = None) -> Path:
    """A new folder (0755) in VISIBLE_DIR (else in ``fallback``), swept by the next run
    once this process is gone (:func:`sweep_visible_leftovers`)."""
    import tempfile

    base = VISIBLE_DIR or fallback
    path = Path(tempfile.mkdtemp(prefix=f"{VISIBLE_PREFIX}{os.getpid()}-{name}-", dir=base))
    path.chmod(0o755)
    return path


def sweep_visible_leftovers() -> list[Path]:
    """Remove the VISIBLE_DIR folders of runs whose process is gone."""
    import shutil

    if VISIBLE_DIR is None:
        return []
    removed = []
    for entry in Path(VISIBLE_DIR).glob(f"{VISIBLE_PREFIX}*"):
        pid = entry.name[len(VISIBLE_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed
NO_VISIBLE_DIR = ("as an ordinary user, no folder the sandbox shows is writable here (neither sequester's "
                  "source nor the Python installation): nowhere to put a file a kernel would see")

requires_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")
