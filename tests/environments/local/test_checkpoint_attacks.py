"""Red-team attacks on Episode.checkpoint(), rollback() and fork()
(:mod:`sequester.environments.local.checkpoint`), on real sandboxes of the busybox image.

Each test runs one scenario of HARNESS in a child Python (as test_checkpoint.py does) and
asserts the feature's promise holds. Every one was a WIN of the red team's first round on
the feature (reward 1 for no work through a race on the runner's path, a verifier run in
a decoy folder, an unbounded copy of the agent's logs, a disk cap dodged, a checkpoint
that stopped its episode or leaked): each now holds, and fails without its guard.
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
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <fcntl.h>
#include <errno.h>
#include <sys/xattr.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/shm.h>
#include <sys/file.h>
static int abstract(const char *name, struct sockaddr_un *a) {
    memset(a, 0, sizeof *a); a->sun_family = AF_UNIX;
    strncpy(a->sun_path + 1, name, sizeof a->sun_path - 2);
    return offsetof(struct sockaddr_un, sun_path) + 1 + strlen(name);
}
int main(int argc, char **argv) {
    char buf[256];
    if (argc < 2) return 2;
    if (strstr(argv[0], "bash")) {  /* a fake runner's bash: the verdict it would like */
        int fd = open("/logs/verifier/reward.txt", O_CREAT | O_WRONLY | O_TRUNC, 0644);
        if (fd >= 0) { write(fd, "1\n", 2); close(fd); }
        return 0;
    }
    const char *op = argv[1];
    if (!strcmp(op, "set") && argc == 5) {
        if (setxattr(argv[2], argv[3], argv[4], strlen(argv[4]), 0)) { printf("set-fail:%s\n", strerror(errno)); return 1; }
        puts("set-ok"); return 0;
    }
    if (!strcmp(op, "get") && argc == 4) {
        ssize_t n = getxattr(argv[2], argv[3], buf, sizeof buf - 1);
        if (n < 0) { puts("-"); return 0; }
        buf[n] = 0; puts(buf); return 0;
    }
    if (!strcmp(op, "atime") && argc == 3) {
        struct stat st; if (lstat(argv[2], &st)) { puts("-"); return 1; }
        printf("%ld.%09ld\n", (long)st.st_atim.tv_sec, st.st_atim.tv_nsec); return 0;
    }
    if (!strcmp(op, "listen") && argc == 3) {
        struct sockaddr_un a; int l = abstract(argv[2], &a);
        int s = socket(AF_UNIX, SOCK_STREAM, 0);
        if (bind(s, (struct sockaddr *)&a, l) || listen(s, 4)) { perror("bind"); return 1; }
        for (;;) { int c = accept(s, 0, 0); if (c >= 0) { write(c, "secret\n", 7); close(c); } }
    }
    if (!strcmp(op, "connect") && argc == 3) {
        struct sockaddr_un a; int l = abstract(argv[2], &a);
        int s = socket(AF_UNIX, SOCK_STREAM, 0);
        if (connect(s, (struct sockaddr *)&a, l)) { puts("refused"); return 0; }
        ssize_t n = read(s, buf, sizeof buf - 1); buf[n > 0 ? n : 0] = 0; printf("connected:%s", buf); return 0;
    }
    if (!strcmp(op, "shmset") && argc == 4) {
        int id = shmget(atoi(argv[2]), 4096, IPC_CREAT | 0666); if (id < 0) { perror("shmget"); return 1; }
        char *p = shmat(id, 0, 0); strcpy(p, argv[3]); puts("shm-set"); return 0;
    }
    if (!strcmp(op, "shmget") && argc == 3) {
        int id = shmget(atoi(argv[2]), 0, 0); if (id < 0) { puts("-"); return 0; }
        char *p = shmat(id, 0, SHM_RDONLY); printf("%s\n", p); return 0;
    }
    if (!strcmp(op, "hold") && argc == 3) {
        int fd = open(argv[2], O_RDONLY); if (fd < 0) { perror("open"); return 1; }
        if (flock(fd, LOCK_EX)) { perror("lock"); return 1; }
        puts("held"); fflush(stdout); sleep(600); return 0;
    }
    if (!strcmp(op, "try") && argc == 3) {
        int fd = open(argv[2], O_RDONLY);
        printf("%s\n", flock(fd, LOCK_EX | LOCK_NB) == 0 ? "free" : "locked"); return 0;
    }
    if (!strcmp(op, "flip") && argc == 5) {  /* flip link argv[2] between targets argv[3] and argv[4] */
        char tmp[512]; snprintf(tmp, sizeof tmp, "%s.flip", argv[2]);
        for (unsigned long i = 0;; i++) {
            unlink(tmp);
            if (symlink(argv[3 + (i & 1)], tmp) || rename(tmp, argv[2])) { perror("flip"); return 1; }
        }
    }
    if (!strcmp(op, "files") && argc == 4) {
        int n = atoi(argv[3]); for (int i = 0; i < n; i++) {
            snprintf(buf, sizeof buf, "%s/f%d", argv[2], i);
            int fd = open(buf, O_CREAT | O_WRONLY, 0644); if (fd < 0) { perror("open"); return 1; } close(fd);
        }
        puts("files-ok"); return 0;
    }
    return 2;
}
"""

