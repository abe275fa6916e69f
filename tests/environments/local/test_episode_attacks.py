"""Red team of host-mode episodes (:mod:`sequester.environments.local.episode`), after the
/proc, /dev, cgroup and verdict fixes.
Each attack passes while its protection holds. Nothing here writes a kernel setting: a
file opened for append with nothing written is the probe; every process count is bounded
by the test itself. Two attacks by programs the tests run on the reward file won until the
test script's own reward writes were captured (their docstrings say how)."""

from __future__ import annotations

import os
import re
import time

import pytest
from tasks import make_task

from sequester.environments.local.episode import Episode
from sequester.environments.settings import EpisodeSettings

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="the agent is host uid 0 only for a root caller")

# Other ways to a /proc/sys file than /proc/sys itself, and /sys beyond the bound cpu folder.
OTHER_PATHS = r'''
for f in /proc/1/root/proc/sys/kernel/core_pattern /proc/self/root/proc/sys/kernel/core_pattern \
         /proc/self/task/*/root/proc/sys/vm/drop_caches /proc/1/cwd/proc/sys/kernel/core_pattern \
         /proc/thread-self/root/proc/sys/kernel/core_pattern /proc/sys/net/ipv4/ip_forward \
         /proc/sys/fs/binfmt_misc/register /proc/sysrq-trigger /dev/core /proc/kcore; do
  [ -e $f ] && ( : >> $f ) 2>/dev/null && echo WRITABLE $f
done
find /sys -type f 2>/dev/null | head -5000 | while read -r f; do ( : >> "$f" ) 2>/dev/null && echo WRITABLE $f; done
unshare -m true 2>/dev/null && echo UNSHARED
unshare -pf --mount-proc true 2>/dev/null && echo UNSHARED
for t in "-t proc proc" "-t sysfs sysfs" "-t cgroup2 cgroup2" "-t cgroup -o pids cgroup" "--bind /proc/sys"; do
  mount $t /mnt 2>/dev/null && echo MOUNTED $t
done
umount /proc/sys 2>/dev/null && echo UNMOUNTED
echo done
'''


def test_no_other_path_reaches_a_writable_kernel_setting(tmp_path, episode):
    episode.reset(make_task(tmp_path))
    out = episode.exec(OTHER_PATHS, timeout=120).stdout
    assert out.split()[-1:] == ["done"] and "WRITABLE" not in out and "MOUNTED" not in out \
        and "UNSHARED" not in out and "UNMOUNTED" not in out, out


def test_nor_for_the_programs_the_tests_run(tmp_path, episode):
    test_sh = (f"cat > /tmp/probe.sh <<'EOF'\n{OTHER_PATHS}EOF\n"
               "bash /tmp/probe.sh > /logs/verifier/probe.txt 2>&1\n"
               "if grep -qE 'WRITABLE|MOUNTED|UNSHARED' /logs/verifier/probe.txt; then echo 0; else echo 1; fi"
               " > /logs/verifier/reward.txt\n")
    episode.reset(make_task(tmp_path, test_sh=test_sh, verifier_timeout=120))
    result = episode.evaluate()
    assert result.reward == 1.0, result.files.get("probe.txt")


def test_the_host_device_nodes_stay_untouched_by_any_path(tmp_path, episode):
    """/dev/tty, /dev/full, ... by their names and through /dev/fd of an open one; the
    pts and shm of the view are its own (a touch there is fine)."""
    watched = ("/dev/null", "/dev/tty", "/dev/full", "/dev/zero", "/dev/random", "/dev/urandom")
    before = {p: os.stat(p) for p in watched}
    episode.reset(make_task(tmp_path))
    episode.exec("for f in null tty full zero random urandom; do touch -c /dev/$f; chmod 600 /dev/$f;"
                 " chown 1:1 /dev/$f; done 2>/dev/null; exec 9</dev/full; touch -c /dev/fd/9 /proc/self/fd/9 2>/dev/null;"
                 " ln /dev/null /tmp/hl 2>/dev/null; chmod 600 /tmp/hl 2>/dev/null; true")
    for p in watched:
        now = os.stat(p)
        assert (now.st_mtime_ns, now.st_mode, now.st_uid, now.st_gid) == \
            (before[p].st_mtime_ns, before[p].st_mode, before[p].st_uid, before[p].st_gid), p


