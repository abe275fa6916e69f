"""The build cache: which layer a build step produced, by the step's key.

A step's key is the digest of its parent's key, the step after expansion
(:attr:`~sequester.imagebuild.steps.RunStep.key_text`) and the content it copies (the context files'
digest, or the key or image id it copies from). Pure, so a whole build's keys are known
before anything runs, and a build whose every layer is in the store runs nothing.

    STORE/build-cache/<key hex>   the hex name of the step's layer folder (layers/<hex>)

Normally a step's layer is named by its key; ``--no-cache`` builds every step afresh
under a new name and repoints the cache entries when the step succeeds, so that the next
build uses the fresh layers while images built before keep theirs. Layers named by a
cache entry are kept by garbage collection; ``sequester image prune`` drops the entries
(all, or those not used for ``--unused-for``), and with them the layers no image uses.
A layer folder named by a step's key is that step's result whether or not an entry names
it (only a commit of that step makes it), so the layers of images still in the store
keep serving their steps after a prune.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from pathlib import Path

from sequester.sandbox.idmap import IdMap

__all__ = ["step_key", "base_key", "BuildCache"]


def base_key(kind: str, value: str, *, ids: IdMap | None = None) -> str:
    """The key a stage starts from: ``image`` (its id), ``stage`` (that stage's last key),
    ``scratch``; and the ids its steps map (``ids``), since a layer built with the caller
    alone holds other owners than one built with a range."""
    mapped = f" ids {ids.uid}:{ids.gid}:{ids.sub_uid}:{ids.sub_gid}" if ids is not None else ""
    return hashlib.sha256(f"sequester-build/1 {kind} {value}{mapped}".encode()).hexdigest()


def step_key(parent: str, key_text: str, content: str = "") -> str:
    return hashlib.sha256(f"{parent}\n{key_text}\n{content}".encode()).hexdigest()


class BuildCache:
    def __init__(self, store_root: Path):
        self.folder = store_root / "build-cache"

    def lookup(self, key: str) -> str | None:
        """The layer hex cached for ``key`` (marked as used), or None."""
        path = self.folder / key
        try:
            value = path.read_text().strip()
        except OSError:
            return None
        if len(value) != 64 or not all(c in "0123456789abcdef" for c in value):
            return None
        try:
            os.utime(path)
        except OSError:
            pass
        return value

    def record(self, key: str, layer_hex: str) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(layer_hex)
            os.replace(tmp, self.folder / key)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def layers(self) -> set[str]:
        """Every layer a cache entry names (kept by garbage collection)."""
        out = set()
        if self.folder.is_dir():
            for entry in self.folder.iterdir():
                if not entry.name.startswith("."):
                    try:
                        out.add(entry.read_text().strip())
                    except OSError:
                        pass
        return out

    def drop(self, unused_for: float | None) -> int:
        """Remove the entries not used for ``unused_for`` seconds (None: all); how many."""
        removed = 0
        if not self.folder.is_dir():
            return 0
        now = time.time()
        for entry in self.folder.iterdir():
            try:
                if unused_for is None or now - entry.stat().st_mtime > unused_for:
                    entry.unlink()
                    removed += 1
            except OSError:
                pass
        return removed
