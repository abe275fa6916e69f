"""Checkpoint, rollback and fork of episodes on an image
(:mod:`sequester.environments.local.checkpoint`), on real sandboxes of the busybox image:
files come back exactly (contents, deletions, modes, owners, xattrs, links), the shell's
working directory and exports carry over and every other process is named as not
restored, forks see nothing of each other (files, processes, sockets, machine id), the
agent reaches no sealed layer, depth and disk are bounded, and the layers go with their
last user. The same scenario runs in this process (root, or whoever runs the tests) and,
as root, as the ordinary user ``seqtest`` (:func:`nobody_site.run_as_user`)."""

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

from sequester.environments.docker.environment import CAPABILITIES as DOCKER_CAPABILITIES
from sequester.environments.local.checkpoint import (
    SHELL_STATE_COMMAND,
    CheckpointError,
    parse_shell_state,
    tree_bytes,
)
from sequester.environments.local.episode import Episode, local_capabilities
from sequester.environments.local.state import remove_stale
from sequester.environments.settings import EpisodeSettings
from sequester.errors import PolicyError

# ---------------------------------------------------------------------------------------
# Pure parts
# ---------------------------------------------------------------------------------------


def test_parse_shell_state_keeps_the_directory_and_exports_and_drops_bashs_own():
    out = "/app/sub\0FOO=bar\0MULTI=a\nb=c\0PWD=/x\0SHLVL=2\0__seq_busy=1\0not a name=1\0EMPTY=\0"
    assert parse_shell_state(out) == ("/app/sub", {"FOO": "bar", "MULTI": "a\nb=c", "EMPTY": ""})
    assert parse_shell_state("") == (None, {})
    assert parse_shell_state("relative\0A=1\0") == (None, {"A": "1"})
    assert "compgen -e" in SHELL_STATE_COMMAND


def test_tree_bytes_counts_hard_links_once_and_follows_no_link(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 100_000)
    os.link(tmp_path / "a", tmp_path / "b")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "loop").symlink_to(tmp_path)
    one = tree_bytes(tmp_path)
    assert 100_000 <= one < 200_000
    with pytest.raises(CheckpointError, match="more than 1 entries"):  # never a partial sum
        tree_bytes(tmp_path, limit=1)


@pytest.mark.parametrize("name, value", [("checkpoint_depth", 1), ("checkpoint_disk_mb", -1),
                                         ("checkpoint_depth", True), ("checkpoint_disk_mb", 1.5)])
def test_bad_checkpoint_settings_name_the_key(name, value):
    with pytest.raises(PolicyError, match=f"episodes.{name}"):
        EpisodeSettings(**{name: value})


def test_capabilities_say_who_can_checkpoint():
    assert local_capabilities().checkpoint is True
    assert DOCKER_CAPABILITIES.checkpoint is False


# ---------------------------------------------------------------------------------------
# The scenario, run by a harness script (in this process's user, and as seqtest)
# ---------------------------------------------------------------------------------------

XATTR_C = r"""
#include <stdio.h>
#include <string.h>
#include <sys/xattr.h>
int main(int argc, char **argv) {
    char buf[256];
    if (argc == 5 && !strcmp(argv[1], "set")) return setxattr(argv[2], argv[3], argv[4], strlen(argv[4]), 0) ? 1 : 0;
    if (argc == 4 && !strcmp(argv[1], "get")) {
        ssize_t n = getxattr(argv[2], argv[3], buf, sizeof buf - 1);
        if (n < 0) { puts("-"); return 0; }
        buf[n] = 0; puts(buf); return 0;
    }
    return 2;
}
"""

