"""Where sequester keeps what it builds or fetches once per machine user.

Root's caches live in ``/var/cache/sequester``, everyone else's in
``$XDG_CACHE_HOME/sequester`` (``~/.cache/sequester``), which every sandbox hides with
the home folder. One place, so every cache of the project agrees on it.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["cache_root", "user_cache", "write_json_whole"]


def user_cache() -> Path:
    """This user's own cache folder, whoever it is (root's included)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sequester"


def cache_root() -> Path:
    """The machine-wide folder for root, the user's own cache folder for anyone else."""
    return Path("/var/cache/sequester") if os.getuid() == 0 else user_cache()


def write_json_whole(path: Path, data: Any, *, prefix: str = ".tmp-", **dump: Any) -> None:
    """``data`` as JSON at ``path``, written aside in its folder and renamed into place, so a
    reader never sees half of it; ``dump``: :func:`json.dump`'s options."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=prefix, suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, **dump)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
