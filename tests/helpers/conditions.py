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
NO_VISIBLE_DIR = ("as an ordinary user, no folder the sandbox shows is writable here (neither sequester's "
                  "source nor the Python installation): nowhere to put a file a kernel would see")

requires_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")