HARNESS = r'''
import json, os, sys, time
from pathlib import Path
from sequester.environments.local.checkpoint import CheckpointError
from sequester.environments.local.episode import Episode
from sequester.environments.settings import EpisodeSettings
from sequester.environments.base import UnsupportedByBackend
from sequester.images import ImageSettings, ImageStore

rootfs, task, store, xattr = sys.argv[1:5]
images = ImageSettings(store_dir=store, source="prebuilt")
ImageStore(images).import_source(rootfs, "test/busybox:ck")
X = "/usr/local/bin/xattr"
# What the agent's files are: every path below /app, /etc and /root with its mode, owner,
# link count and kind, a digest of each file's content and each link's target, each file's
# user.mark xattr, and whether the image's /bin/vi is there.
MANIFEST = (
    "(cd / && for f in $(find app etc root -xdev 2>/dev/null | sort); do stat -c '%n %a %u %g %h %F' \"$f\"; "
    "if [ -L \"$f\" ]; then readlink \"$f\"; elif [ -f \"$f\" ]; then sha256sum \"$f\" | cut -c1-16; "
    "[ -x " + X + " ] && " + X + " get \"$f\" user.mark; fi; done; [ -e bin/vi ] && echo vi || echo no-vi)"
)
SETUP = (
    "mkdir -p /app/sub /app/dir && cd /app/sub && echo hello > /app/out.txt && echo keep > /app/keep.txt && "
    "echo data > /app/data.txt && chmod 640 /app/keep.txt && chmod 2750 /app/dir && "
    "(chown 1234:2345 /app/keep.txt 2>/dev/null || true) && ln -s ../out.txt /app/sub/link && "
    "ln /app/out.txt /app/hard && rm /bin/vi && echo 0123456789abcdef0123456789abcdef > /etc/machine-id && "
    "([ -x " + X + " ] && " + X + " set /app/keep.txt user.mark first || true) && export FOO='a b'\n"
    "(while :; do date >> /tmp/writer.log; sleep 0.05; done) &\nsleep 777 &\ntrue"
)
CHANGES = (
    "(cd /app && echo changed > out.txt && rm keep.txt && chmod 600 data.txt && rm sub/link && "
    "ln -s /etc/passwd sub/link && touch new.txt && mkdir -p /etc/more && touch /bin/vi && "
    "([ -x " + X + " ] && " + X + " set data.txt user.mark second || true) && rm hard)"
)
def no_links(view):
    # A squash makes hard links of the files (their link count shows one more): all else is the same.
    return "\n".join(" ".join(f[:4] + f[5:]) if len(f := line.split(" ")) > 5 and f[4].isdigit() else line
                     for line in view.splitlines())


out = {}
es = EpisodeSettings(images=images, checkpoint_depth=2)
with Episode(es) as ep:
    ep.reset(task)
    if xattr:
        ep.write_file(X, Path(xattr).read_bytes(), 0o755)
    out["setup"] = ep.exec(SETUP).exit_code
    out["before"] = ep.exec(MANIFEST).stdout
    t = time.monotonic()
    cp = ep.checkpoint()
    out["checkpoint_s"] = time.monotonic() - t
    out["not_restored"] = list(cp.not_restored)
    out["after_checkpoint"] = ep.exec(MANIFEST).stdout
    out["shell"] = ep.exec('pwd; echo "$FOO"').stdout
    out["ps"] = ep.exec("ps -o args").stdout
    out["changes"] = ep.exec(CHANGES).exit_code
    out["changed"] = ep.exec(MANIFEST).stdout
    ep.rollback(cp)
    out["rolled_back"] = ep.exec(MANIFEST).stdout
    out["rollback_shell"] = ep.exec('pwd; echo "$FOO"').stdout
    layer = cp.layers[-1]
    forks = ep.fork(cp, 2)
    try:
        a, b = forks
        out["a_setup"] = a.exec("echo forkA > /app/data.txt; (sleep 778 &); (nc -l -p 8099 >/dev/null 2>&1 &); sleep 0.3; "
                                "echo fork-a > /dev/shm/x 2>/dev/null; true").exit_code
        out["b_sees"] = b.exec("cat /app/data.txt; ps -o args | grep -c '[s]leep 778'; "
                               "nc -w 1 127.0.0.1 8099 </dev/null >/dev/null 2>&1 && echo connected || echo refused").stdout
        out["a_sees"] = a.exec("cat /app/data.txt; ps -o args | grep -c '[s]leep 778'").stdout
        out["machine_ids"] = [e.exec("cat /etc/machine-id").stdout.strip() for e in (ep, a, b)]
        out["reach"] = a.exec(f"ls {layer} 2>&1 | head -1; ls {layer.parent} 2>&1 | head -1; "
                              f"cat {layer}/app/data.txt 2>&1 | head -1; echo x > {layer}/app/data.txt 2>&1 | head -1").stdout
        out["sealed_data"] = (layer / "app" / "data.txt").read_text()
        out["a_reward_text"] = a.exec("cat /app/out.txt").stdout
    finally:
        for f in forks:
            f.close()
    cp2 = ep.checkpoint()
    ep.exec("(cd /app && echo three > three.txt && rm data.txt && rm -r dir && mkdir dir && touch dir/new && rm /bin/ls)")
    before_squash = ep.exec(MANIFEST).stdout + ep.exec("[ -e /bin/ls ] && echo ls || echo no-ls; find /app/dir | sort").stdout
    cp3 = ep.checkpoint()  # depth 3 > checkpoint_depth 2: the two below squashed into one first
    out["depths"] = [cp.depth, cp2.depth, cp3.depth]
    out["after_squash_view"] = ep.exec(MANIFEST).stdout + ep.exec("[ -e /bin/ls ] && echo ls || echo no-ls; find /app/dir | sort").stdout
    out["before_squash_view"] = before_squash
    out["squash_same"] = no_links(out["after_squash_view"]) == no_links(before_squash)
    out["after_squash"] = ep.exec("cat /app/out.txt; pwd").stdout
    ep.rollback(cp2)
    out["cp2_again"] = ep.exec("[ -e /app/three.txt ] || echo no-three; cat /app/data.txt").stdout
    ep.rollback(cp3)
    out["cp3_again"] = no_links(
        ep.exec(MANIFEST).stdout + ep.exec("[ -e /bin/ls ] && echo ls || echo no-ls; find /app/dir | sort").stdout
    ) == no_links(before_squash)
    folders = sorted({str(p.parent) for c in (cp2, cp3) for p in c.layers})
    running = {str(p.parent) for p in cp3.layers}  # the episode stands on the squashed layer alone
    cp.release()
    cp2.release()
    cp3.release()
    out["held_by_running"] = all(os.path.isdir(f) for f in running)
    out["unused_gone"] = not any(os.path.exists(f) for f in folders if f not in running)
    out["rolled_back_eval"] = ep.evaluate().reward
out["gone_after_close"] = not any(os.path.exists(f) for f in folders)
# Disk: a 1 MB bound and 3 MB written
with Episode(EpisodeSettings(images=images, checkpoint_disk_mb=1)) as ep:
    ep.reset(task)
    ep.exec("dd if=/dev/zero of=/app/big bs=1024 count=3072 2>/dev/null; sleep 779 &")
    try:
        ep.checkpoint()
        out["disk"] = "made"
    except CheckpointError as exc:
        out["disk"] = str(exc)
    out["after_disk_refusal"] = ep.exec("ls -l /app/big | awk '{print $5}'; ps -o args | grep -c '[s]leep 779'").stdout
# Host mode has no layer to seal
with Episode(EpisodeSettings(images=images)) as ep:
    ep.reset(task, image=None)
    try:
        ep.checkpoint()
        out["host"] = "made"
    except UnsupportedByBackend as exc:
        out["host"] = str(exc)
print(json.dumps(out))
'''

