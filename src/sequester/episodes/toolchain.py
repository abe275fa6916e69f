"""The verifier's offline toolchain: ``uv`` and the wheels TB2 test scripts pin.

Terminal-Bench 2 test scripts run ``uvx -p 3.x -w pytest==8.4.1 -w pytest-json-ctrf==0.3.5
pytest ...`` after downloading uv from the internet. Episodes have no internet, so the
verifier gets, read-only at ``/opt/sequester-verifier``: ``bin/uv``, ``bin/uvx``, a
``wheels/`` folder with the pinned packages, and ``cache/`` (a private tmpfs at verify
time), and an environment telling uv to work offline from those wheels. A script that
pins something else, or a Python the host does not have, fails to bootstrap: reported as
"the verifier could not run", never as the agent's 0.

Prepared once per machine (it needs the package registry) by :func:`ensure_toolchain`.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["PINNED", "ensure_toolchain", "verifier_tool_env"]

log = logging.getLogger("sequester.episodes")

PINNED = ("pytest==8.4.1", "pytest-json-ctrf==0.3.5")
_MARKER = "ready-" + "-".join(PINNED).replace("==", "_")


def verifier_tool_env(mount: str) -> dict[str, str]:
    return {
        "UV_OFFLINE": "1",
        "UV_NO_INDEX": "1",
        "UV_FIND_LINKS": f"{mount}/wheels",
        "UV_CACHE_DIR": f"{mount}/cache",
        "UV_PYTHON_DOWNLOADS": "never",
        "UV_NO_PROGRESS": "1",
    }


def ensure_toolchain(folder: Path) -> Path | None:
    """The toolchain folder, prepared if needed; ``None`` (with a warning) if it cannot be."""
    if (folder / _MARKER).exists():
        return folder
    try:
        import uv

        uv_bin = Path(uv.find_uv_bin())
    except Exception as exc:  # noqa: BLE001 - ImportError, or uv's own "binary not found"
        log.warning("the verifier toolchain needs the 'uv' package (pip install uv): %s; "
                    "TB2-style test scripts will not run", exc)
        return None
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".toolchain-", dir=folder.parent))
    try:
        (staging / "bin").mkdir()
        (staging / "cache").mkdir()
        for name in ("uv", "uvx"):
            source = uv_bin.with_name(name)
            if source.exists():
                shutil.copy2(source, staging / "bin" / name)
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--only-binary=:all:",
             "--dest", str(staging / "wheels"), *PINNED],
            capture_output=True, text=True, timeout=600,
        )
        if proc.returncode != 0:
            log.warning("could not download the verifier's pinned wheels (%s): %s", ", ".join(PINNED),
                        proc.stderr.strip()[-500:])
            return None
        (staging / _MARKER).write_text("\n".join(PINNED) + "\n")
        for root, dirs, files in os.walk(staging):
            os.chmod(root, 0o755)
            for f in files:
                path = Path(root, f)
                os.chmod(path, 0o755 if path.parent.name == "bin" else 0o644)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(staging, folder)
        return folder
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