HARNESS = r'''
import glob, json, os, sys, time
from pathlib import Path
from sequester.environments.local import checkpoint as checkpoints
from sequester.environments.local.checkpoint import CheckpointError, tree_bytes
from sequester.environments.local.episode import Episode
from sequester.environments.settings import EpisodeSettings
from sequester.images import ImageSettings, ImageStore

rootfs, tasks, store, helper, scenario = sys.argv[1:6]
tasks = Path(tasks)
images = ImageSettings(store_dir=store, source="prebuilt")
ImageStore(images).import_source(rootfs, "test/busybox:ck")
H = "/usr/local/bin/h"
out = {}


def episode(task="abs", **kw):
    ep = Episode(EpisodeSettings(images=images, **kw))
    ep.reset(tasks / task)
    ep.write_file(H, Path(helper).read_bytes(), 0o755)
    return ep


def mine():
    return sorted(glob.glob(f"{EpisodeSettings().state_dir}/{os.getpid()}-ckpt-*"))


DECOY = "mkdir -p /tmp/decoy && echo hello > /tmp/decoy/out.txt && cd /tmp/decoy"


def verifier_cwd():
    """The tests read out.txt relative to their working directory (the task's /app)."""
    for name in ("rel", "sep"):
        with episode(name) as ep:
            ep.exec(DECOY)
            out[f"{name}_plain"] = ep.evaluate().reward
        with episode(name) as ep:
            ep.exec(DECOY)
            cp = ep.checkpoint()
            out[f"{name}_workdir_after_checkpoint"] = ep.workdir
            out[f"{name}_after_checkpoint"] = ep.evaluate().reward
            ep.exec("cd /app")
            ep.rollback(cp)
            out[f"{name}_after_rollback"] = ep.evaluate().reward
            (f,) = ep.fork(cp, 1)
            with f:
                out[f"{name}_fork"] = f.evaluate().reward
            cp.release()
        # Not even a cd: the shell's $PWD is a variable the agent assigns.
        with episode(name) as ep:
            ep.exec("mkdir -p /tmp/decoy && echo hello > /tmp/decoy/out.txt && PWD=/tmp/decoy")
            out[f"{name}_forged_real_cwd"] = ep.exec("/bin/pwd").stdout.strip()
            cp = ep.checkpoint()
            out[f"{name}_forged"] = ep.evaluate().reward
            cp.release()


def logs_amplify():
    """/logs/agent is copied by the host into the checkpoint and into each fork, outside
    checkpoint_disk_mb, without holes."""
    with episode(checkpoint_disk_mb=1) as ep:
        out["setup"] = ep.exec("dd if=/dev/zero of=/logs/agent/real bs=1024 count=3072 2>/dev/null && "
                               "truncate -s 200M /logs/agent/sparse && du -k /logs/agent | tail -1").stdout
        try:
            cp = ep.checkpoint()
        except CheckpointError as exc:
            out["checkpoint"] = str(exc)
            return
        out["checkpoint"] = "made"
        out["ckpt_logs_bytes"] = tree_bytes(cp.logs)
        forks = ep.fork(cp, 2)
        try:
            out["fork_logs_bytes"] = [tree_bytes(f._running().dirs.root / "logs") for f in forks]
            out["held_bytes"] = checkpoints.held_bytes()
        finally:
            for f in forks:
                f.close()
            cp.release()


def logs_deep():
    """A deep folder chain in /logs/agent (the host copies it with recursive copytree)."""
    with episode() as ep:
        out["setup"] = ep.exec("cd /logs/agent && i=0; while [ $i -lt 700 ]; do mkdir d && cd d || exit 1; "
                               "i=$((i+1)); done; echo ok").stdout.strip()
        ep.exec("cd /app && echo precious > /app/work.txt")
        try:
            cp = ep.checkpoint()
            out["checkpoint"] = "made"
            cp.release()
        except CheckpointError as exc:
            out["checkpoint"] = "CheckpointError: " + str(exc)[:200]
        except Exception as exc:
            out["checkpoint"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        try:
            out["after"] = ep.exec("cat /app/work.txt").stdout
        except Exception as exc:
            out["after"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    out["left_behind"] = mine()


def tree_limit():
    """tree_bytes stops after `limit` entries and returns what it counted: enough empty
    files hide the rest of the layer from checkpoint_disk_mb. (limit scaled down from
    2,000,000 to 2,000 so the test is cheap; the agent needs 2M empty files at full scale.)"""
    tree_bytes.__kwdefaults__["limit"] = 2000
    with episode(checkpoint_disk_mb=1) as ep:
        out["setup"] = ep.exec(f"mkdir -p /app/fill/sub && {H} files /app/fill 2100 && "
                               "dd if=/dev/zero of=/app/fill/sub/big bs=1024 count=8192 2>/dev/null && "
                               "du -k /app/fill | tail -1").stdout
        try:
            cp = ep.checkpoint()
            out["checkpoint"] = "made"
            out["layer_bytes_counted"] = cp.layer_bytes
            tree_bytes.__kwdefaults__["limit"] = 10**9
            out["layer_bytes_real"] = tree_bytes(cp.layers[-1])
            cp.release()
        except CheckpointError as exc:
            out["checkpoint"] = str(exc)


def fork_channels():
    """Ways one fork could reach another through what they share (the sealed layer)."""
    with episode() as ep:
        ep.exec("echo data > /app/data.txt && echo bit > /app/bit && mkfifo /app/fifo")
        time.sleep(0.05)
        cp = ep.checkpoint()
        forks = ep.fork(cp, 2)
        try:
            a, b = forks
            # atime of a sealed-layer file: B watches, A reads.
            t0 = b.exec(f"{H} atime /app/bit").stdout.strip()
            a.exec("cat /app/bit >/dev/null")
            t1 = b.exec(f"{H} atime /app/bit").stdout.strip()
            out["atime_seen_by_b"] = [t0, t1]
            out["atime_seen_by_parent"] = ep.exec(f"{H} atime /app/bit").stdout.strip()
            # a FIFO in the sealed layer
            a.exec("(echo secret > /app/fifo &) ; sleep 0.2")
            out["fifo"] = b.exec("timeout 2 cat /app/fifo 2>/dev/null; true").stdout
            # abstract unix socket, SysV shm, flock on a sealed file, /dev/shm
            a.exec(f"({H} listen seqx >/dev/null 2>&1 &); {H} shmset 4242 secret; "
                   f"({H} hold /app/data.txt >/dev/null &); echo fork-a > /dev/shm/x; sleep 0.3")
            out["a_self"] = a.exec(f"{H} connect seqx; {H} shmget 4242; {H} try /app/data.txt").stdout
            out["b_sees"] = b.exec(f"{H} connect seqx; {H} shmget 4242; {H} try /app/data.txt; "
                                   "cat /dev/shm/x 2>/dev/null || echo no-shm-file").stdout
        finally:
            for f in forks:
                f.close()
            cp.release()


def overlay_xattrs():
    """overlayfs's own xattrs, escaped ones, a whiteout made with mknod: what the agent's
    layer says once it is a lower layer of the next overlay."""
    show = (f"ls /etc | wc -l; ls /bin | wc -l; ls /bin/ls; ls -l /app/wh 2>&1 | cut -c1-10; "
            f"{H} get /etc user.overlay.overlay.opaque; {H} get /bin user.overlay.overlay.opaque; "
            f"{H} get /bin/sh user.overlay.overlay.whiteout; cat /app/x 2>&1")
    with episode() as ep:
        out["set"] = ep.exec(
            f"mkdir -p /app; echo x > /app/x; {H} set /etc user.overlay.opaque y; {H} set /etc user.overlay.overlay.opaque y; "
            f"{H} set /bin user.overlay.overlay.opaque x; {H} set /bin/sh user.overlay.overlay.whiteout y; "
            f"{H} set /app/x user.overlay.redirect /etc/passwd; {H} set /app/x user.overlay.overlay.redirect /etc/passwd; "
            f"{H} set /app/x user.overlay.metacopy y; {H} set /app/x trusted.overlay.opaque y; "
            "mknod /app/wh c 0 0; echo mknod=$?").stdout
        out["before"] = ep.exec(show).stdout
        cp = ep.checkpoint()
        layer = cp.layers[-1]
        out["sealed_xattrs"] = {p: sorted(os.listxattr(layer / p, follow_symlinks=False))
                                for p in ("etc", "bin", "app/x") if (layer / p).exists()}
        out["after"] = ep.exec(show).stdout
        (f,) = ep.fork(cp, 1)
        with f:
            out["fork"] = f.exec(show).stdout
        cp.release()


def runner_link():
    """/opt (the runner's folder's parent, made in the writable layer when the image has
    none) replaced before the checkpoint, so the sealed layer has a link at the runner's
    mount point: the verdict after a rollback."""
    with episode() as ep:
        out["set"] = ep.exec("echo nope > /app/out.txt; mv /opt /opt.old && mkdir /opt && mkdir -p /tmp/fake/bin && "
                             "ln -s /tmp/fake /opt/sequester-verifier; echo rc=$?").stdout
        try:
            cp = ep.checkpoint()
        except Exception as exc:
            out["checkpoint"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            try:
                out["after"] = ep.exec("cat /app/out.txt").stdout
            except Exception as exc2:
                out["after"] = f"{type(exc2).__name__}: {str(exc2)[:200]}"
            return
        out["checkpoint"] = "made"
        out["view"] = ep.exec("readlink /opt/sequester-verifier; ls /opt/sequester-verifier/bin | head -2").stdout
        out["reward_wrong"] = ep.evaluate().reward
        ep.exec("echo hello > /app/out.txt")
        out["reward_right"] = ep.evaluate().reward
        cp.release()


def runner_race():
    """/opt/sequester-verifier sealed as a relative link (../rr): the next start's bwrap
    mounts the runner at /rr through it, the init and the verifier's checks follow it, and
    the link is the agent's to replace while the verifier runs (freeze_agent is off by
    default): flipped between ../rr and a fake runner whose bash writes reward 1."""
    with episode() as ep:
        out["set"] = ep.exec("mv /opt /opt.old && mkdir /opt /rr && ln -s ../rr /opt/sequester-verifier; echo rc=$?").stdout
        try:
            cp = ep.checkpoint()
        except Exception as exc:
            out["checkpoint"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            return
        out["checkpoint"] = "made"
        out["view"] = ep.exec("readlink /opt/sequester-verifier; ls /rr/bin | grep -c .; "
                              "grep -c ' /rr ' /proc/self/mountinfo").stdout
        ep.exec(f"mkdir -p /fake/bin /fake/run /fake/lib && cp {H} /fake/bin/bash && cp {H} /fake/lib/ld-linux-x86-64.so.2 && "
                f"({H} flip /opt/sequester-verifier ../rr /fake >/dev/null 2>&1 &) ; sleep 0.2")
        rewards = []
        for _ in range(60):
            try:
                r = ep.evaluate()
                rewards.append(r.reward)
                out.setdefault("reasons", []).append(str(getattr(r, "zero_reason", ""))[:120])
            except Exception as exc:
                rewards.append(type(exc).__name__)
            if rewards[-1] == 1.0:
                break
        out["rewards_for_no_work"] = rewards
        cp.release()


def runner_race_plain():
    """The control: the same race with no checkpoint (/opt renamed with the runner's mount
    in it, a link to it at the runner's path)."""
    with episode() as ep:
        out["set"] = ep.exec("mv /opt /opt.old && mkdir /opt && ln -s ../opt.old/sequester-verifier "
                             "/opt/sequester-verifier; echo rc=$?").stdout
        out["view"] = ep.exec("ls /opt/sequester-verifier/bin | grep -c .").stdout
        ep.exec(f"mkdir -p /fake/bin /fake/run /fake/lib && cp {H} /fake/bin/bash && cp {H} /fake/lib/ld-linux-x86-64.so.2 && "
                f"({H} flip /opt/sequester-verifier ../opt.old/sequester-verifier /fake >/dev/null 2>&1 &) ; sleep 0.2")
        rewards = []
        for _ in range(60):
            try:
                rewards.append(ep.evaluate().reward)
            except Exception as exc:
                rewards.append(type(exc).__name__)
            if rewards[-1] == 1.0:
                break
        out["rewards_for_no_work"] = rewards


def poison_workdir():
    """The shell's $PWD (an agent's variable) becomes the restarted shell's working
    directory and the episode's workdir: one the next start cannot make."""
    with episode() as ep:
        ep.exec("echo precious > /app/work.txt; PWD=/" + "a" * 300)
        before = mine()
        try:
            cp = ep.checkpoint()
            out["checkpoint"] = "made"
            cp.release()
        except Exception as exc:
            out["checkpoint"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        try:
            out["after"] = ep.exec("cat /app/work.txt").stdout
        except Exception as exc:
            out["after"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        out["new_folders"] = [p for p in mine() if p not in before]
    out["left_after_close"] = mine()
    out["held_bytes_after_close"] = checkpoints.held_bytes()


globals()[scenario]()
print(json.dumps(out))
'''

