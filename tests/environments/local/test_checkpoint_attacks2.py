"""Red-team round 2 on Episode.checkpoint(), rollback() and fork() and their fixes
(:mod:`sequester.environments.local.checkpoint`, the runner skeleton, the pool's
checkpoints), on real sandboxes of the busybox image.

Each test runs one scenario of HARNESS in a child Python (as test_checkpoint_attacks.py
does) and asserts the feature's promise. Seven were WINs of the round (a disk cap dodged
below a path past PATH_MAX, a failing squash lifting the depth bound until the episode
died, a squash dropping the agent's logs and changing folder xattrs, an OSError for long
log paths, a fork stopped by a linked /etc/machine-id, a rollback onto another task's
checkpoint scored by that task): each holds now, and fails without its guard.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from images import busybox_rootfs
from registry import skip_unless_tools

pytestmark = pytest.mark.slow

HELPER_C = r"""
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <fcntl.h>
#include <errno.h>
#include <sys/xattr.h>
#include <sys/stat.h>
int main(int argc, char **argv) {
    char buf[4096];
    if (argc < 2) return 2;
    const char *op = argv[1];
    if (!strcmp(op, "set") && argc == 5) {
        if (setxattr(argv[2], argv[3], argv[4], strlen(argv[4]), 0)) {
            printf("set-fail:%s\n", strerror(errno)); return 1;
        }
        puts("set-ok"); return 0;
    }
    if (!strcmp(op, "rm") && argc == 4) {
        if (removexattr(argv[2], argv[3])) { printf("rm-fail:%s\n", strerror(errno)); return 1; }
        puts("rm-ok"); return 0;
    }
    if (!strcmp(op, "list") && argc == 3) {  /* the xattr names of a path, sorted by the caller */
        ssize_t n = llistxattr(argv[2], buf, sizeof buf);
        for (ssize_t i = 0; i < n; i += strlen(buf + i) + 1) printf("%s\n", buf + i);
        return 0;
    }
    /* deep ROOT LEVELS NAMELEN KB: a chain of LEVELS folders of NAMELEN-byte names under
       ROOT (made with relative names: no path is ever long), a KB-kilobyte file (written,
       not sparse) at its bottom */
    if (!strcmp(op, "deep") && argc == 6) {
        int levels = atoi(argv[3]), len = atoi(argv[4]), kb = atoi(argv[5]);
        char name[256]; memset(name, 'd', len); name[len] = 0;
        if (chdir(argv[2])) { perror("chdir"); return 1; }
        for (int i = 0; i < levels; i++) {
            if (mkdir(name, 0755) && errno != EEXIST) { perror("mkdir"); return 1; }
            if (chdir(name)) { perror("chdir"); return 1; }
        }
        if (kb > 0) {
            int fd = open("big", O_CREAT | O_WRONLY | O_TRUNC, 0644); if (fd < 0) { perror("open"); return 1; }
            memset(buf, 'x', sizeof buf);
            for (int i = 0; i < kb / 4; i++)
                if (write(fd, buf, sizeof buf) != sizeof buf) { perror("write"); return 1; }
            close(fd);
        }
        puts("deep-ok"); return 0;
    }
    return 2;
}
"""

HARNESS = r'''
import errno, glob, json, os, stat, sys, time, traceback
from pathlib import Path
from sequester.environments.local import checkpoint as checkpoints
from sequester.environments.local.checkpoint import CheckpointError, tree_bytes
from sequester.environments.local.episode import Episode
from sequester.environments.settings import EpisodeSettings
from sequester.images import ImageSettings, ImageStore

rootfs, tasks, store, helper, state, scenario = sys.argv[1:7]
tasks, state = Path(tasks), Path(state)
images = ImageSettings(store_dir=store, source="prebuilt")
ImageStore(images).import_source(rootfs, "test/busybox:ck2")
H = "/usr/local/bin/h"
out = {}


def episode(task="abs", **kw):
    kw.setdefault("state_dir", state)
    ep = Episode(EpisodeSettings(images=images, **kw))
    ep.reset(tasks / task)
    ep.write_file(H, Path(helper).read_bytes(), 0o755)
    return ep


def mine(where=None):
    return sorted(glob.glob(f"{where or state}/{os.getpid()}-ckpt-*"))


def err(exc):
    return f"{type(exc).__name__}: {str(exc)[:300]}"


def real_bytes(root):
    """Disk blocks under root, walked with folder descriptors (no path is ever long)."""
    total, seen = 0, set()
    stack = [os.open(root, os.O_RDONLY | os.O_DIRECTORY)]
    while stack:
        fd = stack.pop()
        try:
            for entry in os.scandir(fd):
                st = os.stat(entry.name, dir_fd=fd, follow_symlinks=False)
                if (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
                if stat.S_ISDIR(st.st_mode):
                    stack.append(os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd))
        finally:
            os.close(fd)
    return total


def alive(ep):
    try:
        return ep.exec("cat /app/work.txt").stdout
    except Exception as exc:
        return err(exc)


# -- 3. tree_bytes: a path longer than PATH_MAX on the host is skipped (OSError: continue) --
def deep_disk():
    """checkpoint_disk_mb = 1; 8 MB written at the bottom of a chain of folders whose host
    path is longer than PATH_MAX (24 levels of 200-byte names). tree_bytes' scandir and
    stat of it fail with ENAMETOOLONG, which it skips as 'continue'."""
    with episode(checkpoint_disk_mb=1) as ep:
        ep.exec("echo precious > /app/work.txt")
        out["setup"] = ep.exec(f"{H} deep /app 24 200 8192").stdout.strip()
        try:
            cp = ep.checkpoint()
        except CheckpointError as exc:
            out["checkpoint"] = "CheckpointError: " + str(exc)[:200]
            return
        except Exception as exc:
            out["checkpoint"] = err(exc)
            return
        out["checkpoint"] = "made"
        out["counted"] = cp.layer_bytes
        out["held_bytes"] = checkpoints.held_bytes()
        out["real"] = real_bytes(cp.layers[-1])
        out["cap"] = 1 << 20
        # ...and again: every checkpoint adds 8 MB nobody counts.
        ep.exec(f"mkdir /app/again && {H} deep /app/again 24 200 8192")
        try:
            cp2 = ep.checkpoint()
            out["second"] = {"counted": cp2.layer_bytes, "real": real_bytes(cp2.layers[-1])}
            cp2.release()
        except CheckpointError as exc:
            out["second"] = "CheckpointError: " + str(exc)[:200]
        cp.release()


# -- 1. squash fails for good (a path past PATH_MAX): the depth bound is gone ----------------
def deep_squash():
    """checkpoint_depth = 2. A chain of folders longer than PATH_MAX makes squash_into's
    scandir raise; checkpoint() keeps the stack 'one deeper' with a note, every time. The
    state_dir is long (as a deployment's may be) so the overlay's option page fills fast."""
    long_state = state / ("s" * 200)
    long_state.mkdir(exist_ok=True)
    ep = episode(checkpoint_depth=2, state_dir=long_state)
    depths, notes = [], []
    try:
        ep.exec("echo precious > /app/work.txt")
        out["setup"] = ep.exec(f"{H} deep /app 24 200 0").stdout.strip()
        held = []
        for i in range(40):
            try:
                cp = ep.checkpoint()
            except Exception as exc:
                out["stopped_at"] = i
                out["error"] = err(exc)
                break
            held.append(cp)
            depths.append(cp.depth)
            notes.append([n[:160] for n in ep.notes if "squashed" in n][-1:])
        out["depths"] = depths
        out["notes"] = notes[-1:]
        out["after"] = alive(ep)
        for cp in held:
            cp.release()
    finally:
        ep.close()
    out["left_after_close"] = mine(long_state)


# -- squash drops the checkpoint's copy of the agent's logs --------------------------------
def squash_logs():
    """checkpoint_depth = 2: the third checkpoint squashes. Its logs folder is the sealed
    layer's folder's, which the squash lets go (removed): /logs/agent and /logs/artifacts
    come back empty."""
    with episode(checkpoint_depth=2) as ep:
        ep.exec("echo note > /logs/agent/note; echo art > /logs/artifacts/a.txt")
        cp1 = ep.checkpoint()
        out["after_first"] = ep.exec("cat /logs/agent/note /logs/artifacts/a.txt 2>&1").stdout
        ep.checkpoint().release()
        cp2 = ep.checkpoint()  # the third: the two below squashed
        out["depth2"] = cp2.depth
        out["after_squash"] = ep.exec("cat /logs/agent/note /logs/artifacts/a.txt 2>&1").stdout
        ep.exec("rm -f /logs/agent/note")
        ep.rollback(cp2)
        out["after_rollback"] = ep.exec("cat /logs/agent/note /logs/artifacts/a.txt 2>&1").stdout
        (f,) = ep.fork(cp2, 1)
        with f:
            out["fork"] = f.exec("cat /logs/agent/note /logs/artifacts/a.txt 2>&1").stdout
        cp1.release()
        cp2.release()


# -- 1. the squashed view against the unsquashed one ----------------------------------------
SHOW = (
    "cd / && for p in $(find /app /etc /bin /srv -xdev 2>/dev/null | sort); do "
    "  printf '%s ' \"$p\"; ls -ld \"$p\" | awk '{print $1, $3, $4}' | tr '\\n' ' '; "
    "  [ -f \"$p\" ] && [ ! -L \"$p\" ] && md5sum < \"$p\" | cut -c1-8 | tr '\\n' ' '; "
    "  [ -L \"$p\" ] && readlink \"$p\" | tr '\\n' ' '; echo; done"
)
XATTRS = (f"for p in /app /app/x /app/d /app/o /etc /srv; do echo \"$p: $({H} list $p | sort | tr '\\n' ' ')\"; done")


def squash_view():
    """checkpoint_depth = 2: the third checkpoint squashes three layers. Before it, the
    view is listed (paths, types, modes, owners, contents, link targets, folder xattrs);
    after it, and in a fork of it, it is listed again."""
    with episode(checkpoint_depth=2) as ep:
        # Layer 1: folders with xattrs, an image file deleted, an image folder emptied,
        # files, links, a FIFO, a file with several names.
        out["l1"] = ep.exec(
            "mkdir -p /app/d/sub /app/o /srv/keep && echo one > /app/d/sub/f && echo x > /app/x && "
            f"{H} set /app/d user.keep yes && {H} set /app/d user.gone yes && {H} set /app/o user.o 1 && "
            f"{H} set /etc user.overlay.opaque y && "  # stored escaped: user.overlay.overlay.opaque
            "rm -f /etc/group && rm -rf /srv/keep && ln -s /etc/passwd /app/link && mkfifo /app/fifo && "
            "echo h > /app/h1 && ln /app/h1 /app/h2 && chmod 705 /app/d && echo ok").stdout
        cp1 = ep.checkpoint()
        # Layer 2: an xattr removed from a lower folder, a file turned into a folder, a
        # folder emptied and made again, a deleted image file back as a folder.
        out["l2"] = ep.exec(
            f"{H} rm /app/d user.gone && rm /app/x && mkdir /app/x && echo inner > /app/x/in && "
            "rm -rf /app/o && mkdir /app/o && echo new > /app/o/n && "
            "mkdir /etc/group && echo g > /etc/group/g && chmod 700 /app/o && echo ok").stdout
        cp2 = ep.checkpoint()
        # Layer 3: the folder back to a file, the image file gone again, the link retargeted.
        out["l3"] = ep.exec(
            "rm -rf /app/x && echo back > /app/x && rm -rf /etc/group && ln -sfn /etc/hostname /app/link && "
            "rm /app/h1 && echo ok").stdout
        before, xbefore = ep.exec(SHOW).stdout, ep.exec(XATTRS).stdout
        cp3 = ep.checkpoint()
        out["depth3"] = cp3.depth
        after, xafter = ep.exec(SHOW).stdout, ep.exec(XATTRS).stdout
        (f,) = ep.fork(cp3, 1)
        with f:
            fork, xfork = f.exec(SHOW).stdout, f.exec(XATTRS).stdout
        out["view_same"] = before == after == fork
        out["xattrs_same"] = xbefore == xafter == xfork
        if not out["view_same"]:
            b, a = set(before.splitlines()), set(after.splitlines())
            out["view_diff"] = {"only_before": sorted(b - a)[:20], "only_after": sorted(a - b)[:20]}
        out["xattrs_before"], out["xattrs_after"] = xbefore, xafter
        for cp in (cp1, cp2, cp3):
            cp.release()


# -- 3. copy_logs: a log path past PATH_MAX ---------------------------------------------------
def logs_long_path():
    """/logs/agent holds a chain of 20 folders of 250-byte names (less than LOG_DEPTH deep,
    5000 bytes of path): copy_logs' mkdir/scandir raise OSError (ENAMETOOLONG), which no
    one turns into CheckpointError."""
    with episode() as ep:
        ep.exec("echo precious > /app/work.txt")
        out["setup"] = ep.exec(f"{H} deep /logs/agent 20 250 0").stdout.strip()
        try:
            cp = ep.checkpoint()
            out["checkpoint"] = "made"
            cp.release()
        except CheckpointError as exc:
            out["checkpoint"] = "CheckpointError: " + str(exc)[:200]
        except Exception as exc:
            out["checkpoint"] = err(exc)
        out["after"] = alive(ep)
    out["left_after_close"] = mine()


# -- 5. a fork's machine id: /etc/machine-id made a link to a read-only file ------------------
def machine_id_link():
    """Before the checkpoint, /etc/machine-id is a link to the runner's bash (read-only,
    not empty). The fork reads it (non-empty) and writes a new id through it."""
    with episode() as ep:
        out["set"] = ep.exec("ln -sf /opt/sequester-verifier/bin/bash /etc/machine-id; echo rc=$?").stdout
        cp = ep.checkpoint()
        try:
            forks = ep.fork(cp, 1)
            out["fork"] = "made"
            out["fork_sees"] = forks[0].exec("readlink /etc/machine-id; head -c 4 /etc/machine-id | od -c").stdout
            for f in forks:
                f.close()
        except CheckpointError as exc:
            out["fork"] = "CheckpointError: " + str(exc)[:200]
        except Exception as exc:
            out["fork"] = err(exc)
        cp.release()
    out["left_after_close"] = mine()


# -- 2. the runner skeleton after the agent's games with /opt and / before a checkpoint --------
def runner_after_opt_games():
    """/opt and / chmod 000, /opt given xattrs and files, a file where a sibling mount point
    might go, then sealed: the skeleton copies /opt's mode from the sealed layer. The
    verdict must still be the work's."""
    with episode() as ep:
        out["set"] = ep.exec(
            f"touch /opt/x; mkdir -p /opt/sequester-verifier.d; {H} set /opt user.a b; chmod 000 /opt; chmod 700 /; "
            "echo nope > /app/out.txt; echo rc=$?").stdout
        cp = ep.checkpoint()
        out["view"] = ep.exec("ls -ld /opt | cut -c1-10; ls /opt/sequester-verifier/bin | grep -c .").stdout
        out["reward_wrong"] = ep.evaluate().reward
        ep.exec("echo hello > /app/out.txt")
        out["reward_right"] = ep.evaluate().reward
        (f,) = ep.fork(cp, 1)
        with f:
            out["fork_wrong"] = f.evaluate().reward
        cp.release()


# -- 4/5. the pool: an episode rolled back onto a checkpoint of another task -----------------
def pool_cross_task():
    """Episode A (task 'abs': write hello to /app/out.txt) does nothing. Episode B (task
    'easy': /app/done exists) solves its own. A is rolled back onto B's checkpoint: the pool
    (and a server session) still says A is of task 'abs'; its verdict is 'easy''s."""
    from sequester.environments.pool import EpisodePool

    settings = EpisodeSettings(images=images, state_dir=state)
    with EpisodePool(tasks, settings=settings, capacity=2, calibration="off", wait_timeout=0) as pool:
        a = pool.acquire("abs")
        b = pool.acquire("easy")
        b.exec("touch /app/done")
        cp = pool.checkpoint(b)
        out["a_out_before"] = a.exec("cat /app/out.txt 2>&1; ls /app").stdout
        try:
            pool.rollback(a, cp)
            out["rollback"] = "done"
        except Exception as exc:
            out["rollback"] = err(exc)
        out["a_task"] = a.task
        out["a_out_txt"] = a.exec("cat /app/out.txt 2>&1").stdout
        out["a_after"] = pool.evaluate(a).reward
        a.close()
        b.close()


globals()[scenario]()
print(json.dumps(out))
'''

ABS_TEST = ("test \"$(cat /app/out.txt 2>/dev/null)\" = hello && echo 1 > /logs/verifier/reward.txt "
            "|| echo 0 > /logs/verifier/reward.txt\n")
EASY_TEST = "test -e /app/done && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n"


def _task(root: Path, name: str, test: str, instruction: str) -> None:
    task = root / name
    for sub in ("tests", "environment", "solution"):
        (task / sub).mkdir(parents=True)
    (task / "instruction.md").write_text(instruction)
    (task / "task.toml").write_text('version = "1.0"\n[verifier]\ntimeout_sec = 60\n[agent]\n'
                                    'timeout_sec = 600\n[environment]\ndocker_image = "test/busybox:ck2"\n'
                                    'workdir = "/app"\n')
    (task / "environment" / "Dockerfile").write_text("FROM scratch\n")
    (task / "tests" / "test.sh").write_text(test)
    (task / "solution" / "solve.sh").write_text("true\n")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    skip_unless_tools("skopeo", "gcc")
    root = tmp_path_factory.mktemp("ckattack2")
    tasks = root / "tasks"
    _task(tasks, "abs", ABS_TEST, "Write hello to /app/out.txt.\n")
    _task(tasks, "easy", EASY_TEST, "Touch /app/done.\n")
    (root / "h.c").write_text(HELPER_C)
    subprocess.run(["gcc", "-static-pie", "-O1", "-o", str(root / "h"), str(root / "h.c")], check=True,
                   capture_output=True)
    (root / "harness.py").write_text(HARNESS)
    (root / "state").mkdir()
    return root


def _run(world: Path, scenario: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.run([sys.executable, str(world / "harness.py"), str(busybox_rootfs()), str(world / "tasks"),
                           str(world / "store"), str(world / "h"), str(world / "state"), scenario],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(out, indent=1))
    return out


# ---------------------------------------------------------------------------------------


def test_disk_cap_counts_files_past_path_max(world):
    out = _run(world, "deep_disk")
    assert out["setup"] == "deep-ok", out
    if out["checkpoint"] != "made":
        assert out["checkpoint"].startswith("CheckpointError"), out
        return
    assert out["counted"] >= out["real"] - (64 << 10), out  # what was sealed is what was counted
    assert out["held_bytes"] <= out["cap"], out


def test_squash_failure_cannot_lift_the_depth_bound(world):
    out = _run(world, "deep_squash")
    assert out["setup"] == "deep-ok", out
    assert all(d <= 2 for d in out["depths"]), out
    assert out.get("error", "CheckpointError").startswith("CheckpointError") or "error" not in out, out
    assert out["after"] == "precious\n", out
    assert out["left_after_close"] == [], out


def test_squash_keeps_the_agents_logs(world):
    out = _run(world, "squash_logs")
    assert out["depth2"] == 2, out
    want = "note\nart\n"
    assert out["after_first"] == want, out
    assert out["after_squash"] == want and out["after_rollback"] == want and out["fork"] == want, out


def test_squash_gives_the_same_files(world):
    out = _run(world, "squash_view")
    assert out["depth3"] == 2, out
    assert out["view_same"], out


def test_squash_gives_the_same_folder_xattrs(world):
    out = _run(world, "squash_view")
    assert out["xattrs_same"], out


def test_log_paths_past_path_max_are_a_checkpoint_error(world):
    out = _run(world, "logs_long_path")
    assert out["setup"] == "deep-ok", out
    assert out["checkpoint"] == "made" or out["checkpoint"].startswith("CheckpointError"), out
    assert out["after"] == "precious\n", out
    assert out["left_after_close"] == [], out


def test_a_fork_starts_whatever_etc_machine_id_is(world):
    out = _run(world, "machine_id_link")
    assert "rc=0" in out["set"], out
    assert out["fork"] == "made" or out["fork"].startswith("CheckpointError"), out
    assert out["left_after_close"] == [], out


def test_a_pool_episode_cannot_be_rolled_back_onto_another_tasks_checkpoint(world):
    out = _run(world, "pool_cross_task")
    assert out["rollback"] != "done" or out["a_after"] == 0.0, out


def test_the_runner_skeleton_survives_opt_games_and_a_checkpoint(world):
    out = _run(world, "runner_after_opt_games")
    assert "rc=0" in out["set"], out
    assert out["reward_wrong"] == 0.0 and out["reward_right"] == 1.0 and out["fork_wrong"] == 0.0, out
