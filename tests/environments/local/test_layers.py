"""Host-side scans and removal of an episode's layers
(:mod:`sequester.environments.local.layers`), on real folders holding what an agent
can leave there: chains 12,000 deep, mode-000 folders, fifos, sockets, devices, whiteouts,
symlinks out of the tree, setuid files, hardlinks, undecodable names, 200k files.

Each protection has a control: the former approach (``os.walk``, ``shutil.rmtree``,
``Path.exists``) raising or failing on the same input.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import time
from pathlib import Path

import pytest
from conditions import requires_root
from deep_trees import chain, old_rmtree

from sequester.environments.local.layers import Budget, Layer, Scan, episode_layers, report_episode, view_points
from sequester.sandbox.remove import remove_tree
from sequester.environments.local.state import EpisodeDirs
from sequester.environments.local.tamper import Change, printable

_DIR = os.O_RDONLY | os.O_DIRECTORY

def old_scan(root: Path, top: str) -> int:
    """episode.py's former scan (the control): os.walk and Path.exists on the host."""
    n = 0
    for current, folders, files in os.walk(root):
        for name in [*folders, *files]:
            host = Path(current, name)
            rel = f"{top}/{host.relative_to(root)}"
            n += (Path("/") / rel).exists()
    return n


@pytest.fixture
def dirs(tmp_path):
    d = EpisodeDirs.create(tmp_path / "state")
    yield d
    if d.root.exists():
        remove_tree(d.root)


def scan(dirs: EpisodeDirs, budget: Budget | None = None) -> tuple[list[Change], Scan]:
    s = Scan(budget or Budget())
    return list(s.changes(episode_layers(dirs))), s


@pytest.mark.slow
def test_a_chain_12000_deep_is_scanned_and_removed(dirs, tmp_path):
    def plant(fd, level):
        if level % 3000 == 0:
            os.mknod("file", dir_fd=fd)
    chain(dirs.upper("usr") / "share" / "zz-agent", 12_000, each=plant)
    changes, s = scan(dirs)
    assert s.complete, s.problems
    folders = [c for c in changes if c.detail == "folder"]
    assert len(folders) == 12_001 and len(changes) == 12_005  # zz-agent, the chain, 4 files
    assert max(len(c.path) for c in changes) < 5000  # deep paths are elided, not megabytes long
    assert any("more levels]" in c.path for c in changes)
    report = report_episode(dirs)
    assert report[0].startswith("12,005 changes") and "/usr 12,005 (12,005 added)" in report[0]
    dirs.remove()
    assert not dirs.root.exists()
    # control: the former scan and removal on the same kind of tree
    chain(tmp_path / "control", 1_100)
    with pytest.raises(RecursionError):
        old_scan(tmp_path / "control", "usr")
    with pytest.raises(RecursionError):
        old_rmtree(tmp_path / "control")
    remove_tree(tmp_path / "control")


def _nasty(root: Path, outside: Path) -> None:
    """Every kind of entry an agent can leave, in ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    os.mkfifo(root / "fifo")
    sock = socket.socket(socket.AF_UNIX)
    here = os.getcwd()
    os.chdir(root)  # a relative name: a deep tmp path can exceed AF_UNIX's 108 bytes
    try:
        sock.bind("sock")
    finally:
        os.chdir(here)
        sock.close()
    (root / "to-root").symlink_to("/")
    (root / "to-outside").symlink_to(outside)
    (root / "to-outside-file").symlink_to(outside / "keep.txt")
    (root / "suid").write_text("#!/bin/sh\n")
    os.chmod(root / "suid", 0o4755)
    os.link(root / "suid", root / "hardlink")
    (root / "bad\nline\x1b[31m").write_text("")
    os.mkdir(os.fsencode(root) + b"/undecodable-\xff\xfe")
    (root / "locked" / "inner").mkdir(parents=True)
    (root / "locked" / "inner" / "lib.so").write_text("")
    os.chmod(root / "locked" / "inner", 0)
    os.chmod(root / "locked", 0)
    (root / "readonly").mkdir()
    (root / "readonly" / "f").write_text("")
    os.chmod(root / "readonly", 0o500)


@pytest.fixture
def outside(tmp_path):
    out = tmp_path / "outside"
    out.mkdir()
    (out / "keep.txt").write_text("host data")
    return out


def _alarm(seconds: int):
    def fire(*_):
        raise TimeoutError("blocked (a fifo was opened?)")
    signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)


def test_special_entries_are_never_opened_or_followed(dirs, outside):
    _nasty(dirs.upper("etc") / "agent", outside)
    _nasty(dirs.new("root") / ".config", outside)
    (dirs.work("etc") / "work").mkdir(parents=True)
    os.chmod(dirs.work("etc") / "work", 0)  # what overlayfs leaves
    _alarm(60)
    try:
        changes, s = scan(dirs)
        report = report_episode(dirs)
        dirs.remove()
    finally:
        signal.alarm(0)
    assert not dirs.root.exists()
    assert (outside / "keep.txt").read_text() == "host data"  # nothing followed out of the tree
    details = {c.path.rsplit("/", 1)[-1]: c.detail for c in changes if c.path.startswith("etc/")}
    assert details["fifo"] == "fifo" and details["sock"] == "socket" and details["to-root"] == "symlink"
    assert details["suid"] == "setuid" and "to-outside" in details
    assert any(os.fsencode(c.path).endswith(b"undecodable-\xff\xfe") for c in changes)
    for line in report:
        assert line.isprintable() and "\x1b" not in line
    assert any("bad\\nline\\x1b[31m" in line for line in report)
    assert any("undecodable-\\xff\\xfe" in line for line in report)
    if os.geteuid() == 0:  # root reads mode-000 folders: the scan is complete
        assert s.complete and any(c.path.endswith("locked/inner/lib.so") for c in changes)


@requires_root
def test_whiteouts_are_deletions_and_devices_are_not_opened(dirs):
    usr = dirs.upper("usr") / "bin"
    usr.mkdir(parents=True)
    os.mknod(usr / "perl", stat.S_IFCHR | 0o600, os.makedev(0, 0))  # an overlay whiteout
    root = dirs.new("root")
    root.mkdir(parents=True)
    os.mknod(root / ".null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    os.mknod(root / ".blk", stat.S_IFBLK | 0o600, os.makedev(7, 0))
    changes, s = scan(dirs)
    assert Change("usr/bin/perl", "deleted") in changes
    assert Change("root/.null", "added", "character device") in changes
    assert Change("root/.blk", "added", "block device") in changes
    assert s.complete
    dirs.remove()
    assert not dirs.root.exists()


def test_replaced_added_and_opaque_against_the_host(dirs):
    usr = dirs.upper("usr")
    (usr / "bin").mkdir(parents=True)
    (usr / "bin" / "sh").write_text("")                      # the host has it
    (usr / "bin" / "zz-new-command").write_text("")          # it does not
    (usr / "lib").mkdir()
    os.setxattr(usr / "lib", "trusted.overlay.opaque" if os.geteuid() == 0 else "user.overlay.opaque", b"y")
    (usr / "lib" / "libc.so.6").write_text("")
    changes, _ = scan(dirs)
    kinds = {c.path: c.kind for c in changes}
    assert kinds["usr/bin/sh"] == "replaced" and kinds["usr/bin/zz-new-command"] == "added"
    assert kinds["usr/lib"] == "replaced"  # deleted and made again: the host's content hidden
    assert kinds["usr/lib/libc.so.6"] == "added"  # below an opaque folder the host is not asked
    assert "usr/bin" not in kinds  # a copied-up parent is no change


def test_homes_only_their_dotfiles_and_work_folders_not_at_all(dirs):
    (dirs.new("root") / "project").mkdir(parents=True)
    (dirs.new("root") / "project" / "main.py").write_text("")
    (dirs.new("root") / ".bashrc").write_text("")
    (dirs.new("home") / "bob" / ".local" / "bin").mkdir(parents=True)
    (dirs.new("home") / "bob" / "notes.txt").write_text("")
    (dirs.new("app")).mkdir(parents=True)
    (dirs.new("app") / "output.csv").write_text("")
    (dirs.new("opt") / "tool").mkdir(parents=True)  # a fresh folder with a system name is scanned whole
    paths = {c.path for c in scan(dirs)[0]}
    assert paths == {"root/.bashrc", "home/bob/.local", "home/bob/.local/bin", "opt/tool"}


@pytest.mark.slow
def test_budget_bounds_200k_files(dirs):
    top = dirs.upper("usr") / "share" / "many"
    top.mkdir(parents=True)
    for i in range(20):
        (top / f"d{i}").mkdir()
        fd = os.open(top / f"d{i}", _DIR)
        try:
            for j in range(10_000):
                os.mknod(f"f{j}", dir_fd=fd)
        finally:
            os.close(fd)
    started = time.monotonic()
    changes, s = scan(dirs, Budget(entries=20_000))
    assert time.monotonic() - started < 10
    assert not s.complete and "20,000 entries" in s.problems[0]
    assert 18_000 < len(changes) <= 20_000
    report = report_episode(dirs, Budget(entries=20_000))
    assert len(report) <= 53 and "more changes not listed" in report[-2]
    assert report[-1].startswith("the scan is incomplete") and "budget" in report[-1]
    _, s = scan(dirs, Budget(seconds=0))
    assert not s.complete and "0 s" in s.problems[0]  # the time budget stops it too
    full, s = scan(dirs)
    assert s.complete and len(full) == 200_021  # many, 20 folders, 200k files (usr/share is the host's)


def test_printable_escapes_everything_that_could_forge_a_line():
    assert printable("usr/bin/ok") == "usr/bin/ok"
    assert printable("a\nb\tc\x1b[0m") == "a\\nb\\tc\\x1b[0m"
    assert printable(os.fsdecode(b"bad\xff")) == "bad\\xff"
    assert printable("back\\slash") == "back\\\\slash"
    assert printable("rtl\u202eoverride") == "rtl\\u202eoverride"


def test_layers_of_an_episode(dirs):
    for top in ("usr", "etc"):
        dirs.upper(top).mkdir(parents=True)
    for top in ("root", "home", "app", "srv", "opt"):
        dirs.new(top).mkdir(parents=True)
    got = [(layer.top, layer.overlay, layer.homes) for layer in episode_layers(dirs)]
    assert got == [("etc", True, ""), ("usr", True, ""), ("home", False, "parent"), ("opt", False, ""),
                   ("root", False, "root")]
    assert all(isinstance(layer, Layer) for layer in episode_layers(dirs))


NOBODY = 65534
HARNESS = r'''
import json, os, shutil, socket, sys
from pathlib import Path
from sequester.environments.local.layers import Scan, episode_layers, report_episode
from sequester.environments.local.state import EpisodeDirs, remove_stale

work = Path(sys.argv[1])
out = {"uid": os.getuid()}
dirs = EpisodeDirs.create(work / "state")
root = dirs.new("root")
(root / ".ssh").mkdir(parents=True)
(root / ".ssh" / "authorized_keys").write_text("")
os.chmod(root / ".ssh", 0)
(root / ".bashrc").write_text("")
private = dirs.upper("etc") / "ssl" / "private"
private.mkdir(parents=True)
(private / "key.pem").write_text("")
locked = dirs.upper("usr") / "lib" / "locked"
locked.mkdir(parents=True)
(locked / "libevil.so").write_text("")
os.chmod(locked, 0)
os.mkfifo(dirs.upper("usr") / "lib" / "fifo")
s = socket.socket(socket.AF_UNIX); s.bind(str(dirs.upper("usr") / "lib" / "sock")); s.close()
(dirs.work("usr") / "work").mkdir(parents=True)
os.chmod(dirs.work("usr") / "work", 0)
fd = os.open(dirs.upper("usr"), os.O_RDONLY)
cur = fd
for _ in range(1100):
    os.mkdir("deep", dir_fd=cur); nxt = os.open("deep", os.O_RDONLY, dir_fd=cur)
    if cur != fd: os.close(cur)
    cur = nxt
os.fchmod(cur, 0)
os.close(cur); os.close(fd)
try:
    Path("/root/.bashrc").exists()
    out["control_exists"] = "ok"
except PermissionError:
    out["control_exists"] = "PermissionError"
shutil.copytree(locked.parent, work / "control", symlinks=True, ignore=lambda d, names: ["locked", "fifo", "sock"])
(work / "control" / "x").mkdir()
(work / "control" / "x" / "f").write_text("")
(work / "control" / "x").chmod(0o500)
try:
    shutil.rmtree(work / "control")
    out["control_rmtree"] = "ok"
except PermissionError:
    out["control_rmtree"] = "PermissionError"
scan = Scan()
out["changes"] = sorted({c.path: [c.kind, c.detail] for c in scan.changes(episode_layers(dirs))
                         if "deep/deep/deep" not in c.path}.items())
out["complete"] = scan.complete
out["report"] = report_episode(dirs)
dirs.remove()
out["removed"] = not dirs.root.exists()
base = work / "stale"
(base / "4194305-x" / "work" / "usr" / "work").mkdir(parents=True)
os.chmod(base / "4194305-x" / "work" / "usr" / "work", 0)
os.chmod(base / "4194305-x" / "work", 0o500)
out["stale"] = [p.name for p in remove_stale(base)]
out["stale_left"] = os.listdir(base)
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def as_nobody():
    """Run HARNESS as nobody (an ordinary host user: no DAC override) with Debian's Python
    and a world-readable copy of sequester; remove everything afterwards."""
    import subprocess
    import tempfile
    import json

    import sequester

    if os.geteuid() != 0 or not shutil.which("setpriv") or not Path("/usr/bin/python3").exists():
        pytest.skip("needs root, setpriv and /usr/bin/python3 (CI has them)")
    site = Path(tempfile.mkdtemp(prefix="seq-layers-", dir="/var/tmp"))
    try:
        shutil.copytree(Path(sequester.__file__).parent, site / "sequester",
                        ignore=shutil.ignore_patterns("__pycache__"))
        (site / "harness.py").write_text(HARNESS)
        for folder, _, files in os.walk(site):
            os.chmod(folder, 0o755)
            for f in files:
                os.chmod(Path(folder, f), 0o644)
        work = site / "work"
        work.mkdir()
        os.chown(work, NOBODY, NOBODY)
        proc = subprocess.run(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "/usr/bin/python3",
             str(site / "harness.py"), str(work)],
            capture_output=True, text=True, timeout=120, cwd=site,
            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "LANG": "C.UTF-8", "HOME": "/"})
        assert proc.returncode == 0, proc.stderr
        yield json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        remove_tree(site)


def test_as_an_ordinary_user_the_controls_fail(as_nobody):
    assert as_nobody["uid"] == NOBODY
    assert as_nobody["control_exists"] == "PermissionError"  # the former scan raised here
    assert as_nobody["control_rmtree"] == "PermissionError"  # the former removal too


def test_as_an_ordinary_user_the_scan_says_what_it_could_not_see(as_nobody):
    changes = dict((path, tuple(v)) for path, v in as_nobody["changes"])
    assert changes["root/.bashrc"] == ("added", "")
    assert changes["root/.ssh"] == ("added", "folder, unreadable: not examined")
    assert changes["etc/ssl/private/key.pem"] == ("changed", "")  # the host's folder is root's: unknown
    assert changes["usr/lib/locked"] == ("added", "folder, unreadable: not examined")
    assert changes["usr/lib/fifo"] == ("added", "fifo") and changes["usr/lib/sock"] == ("added", "socket")
    assert not as_nobody["complete"]
    report = as_nobody["report"]
    assert report[-1].startswith("the scan is incomplete") and "Permission denied" in report[-1]
    assert any(line.startswith("added /root/.bashrc") for line in report)


def test_as_an_ordinary_user_teardown_and_stale_removal_complete(as_nobody):
    assert as_nobody["removed"]
    assert as_nobody["stale"] == ["4194305-x"] and as_nobody["stale_left"] == []


def test_the_views_own_mount_points_are_not_reported(dirs):
    (dirs.upper("opt") / "sequester-verifier").mkdir(parents=True)
    (dirs.new("root") / ".pyenv" / "versions" / "3.11.7").mkdir(parents=True)
    (dirs.new("root") / ".pyenv" / "evil.sh").write_text("")
    known = view_points(["/opt/sequester-verifier", "/root/.pyenv/versions/3.11.7", "/tests"])
    assert known == {"opt/sequester-verifier", "root/.pyenv", "root/.pyenv/versions", "root/.pyenv/versions/3.11.7"}
    s = Scan(known=known)
    assert [c.path for c in s.changes(episode_layers(dirs))] == ["root/.pyenv/evil.sh"]
    assert report_episode(dirs, known=known)[0].startswith("1 change in")