TEST_SH = "test \"$(cat /app/out.txt)\" = hello && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n"


def _task(root: Path) -> Path:
    task = root / "task"
    for sub in ("tests", "environment", "solution"):
        (task / sub).mkdir(parents=True)
    (task / "instruction.md").write_text("Write hello to /app/out.txt.\n")
    (task / "task.toml").write_text('version = "1.0"\n[verifier]\ntimeout_sec = 60\n[agent]\ntimeout_sec = 600\n'
                                    '[environment]\ndocker_image = "test/busybox:ck"\nworkdir = "/app"\n')
    (task / "environment" / "Dockerfile").write_text("FROM scratch\n")
    (task / "tests" / "test.sh").write_text(TEST_SH)
    (task / "solution" / "solve.sh").write_text("echo hello > /app/out.txt\n")
    return task


def _xattr_tool(root: Path) -> str:
    """A static helper that sets and reads user xattrs (busybox has no setfattr), or ""."""
    if shutil.which("gcc") is None:
        return ""
    (root / "xattr.c").write_text(XATTR_C)
    done = subprocess.run(["gcc", "-static", "-O1", "-o", str(root / "xattr"), str(root / "xattr.c")],
                          capture_output=True, text=True)
    return str(root / "xattr") if done.returncode == 0 else ""