@root_only
def test_the_agent_and_its_init_stay_in_their_cgroups(tmp_path):
    with Episode(EpisodeSettings(max_processes=60)) as ep:
        ep.reset(make_task(tmp_path, toml="[environment]\ncpus = 1\n"))
        out = ep.exec("ls /sys/fs/cgroup >/dev/null 2>&1 && echo CGROUPFS; ulimit -u unlimited 2>/dev/null && echo RAISED;"
                      " grep ^Seccomp: /proc/1/status; diff /proc/1/cgroup /proc/self/cgroup >/dev/null && echo SAME;"
                      " grep -c sequester- /proc/self/cgroup").stdout
    assert "CGROUPFS" not in out and "RAISED" not in out, out
    assert "Seccomp:\t2" in out and "SAME" in out and int(out.split()[-1]) >= 2, out


@root_only
def test_a_program_the_tests_run_cannot_fork_past_a_process_limit(tmp_path):
    """The verifier is not in the agent's cgroups, but it has a pids cgroup of its own: an
    agent program the tests run, trying 200 processes (bounded here), is stopped well short."""
    prog = ("import subprocess\nps = []\nfor _ in range(200):\n    try:\n        ps.append(subprocess.Popen(['sleep', '30']))\n"
            "    except OSError:\n        break\nprint(len(ps))\nfor p in ps:\n    p.kill(); p.wait()\n")
    test_sh = "python3 /app/prog.py > /logs/verifier/started.txt 2>&1\necho 1 > /logs/verifier/reward.txt\n"
    with Episode(EpisodeSettings(max_processes=60)) as ep:
        ep.reset(make_task(tmp_path, test_sh=test_sh, toml="[environment]\ncpus = 1\n"))
        ep.exec(f"cat > /app/prog.py <<'EOF'\n{prog}EOF")
        result = ep.evaluate()
    assert int(result.files["started.txt"].split()[-1]) < 150, result.files


@root_only
def test_the_tests_first_process_is_already_in_the_verifiers_pids_cgroup(tmp_path):
    """The move into the verifier's cgroup overlaps its set-up, but ends before its first
    process: test.sh's first command is counted there."""
    test_sh = "cat /proc/self/cgroup > /logs/verifier/cg.txt\necho 1 > /logs/verifier/reward.txt\n"
    with Episode(EpisodeSettings(max_processes=60)) as ep:
        ep.reset(make_task(tmp_path, test_sh=test_sh))
        for _ in range(3):
            lines = ep.evaluate().files["cg.txt"].decode().splitlines()
            pids = [line for line in lines if line.split(":")[1] == "pids"]
            assert pids and re.search(r"/sequester-\d+-v\d+$", pids[0]), lines


def test_stopped_and_traced_processes_do_not_hang_teardown(tmp_path):
    """Processes stopped, ptrace-stopped and ignoring every signal it can: closing the
    episode still takes seconds, not a wait per cgroup."""
    ep = Episode()
    ep.reset(make_task(tmp_path))
    ep.exec("for i in $(seq 20); do (trap '' TERM HUP INT; sleep 300) & done; "
            "setsid sleep 300 & kill -STOP $!; "
            "python3 -c 'import ctypes,os,time\npid=os.fork()\nif pid==0: time.sleep(300)\n"
            "ctypes.CDLL(None).ptrace(16,pid,None,None); time.sleep(300)' "
            "</dev/null >/dev/null 2>&1 & sleep 0.5")
    start = time.monotonic()
    ep.close()
    assert time.monotonic() - start < 5


_LENDER = r'''
import os, socket
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("\0rt2-verdict")
socket.send_fds(s, [b"x"], [os.open("/logs/verifier", os.O_RDONLY | os.O_DIRECTORY)])
s.recv(1)
'''
_REWRITER = r'''
import os, socket
l = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
l.bind("\0rt2-verdict"); l.listen(1)
c, _ = l.accept(); _, fds, _, _ = socket.recv_fds(c, 1, 1); c.send(b"k")
while True:
    try:
        fd = os.open("reward.txt", os.O_RDWR, dir_fd=fds[0])
        try:
            if os.pread(fd, 1, 0) == b"0":
                os.pwrite(fd, b"1\n", 0); os.ftruncate(fd, 2)
        finally:
            os.close(fd)
    except OSError:
        pass
'''


@pytest.mark.slow
def test_a_live_agent_process_cannot_rewrite_the_verdict(tmp_path):
    """The tests run an agent program (the lender); it hands an fd of /logs/verifier over an
    abstract unix socket (the verifier shares the agent's network namespace) to a process
    the agent left running (the rewriter), which is in the agent's PID namespace and so
    survives the end of the verifier's. The script writes 0 last; the rewriter turned it
    into 1 before the verifier read it (a strict xfail until the script's own reward
    writes were captured: sequester.sandbox.nsexec.capture)."""
    test_sh = "python3 /app/lender.py\necho 0 > /logs/verifier/reward.txt\n"
    rewards = []
    with Episode(EpisodeSettings()) as ep:
        for i in range(3):
            ep.reset(make_task(tmp_path / str(i), test_sh=test_sh))
            ep.exec(f"cat > /app/lender.py <<'EOF'\n{_LENDER}EOF\ncat > /tmp/r.py <<'EOF'\n{_REWRITER}EOF\n"
                    "setsid python3 /tmp/r.py </dev/null >/dev/null 2>&1 &\nsleep 0.5")
            rewards.append(ep.evaluate().reward)
    assert rewards == [0.0, 0.0, 0.0], rewards


_AFTER_END_WRITER = r'''
import os, signal, sys
for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
    signal.signal(s, signal.SIG_IGN)
if os.fork():
    os._exit(0)
os.setsid()
try:
    os.setgid(1000); os.setuid(1000)
except OSError:
    pass
fd = os.open("/logs/verifier/reward.txt", os.O_RDWR | os.O_CREAT, 0o666)
os.write(1, b"up"); os.close(1)
while os.pread(fd, 2, 0) != b"0\n":   # spins until the script has written its verdict
    pass                                 # (inotify is refused to the tests' programs)
os.pwrite(fd, b"1\n", 0); os.ftruncate(fd, 2)
'''


def test_a_writer_left_by_the_tests_dies_before_the_verdict(tmp_path):
    """A program the tests run leaves a writer behind in a session of its own, ignoring what
    it can, trying uid 1000 (refused: the verifier's user namespace maps uid 0 alone), and
    spinning until the script has written its verdict (a pidfd of the shell no longer names
    anything, the shell being in no namespace the tests' programs see, and inotify is
    refused), to rewrite it before the shell exits and the kernel kills the tests'
    namespace with it. It won (a strict xfail) until the script's own reward writes were
    captured where no program of the tests can reach them (sequester.sandbox.nsexec.capture)."""
    test_sh = "test \"$(python3 /app/w.py $$)\" = up || exit 3\necho 0 > /logs/verifier/reward.txt\n"
    results = []
    with Episode(EpisodeSettings()) as ep:
        for i in range(5):
            ep.reset(make_task(tmp_path / str(i), test_sh=test_sh))
            ep.exec(f"cat > /app/w.py <<'EOF'\n{_AFTER_END_WRITER}EOF")
            r = ep.evaluate()
            results.append((r.exit_code, r.reward))
    assert results == [(0, 0.0)] * 5, results


_RELINKER = r"""
import os, shutil
shutil.rmtree("/logs/verifier")
os.makedirs("/tmp/x", exist_ok=True)
os.symlink("/tmp/x", "/logs/verifier")
"""


def test_a_linked_away_verdict_folder_is_never_read(tmp_path):
    """A program the tests run replaces /logs/verifier with a link to the agent's /tmp,
    where a process the agent left running writes reward.txt = 1 without end: the
    verifier reads no file through the link; the script's own write (0) is the verdict."""
    test_sh = "python3 /app/relink.py\necho 0 > /logs/verifier/reward.txt\n"
    with Episode(EpisodeSettings()) as ep:
        ep.reset(make_task(tmp_path, test_sh=test_sh))
        ep.exec(f"cat > /app/relink.py <<'EOF'\n{_RELINKER}EOF\n"
                "mkdir -p /tmp/x; (while :; do echo 1 > /tmp/x/reward.txt; done) </dev/null >/dev/null 2>&1 &")
        result = ep.evaluate()
    assert result.reward == 0.0 and result.files.get("reward.txt") == b"0\n", result