REL_TEST = ("test \"$(cat out.txt 2>/dev/null)\" = hello && echo 1 > /logs/verifier/reward.txt "
            "|| echo 0 > /logs/verifier/reward.txt\n")
ABS_TEST = REL_TEST.replace("cat out.txt", "cat /app/out.txt")


def _task(root: Path, name: str, test: str, verifier: str = "") -> None:
    task = root / name
    for sub in ("tests", "environment", "solution"):
        (task / sub).mkdir(parents=True)
    (task / "instruction.md").write_text("Write hello to /app/out.txt.\n")
    (task / "task.toml").write_text(f'version = "1.0"\n[verifier]\ntimeout_sec = 60\n{verifier}[agent]\n'
                                    'timeout_sec = 600\n[environment]\ndocker_image = "test/busybox:ck"\n'
                                    'workdir = "/app"\n')
    (task / "environment" / "Dockerfile").write_text("FROM scratch\n")
    (task / "tests" / "test.sh").write_text(test)
    (task / "solution" / "solve.sh").write_text("echo hello > /app/out.txt\n")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    skip_unless_tools("skopeo", "gcc")
    root = tmp_path_factory.mktemp("ckattack")
    tasks = root / "tasks"
    _task(tasks, "abs", ABS_TEST)
    _task(tasks, "rel", REL_TEST)
    _task(tasks, "sep", REL_TEST, 'environment_mode = "separate"\n')
    (root / "h.c").write_text(HELPER_C)
    subprocess.run(["gcc", "-static-pie", "-O1", "-o", str(root / "h"), str(root / "h.c")], check=True,
                   capture_output=True)
    (root / "harness.py").write_text(HARNESS)
    return root