def _check(out: dict, *, owners: bool) -> None:
    assert out["setup"] == 0 and out["changes"] == 0, out
    # The checkpoint's own view is the files as they were; the shell's directory and exports.
    assert out["after_checkpoint"] == out["before"], json.dumps(out, indent=1)
    assert out["before"].splitlines()[-1] == "no-vi" and out["changed"].splitlines()[-1] == "vi", out
    assert out["shell"] == "/app/sub\na b\n", out
    assert any("sleep 777" in p for p in out["not_restored"]), out
    # The writer loop: its subshell (a copy of the shell), or what it runs at that moment.
    assert any(p in ("sleep 0.05", "date") or p.endswith("/dev/fd/3") for p in out["not_restored"]), out
    assert "sleep 777" not in out["ps"], out  # not silently restored: named, and gone
    if owners:
        assert "app/keep.txt 640 1234 2345" in out["before"], out
    # Rollback: exactly the checkpoint's files again.
    assert out["changed"] != out["before"]
    assert out["rolled_back"] == out["before"], out
    assert out["rollback_shell"] == "/app/sub\na b\n", out
    # Forks: nothing of one in the other.
    assert out["a_setup"] == 0
    assert out["a_sees"] == "forkA\n1\n", out
    assert out["b_sees"] == "data\n0\nrefused\n", out
    ids = out["machine_ids"]
    assert ids[0] == "0123456789abcdef0123456789abcdef" and len(set(ids)) == 3 and all(len(i) == 32 for i in ids), ids
    # The sealed layer is out of the agent's reach, and a fork's write never reaches it.
    assert out["reach"].count("No such file") == 3, out
    assert out["sealed_data"] == "data\n", out
    # Depth: the third checkpoint's layers squashed into one, the view the same; disk, life, host mode.
    assert out["depths"] == [1, 2, 2], out  # the third: the two below squashed into one, and its own
    assert out["squash_same"] is True and out["cp3_again"] is True, (out["before_squash_view"], out["after_squash_view"])
    assert out["after_squash"] == "hello\n/app/sub\n", out
    assert out["cp2_again"] == "no-three\ndata\n", out
    assert out["held_by_running"] is True and out["unused_gone"] is True and out["gone_after_close"] is True, out
    assert out["rolled_back_eval"] == 1.0, out
    assert "checkpoint_disk_mb = 1" in out["disk"], out
    assert out["after_disk_refusal"] == "3145728\n1\n", out  # the episode went on as it was
    assert "needs an episode on an image" in out["host"], out


@pytest.fixture(scope="module")
def scenario_files(tmp_path_factory):
    skip_unless_tools("skopeo")
    root = tmp_path_factory.mktemp("checkpoint")
    return root, _task(root), _xattr_tool(root)


@pytest.mark.slow
def test_checkpoint_rollback_fork_as_the_caller(scenario_files, tmp_path):
    root, task, xattr = scenario_files
    (tmp_path / "harness.py").write_text(HARNESS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.run([sys.executable, str(tmp_path / "harness.py"), str(busybox_rootfs()), str(task),
                           str(tmp_path / "store"), xattr], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    _check(out, owners=os.geteuid() == 0)
    if xattr:
        assert "first" in out["before"] and "second" in out["changed"] and "second" not in out["rolled_back"], out


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="creating a user needs root (CI runs as root)")
@pytest.mark.skipif(not SYSTEM_PYTHON.exists(), reason="needs /usr/bin/python3 (.ci/run installs it)")
def test_checkpoint_rollback_fork_as_an_ordinary_user(scenario_files, user_site):
    root, task, xattr = scenario_files
    entry, home, _, site = user_site
    work = Path(site) / "checkpoint-test"
    work.mkdir()
    try:
        subprocess.run(["cp", "-a", f"{busybox_rootfs()}/.", str(work / "rootfs")], check=True)
        shutil.copytree(task, work / "task")
        if xattr:
            shutil.copy(xattr, work / "xattr")
        (work / "harness.py").write_text(HARNESS)
        subprocess.run(["chown", "-R", f"{entry.pw_uid}:{entry.pw_gid}", str(work)], check=True)
        out = run_as_user(user_site, "checkpoint-test/harness.py", str(work / "rootfs"), str(work / "task"),
                          str(Path(home) / "images-ck"), str(work / "xattr") if xattr else "")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(Path(home) / "images-ck", ignore_errors=True)
    _check(out, owners=False)


def test_a_dead_process_checkpoint_folders_go_with_the_next_starts_clean_up(tmp_path):
    """A process that died holding checkpoints left ``<pid>-ckpt-*`` folders: removed by
    the stale-state pass like its episodes' folders; a live process's are kept."""
    dead = _dead_pid()
    (tmp_path / f"{dead}-ckpt-abc" / "layer" / "app").mkdir(parents=True)
    (tmp_path / f"{dead}-ckpt-abc" / "layer" / "app" / "f").write_text("x")
    (tmp_path / f"{os.getpid()}-ckpt-def" / "layer").mkdir(parents=True)
    removed = remove_stale(tmp_path)
    assert tmp_path / f"{dead}-ckpt-abc" in removed
    assert not (tmp_path / f"{dead}-ckpt-abc").exists() and (tmp_path / f"{os.getpid()}-ckpt-def").exists()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid
