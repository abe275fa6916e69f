"""Removal of an episode's folders (:mod:`sequester.environments.local.state`, :mod:`.remove`,
:mod:`.fdwalk`): it always completes, names only what truly cannot go (a mount point), and
one bad stale folder never fails a later job. Controls: the former ``shutil.rmtree``.
The pure tampering report (:mod:`.tamper`) is tested here too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conditions import requires_root
from deep_trees import chain, old_rmtree
from paths import SRC

from sequester.sandbox.fdwalk import Cursor, open_root
from sequester.sandbox.remove import remove_tree
from sequester.environments.local.state import remove_stale
from sequester.environments.local.tamper import CATEGORIES, Change, ChangeSummary, category, tampering_report


def test_the_cursor_never_leaves_the_tree_when_folders_move(tmp_path):
    root = tmp_path / "r"
    (root / "a" / "b" / "c").mkdir(parents=True)
    fd = open_root(root)
    cursor = Cursor(fd)
    try:
        for name in ("a", "b", "c"):
            cursor.enter(name)
        (root / "a" / "b" / "c").rename(root / "c")  # ".." of c is now the root
        assert cursor.leave()                        # re-walked by name: back in b
        assert cursor.names() == ["a", "b"] and os.stat(".", dir_fd=cursor.fd).st_ino == (root / "a" / "b").stat().st_ino
        (root / "a" / "b").rename(root / "b2")       # ".." of b is now the root ...
        (root / "a").rename(root / "a2")
        (root / "a").symlink_to("/")                 # ... and the way back by name a symlink to the host's /
        assert not cursor.leave()                    # cannot verify a: stops at the root
        assert cursor.depth == 0 and cursor.fd == fd
    finally:
        cursor.close()
        os.close(fd)


@requires_root
def test_a_mount_point_is_left_and_named_and_everything_else_removed(tmp_path):
    """In a private mount namespace: a tmpfs still mounted in a stale episode folder."""
    import subprocess

    base = tmp_path / "state"
    harness = f"""
import logging, os, sys, subprocess
sys.path.insert(0, {str(SRC)!r})
from pathlib import Path
from sequester.environments.local.state import EpisodeDirs, remove_stale
from sequester.sandbox.remove import RemovalError
logging.basicConfig(level=logging.WARNING, format="%(message)s")
base = Path({str(base)!r})
for name in ("4194305-mounted", "4194306-plain"):
    (base / name / "upper" / "usr" / "x").mkdir(parents=True)
    (base / name / "upper" / "usr" / "x" / "f").write_text("")
point = base / "4194305-mounted" / "upper" / "usr" / "mnt"
point.mkdir()
subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(point)], check=True)
(point / "inside").write_text("")
print(sorted(p.name for p in remove_stale(base)))
print(sorted(os.listdir(base / "4194305-mounted" / "upper" / "usr")))
try:
    EpisodeDirs(base / "4194305-mounted").remove()
except RemovalError as exc:
    print("RemovalError", "mount point" in str(exc))
subprocess.run(["umount", str(point)], check=True)
EpisodeDirs(base / "4194305-mounted").remove()
print(os.listdir(base))
"""
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", harness],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines == ["['4194306-plain']", "['mnt']", "RemovalError True", "[]"], proc.stdout
    assert "could not remove the stale episode folder" in proc.stderr and "mount point" in proc.stderr


@pytest.mark.slow
def test_remove_stale_goes_on_past_a_folder_the_old_code_could_not_remove(tmp_path):
    base = tmp_path / "state"
    chain(base / "4194305-deep" / "upper" / "usr", 1_100)
    chain(base / "4194306-locked" / "work" / "usr" / "work", 3)
    os.chmod(base / "4194306-locked" / "work" / "usr" / "work", 0)
    (base / "4194307-fine").mkdir()
    chain(tmp_path / "control", 1_100)
    with pytest.raises(RecursionError):  # the control: the former removal on the same folder
        old_rmtree(tmp_path / "control")
    removed = remove_stale(base)
    assert sorted(p.name for p in removed) == ["4194305-deep", "4194306-locked", "4194307-fine"]
    assert os.listdir(base) == []
    remove_tree(tmp_path / "control")


# -- the report (pure) ---------------------------------------------------------------------

def test_categories_put_the_dangerous_paths_first():
    names = [name for name, _ in CATEGORIES]
    expect = {
        "usr/bin/bash": "PATH command", "usr/local/bin": "PATH command", "etc/ld.so.preload": "loader",
        "etc/ld.so.conf.d/x.conf": "loader", "usr/lib/python3/dist-packages/evil.pth": "Python start-up",
        "usr/lib/python3.11/sitecustomize.py": "Python start-up", "root/.config/uv/uv.toml": "Python start-up",
        "usr/local/lib/python3.11/dist-packages/_pytest/main.py": "Python start-up",
        "etc/profile.d/zz.sh": "shell start-up", "home/bob/.bashrc": "shell start-up", "root/.profile": "shell start-up",
        "usr/lib/x86_64-linux-gnu/libc.so.6": "library", "usr/lib/python3.11/os.py": "library",
        "usr/lib/python3/dist-packages/numpy/core.py": "Python package", "root/.cache/x": "home config",
        "usr/share/doc/x": "other",
    }
    assert {path: names[category(path)] for path in expect} == expect


def test_the_summary_is_bounded_and_lists_the_dangerous_first():
    changes = (Change(f"usr/share/doc/pkg/f{i}", "added") for i in range(100_000))
    summary = ChangeSummary(limit=10, host_has=lambda p: p == "usr/bin/python3")
    for change in changes:
        summary.add(change)
        assert len(summary._kept) < 20  # bounded memory, whatever the number of changes
    for change in (Change("usr/local/bin/python3", "added"), Change("etc/ld.so.preload", "added"),
                   Change("usr/bin/bash", "replaced"), Change("usr/bin/perl", "deleted")):
        summary.add(change)
    lines = summary.lines()
    assert lines[0].startswith("100,004 changes") and "/etc 1 (1 added)" in lines[0]
    assert "/usr 100,003 (1 replaced, 1 deleted, 100,001 added)" in lines[0]
    assert lines[1] == "added /usr/local/bin/python3, which shadows /usr/bin/python3 on the verifier's PATH"
    assert lines[2].startswith("replaced /usr/bin/bash") and lines[3].startswith("deleted /usr/bin/perl")
    assert lines[4].startswith("added /etc/ld.so.preload")
    assert len(lines) == 12 and lines[-1].startswith("... and 99,994 more changes not listed")


def test_the_report_never_raises_and_says_when_incomplete():
    def broken(path):
        raise PermissionError(path)
    assert tampering_report([]) == []
    lines = tampering_report([Change("usr/local/bin/sh", "added")], host_has=broken)
    assert lines[1] == "added /usr/local/bin/sh: a command on the verifier's PATH"
    lines = tampering_report([], ["cannot enter /usr/x\n: Permission denied"])
    assert lines[0].startswith("0 changes") and lines[-1].startswith("the scan is incomplete")
    assert "\\n" in lines[-1] and all("\n" not in line for line in lines)


def test_skeletons_untouched_for_a_day_are_removed_and_recent_ones_kept(tmp_path):
    """Composed folders' skeletons (one per host layout) do not pile up in the state folder."""
    import os
    import time

    from sequester.environments.local.state import SKELETON_MAX_AGE, remove_stale

    old, recent = tmp_path / "skeleton-var-old", tmp_path / "skeleton-var-recent"
    for folder in (old, recent):
        (folder / "lib").mkdir(parents=True)
    past = time.time() - SKELETON_MAX_AGE - 60
    os.utime(old, (past, past))
    removed = remove_stale(tmp_path)
    assert removed == [old] and not old.exists() and recent.is_dir()


_KILLED_MID_START = """
import json, os, signal, subprocess, sys
bwrap, folder = sys.argv[1], sys.argv[2]
block_r, block_w = os.pipe()
info_r, info_w = os.pipe()
# as an episode's start runs it: die with this process, wait for the id map on a block fd
subprocess.Popen([bwrap, "--unshare-user", "--unshare-pid", "--die-with-parent", "--userns-block-fd", str(block_r),
                  "--info-fd", str(info_w), "--ro-bind", "/", "/", "--bind", folder + "/new", "/mnt", "--", "/bin/true"],
                 pass_fds=[block_r, info_w], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL)
os.close(info_w)
info = b""
while b"}" not in info:
    info += os.read(info_r, 4096)
holder = os.fork()  # keeps the block's write end open past this process: bwrap's read never ends by
if holder == 0:     # itself (in sequester, that end's close races the parent-death signal)
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    __import__("time").sleep(20)
    os._exit(0)
print(json.loads(info)["child-pid"], holder, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # killed before it wrote the map: the sandbox waits for good
"""


@pytest.mark.skipif(os.geteuid() != 0 and not os.path.exists("/proc/self/ns/user"), reason="needs namespaces")
def test_a_sandbox_left_starting_by_a_killed_process_goes_with_its_folder(tmp_path):
    """A process killed while a reset was under way (a benchmark's Ctrl-C, an OOM kill): its
    sandbox's PID 1 waits for a go-ahead its dead parent never gives, and bwrap sets its
    parent-death signal only after that, so it stayed for good (seen after a killed
    thousand-episode benchmark). The next start's clean-up of dead processes' folders
    kills it (and only bwrap naming such a folder)."""
    from sequester.sandbox.probe import bwrap_path

    base = tmp_path / "state"
    started = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(started.stdout)  # a pid that is gone (for the folder's name)
    folder = base / f"{dead}-abc"
    (folder / "new").mkdir(parents=True)
    script = tmp_path / "killed.py"
    script.write_text(_KILLED_MID_START)
    middle = subprocess.run([sys.executable, str(script), bwrap_path(), str(folder)], capture_output=True, text=True,
                            timeout=60)
    sandbox, holder = (int(p) for p in middle.stdout.split())
    try:
        time.sleep(0.5)
        assert _alive(sandbox), "bwrap no longer leaves it: this test has nothing left to show"
        removed = remove_stale(base)
        deadline = time.monotonic() + 5
        while _alive(sandbox) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(sandbox) and removed == [folder]
    finally:
        for pid in (sandbox, holder):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except OSError:
        return False