def _run(world: Path, scenario: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.run([sys.executable, str(world / "harness.py"), str(busybox_rootfs()), str(world / "tasks"),
                           str(world / "store"), str(world / "h"), scenario],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(out, indent=1))
    return out


# ---------------------------------------------------------------------------------------


def test_verifier_cwd_is_the_tasks_not_the_agents_shells(world):
    out = _run(world, "verifier_cwd")
    assert out["rel_plain"] == 0.0 and out["sep_plain"] == 0.0, out  # the control: the decoy is not read
    assert out["rel_forged_real_cwd"] == "/app", out
    for name in ("rel", "sep"):
        for when in ("after_checkpoint", "after_rollback", "fork", "forged"):
            assert out[f"{name}_{when}"] == 0.0, (name, when, out)


def test_agent_logs_copy_is_bounded(world):
    out = _run(world, "logs_amplify")
    if out["checkpoint"] != "made":
        assert "checkpoint_disk_mb" in out["checkpoint"]
        return
    cap = 1 << 20
    assert out["ckpt_logs_bytes"] <= cap, out
    assert all(b <= cap for b in out["fork_logs_bytes"]), out


def test_deep_agent_logs_leave_the_episode_as_it_was(world):
    out = _run(world, "logs_deep")
    assert out["setup"] == "ok", out
    assert out["checkpoint"] == "made" or out["checkpoint"].startswith("CheckpointError"), out
    assert out["after"] == "precious\n", out
    assert out["left_behind"] == [], out


def test_disk_bound_cannot_be_dodged_with_many_entries(world):
    out = _run(world, "tree_limit")
    assert "files-ok" not in out["setup"] or out["checkpoint"] != "made", out


def test_forks_share_no_channel(world):
    """FIFO, abstract socket, SysV shm, flock on a sealed file, /dev/shm and the sealed
    inode's atime (overlayfs opens lower files O_NOATIME): all held."""
    out = _run(world, "fork_channels")
    # The other channels (these hold):
    assert out["fifo"] == "", out
    assert out["a_self"] == "connected:secret\nsecret\nlocked\n", out
    assert out["b_sees"] == "refused\n-\nfree\nno-shm-file\n", out
    t0, t1 = out["atime_seen_by_b"]
    assert t0 == t1, out


def test_overlay_xattrs_and_whiteouts_change_nothing_when_sealed(world):
    out = _run(world, "overlay_xattrs")
    # The overlay's own names are refused to the agent; escaped ones are stored escaped once more.
    # Only trusted.* is refused; every user.overlay.* name the agent sets is stored escaped
    # once more (kernel >= 6.7), so nothing unescaped reaches the sealed layer.
    assert out["set"].count("set-fail") == 1 and "mknod=1" in out["set"], out
    assert out["after"] == out["before"], out
    assert out["fork"] == out["before"], out
    assert "user.overlay.opaque" not in out["sealed_xattrs"].get("etc", []), out
    assert not {"user.overlay.redirect", "user.overlay.metacopy"} & set(out["sealed_xattrs"].get("app/x", [])), out


def test_runner_mount_point_replaced_before_a_checkpoint(world):
    out = _run(world, "runner_link")
    assert out["checkpoint"] == "made" or out["checkpoint"].startswith("CheckpointError"), out
    assert out.get("after", "nope\n") == "nope\n", out
    assert out["reward_wrong"] == 0.0 and out["reward_right"] == 1.0, out


def test_runner_mount_point_sealed_as_a_link_cannot_be_raced(world):
    out = _run(world, "runner_race")
    if out["checkpoint"] != "made":
        return
    assert all(r == 0.0 for r in out["rewards_for_no_work"]), out


def test_runner_race_without_a_checkpoint(world):
    out = _run(world, "runner_race_plain")
    assert "rc=0" not in out["set"], out  # /opt is the runner skeleton's: it cannot be renamed
    assert all(r == 0.0 for r in out["rewards_for_no_work"]), out


def test_forged_shell_directory_cannot_poison_a_checkpoint(world):
    out = _run(world, "poison_workdir")
    assert out["checkpoint"] == "made" or out["checkpoint"].startswith("CheckpointError"), out
    assert out["after"] == "precious\n", out
    assert out["left_after_close"] == [] and out["held_bytes_after_close"] == 0, out
