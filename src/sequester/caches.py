"""Where sequester keeps what it builds or fetches once per machine user.

Root's caches live in ``/var/cache/sequester``, everyone else's in
``$XDG_CACHE_HOME/sequester`` (``~/.cache/sequester``), which every sandbox hides with
the home folder. One place, so every cache of the project agrees on it.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root", "user_cache"]


def user_cache() -> Path:
    """This user's own cache folder, whoever it is (root's included)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sequester"


def cache_root() -> Path:
    """The machine-wide folder for root, the user's own cache folder for anyone else."""
    return Path("/var/cache/sequester") if os.getuid() == 0 else user_cache()
