"""Episodes against real sandboxes: lifecycle, the agent's view, the shell, the verifier."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import tempfile
import threading
import time
from pathlib import Path

import pytest

from sequester.agents import load_agent
from sequester.episodes.episode import Episode, EpisodeError
from sequester.episodes.settings import EpisodeSettings
from sequester.episodes.verifier import RewardFileMissing, RewardInvalid, VerifierCouldNotRun
from sequester.errors import TaskError
from sequester.tasks import find_tasks

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "tasks"
pytestmark = pytest.mark.skipif(os.geteuid() != 0 and not Path("/proc/self/ns/user").exists(), reason="needs namespaces")


def make_task(root: Path, name: str = "t", test_sh: str = "echo 1 > /logs/verifier/reward.txt\n", *,
              dockerfile: str = "FROM debian:12\nWORKDIR /app\n", toml: str = "", files: dict | None = None,
              verifier_timeout: float = 30) -> Path:
    task = root / name
    (task / "tests").mkdir(parents=True)
    (task / "environment").mkdir()
    (task / "solution").mkdir()
    (task / "instruction.md").write_text("Do the thing.\n")
    (task / "task.toml").write_text(f'version = "1.0"\n[verifier]\ntimeout_sec = {verifier_timeout}\n' + toml)
    (task / "environment" / "Dockerfile").write_text(dockerfile)
    (task / "tests" / "test.sh").write_text(test_sh)
    (task / "solution" / "solve.sh").write_text("echo solved\n")
    for rel, content in (files or {}).items():
        (task / rel).parent.mkdir(parents=True, exist_ok=True)
        (task / rel).write_text(content)
    return task


def tree_hash(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        digest.update(str(path.relative_to(root)).encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


@pytest.fixture
def episode():
    ep = Episode()
    yield ep
    ep.close()


# -- example tasks: the oracle solves each, nop solves none -----------------------------------


@pytest.mark.parametrize("task", sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir()))
def test_oracle_scores_one_and_nop_zero(task):
    before = tree_hash(EXAMPLES / task)
    for agent, expected in (("oracle", 1.0), ("nop", 0.0)):
        with Episode() as ep:
            ep.reset(EXAMPLES / task)
            load_agent(agent).run(ep.instruction, ep)
            result = ep.evaluate()
            assert result.reward == expected, result.output[-2000:]
            assert result.tampering == ()
    assert tree_hash(EXAMPLES / task) == before  # the source task is never modified


def test_workdir_comes_from_the_dockerfile_and_can_be_overridden(episode):
    episode.reset(EXAMPLES / "workspace-git-free")
    assert episode.workdir == "/workspace/project"
    assert episode.exec("pwd").stdout == "/workspace/project\n"
    assert "textkit" in episode.exec("ls").stdout
    episode.reset(EXAMPLES / "workspace-git-free", workdir="/srv/elsewhere")
    r = episode.exec("pwd")
    assert r.stdout == "/srv/elsewhere\n", r


def test_without_workdir_the_agent_works_at_the_task_path_without_its_files(tmp_path, episode):
    task = make_task(tmp_path, dockerfile="FROM debian:12\n", files={"tests/secret.txt": "nope"})
    episode.reset(task)
    assert episode.workdir == str(task)
    r = episode.exec("pwd; ls -A; echo made > here.txt; cat here.txt")
    assert r.stdout == f"{task}\nmade\n", r
    assert not (task / "here.txt").exists()  # the host's task folder is untouched


def test_bad_task_is_a_clear_error(tmp_path, episode):
    task = make_task(tmp_path)
    (task / "instruction.md").unlink()
    with pytest.raises(TaskError, match="instruction.md"):
        episode.reset(task)
    with pytest.raises(EpisodeError):
        episode.exec("true")


# -- the agent's view ------------------------------------------------------------------------


def test_no_tests_or_solution_anywhere_in_the_view(tmp_path, episode):
    marker = "SECRET-EXPECTED-OUTPUT-7f3a"
    task = make_task(tmp_path, test_sh=f"# {marker}\necho 1 > /logs/verifier/reward.txt\n",
                     files={"solution/answer.txt": marker, "tests/test_outputs.py": f"# {marker}\n"})
    episode.reset(task)
    r = episode.exec(f"grep -rl --exclude-dir=proc --exclude-dir=sys {marker} / 2>/dev/null | head; "
                     "find / -xdev \\( -name test_outputs.py -o -name solve.sh \\) 2>/dev/null | head", timeout=120)
    assert marker not in r.stdout and "test_outputs.py" not in r.stdout and "solve.sh" not in r.stdout, r.stdout
    assert (task / "tests" / "test_outputs.py").read_text()  # control: the host has them
    assert episode.exec(f"ls {task}").exit_code != 0
    assert episode.exec("ls -A /tests /logs").stdout.split() == ["/logs:", "/tests:"]


def test_verifier_mount_points_cannot_be_planted_or_replaced(episode):
    episode.reset(EXAMPLES / "python-csv-stats")
    r = episode.exec("echo x > /tests/conftest.py; mkdir -p /logs/verifier; rm -rf /tests; mv /tests /t; "
                     "ln -s /tmp /tests; umount /tests; echo done")
    assert r.stdout == "done\n"
    assert "Read-only file system" in r.stderr and "Device or resource busy" in r.stderr
    assert episode.exec("ls -A /tests /logs").stdout.split() == ["/logs:", "/tests:"]


# An episode mounts the Python installation that runs it back read-only; with Debian's own
# python3 that installation is /usr, so the agent cannot write /usr at all; and an ordinary
# user's agent cannot write the system's root-owned folders (README).
writable_usr = pytest.mark.skipif(
    os.geteuid() != 0 or any(f"{Path(p).resolve()}/".startswith("/usr/") for p in {sys.prefix, sys.base_prefix}),
    reason="the agent can write /usr only when sequester runs as root from a Python installed outside /usr")


@writable_usr
def test_writes_stay_in_the_episode(tmp_path):
    probe = f"seq-probe-{os.getpid()}"
    with Episode() as ep:
        ep.reset(EXAMPLES / "python-csv-stats")
        r = ep.exec(f"echo hi > /usr/local/bin/{probe} && echo hi > /etc/{probe} && rm -f /etc/hostname && "
                    f"cat /usr/local/bin/{probe}")
        assert r.stdout == "hi\n" and r.exit_code == 0
        assert ep.exec("test -e /etc/hostname").exit_code == 1
    assert not Path(f"/usr/local/bin/{probe}").exists() and not Path(f"/etc/{probe}").exists()
    assert Path("/etc/hostname").exists()
    with Episode() as ep:
        ep.reset(EXAMPLES / "python-csv-stats")
        assert ep.exec(f"test -e /usr/local/bin/{probe}").exit_code == 1  # nothing leaks to the next episode
        assert ep.exec("test -e /etc/hostname").exit_code == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="root's rule")
def test_root_secrets_and_other_homes_are_hidden(episode):
    episode.reset(EXAMPLES / "python-csv-stats")
    assert Path("/etc/shadow").read_text()  # control
    assert episode.exec("cat /etc/shadow").stdout == ""
    assert episode.exec("ls -A /root").stdout.strip() in ("", ".pyenv")
    assert episode.exec("ls -A /home").stdout == ""


# -- the shell ---------------------------------------------------------------------------------


def test_shell_state_persists_and_timeouts_are_exact(episode):
    episode.reset(EXAMPLES / "python-csv-stats")
    episode.exec("cd /tmp && export GREETING=hello")
    assert episode.exec("pwd; echo $GREETING").stdout == "/tmp\nhello\n"
    started = time.monotonic()
    r = episode.exec("sleep 2; echo finished", timeout=10)  # no hidden shorter default
    assert r.stdout == "finished\n" and not r.timed_out and r.exit_code == 0
    r = episode.exec("sleep 30; echo never", timeout=1)
    assert r.timed_out and "never" not in r.stdout and 1 <= r.duration < 3
    r = episode.exec("trap '' INT; sleep 30", timeout=0.5)  # ignores ^C: killed
    assert r.timed_out and r.duration < 4
    assert episode.exec("echo $GREETING; pwd").stdout == "hello\n/tmp\n"  # the shell survived both
    assert time.monotonic() - started < 15


def test_background_processes_survive_execs(episode):
    episode.reset(EXAMPLES / "python-csv-stats")
    episode.exec("(while true; do date +%s%N >> /tmp/ticks; sleep 0.05; done) > /dev/null 2>&1 &")
    first = episode.exec("sleep 0.2; wc -l < /tmp/ticks").stdout
    time.sleep(0.5)
    assert int(episode.exec("wc -l < /tmp/ticks").stdout) > int(first)


def test_exit_in_the_shell_restarts_it(episode):
    episode.reset(EXAMPLES / "python-csv-stats")
    r = episode.exec("exit 3")
    assert r.exit_code is None and "exited" in r.note
    assert episode.exec("echo back; pwd").stdout == "back\n/app\n"


def test_stdout_and_stderr_and_exit_codes(episode):
    episode.reset(EXAMPLES / "python-csv-stats")
    r = episode.exec("echo out; echo err >&2; false")
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 1)
    big = episode.exec("head -c 3000000 /dev/zero | tr '\\0' x")
    assert len(big.stdout) == 3_000_000


def test_file_transfer(episode, tmp_path):
    episode.reset(EXAMPLES / "python-csv-stats")
    episode.write_file("/app/sub/data.bin", bytes(range(256)) * 10)
    assert episode.read_file("sub/data.bin") == bytes(range(256)) * 10
    assert episode.exec("wc -c < /app/sub/data.bin").stdout.strip() == "2560"
    (tmp_path / "up").mkdir()
    (tmp_path / "up" / "a.txt").write_text("A")
    episode.upload_dir(tmp_path / "up", "/opt/uploaded")
    assert episode.exec("cat /opt/uploaded/a.txt").stdout == "A"


def test_episode_time_bounds_every_exec(tmp_path, episode):
    episode.reset(make_task(tmp_path, toml="[agent]\ntimeout_sec = 1.5\n"))
    r = episode.exec("sleep 10", timeout=60)
    assert r.timed_out and r.duration < 3
    r = episode.exec("echo late", timeout=60)
    assert r.timed_out and "over" in r.note


# -- the verifier ------------------------------------------------------------------------------


@pytest.mark.parametrize("content, error", [
    ("reward.txt:nan", RewardInvalid), ("reward.txt:inf", RewardInvalid), ("reward.txt:1.5", RewardInvalid),
    ("reward.txt:-0.1", RewardInvalid), ("reward.txt:yes", RewardInvalid), ("reward.txt:", RewardInvalid),
    ('reward.json:{"reward": {"a": 1}}', RewardInvalid), ('reward.json:{"reward": true}', RewardInvalid),
    ('reward.json:{"a": 0.5, "b": 1}', RewardInvalid), ("reward.json:[1]", RewardInvalid),
    ('reward.json:{"reward": NaN}', RewardInvalid), ("none:", RewardFileMissing),
])
def test_rewards_are_read_strictly(tmp_path, episode, content, error):
    """An invalid or missing reward is the agent's 0 with the reason (its programs, run by
    the tests, could have caused it), never an error a trainer would drop."""
    name, _, value = content.partition(":")
    script = "true\n" if name == "none" else f"printf '%s' '{value}' > /logs/verifier/{name}\n"
    episode.reset(make_task(tmp_path, test_sh=script))
    result = episode.evaluate()
    assert result.rewards == {"reward": 0.0}
    assert result.zero_reason and ("neither" if error is RewardFileMissing else "") in result.zero_reason


def test_reward_json_wins_and_is_a_flat_dict(tmp_path, episode):
    script = "echo 0 > /logs/verifier/reward.txt\necho '{\"reward\": 0.75, \"style\": 1}' > /logs/verifier/reward.json\n"
    episode.reset(make_task(tmp_path, test_sh=script))
    result = episode.evaluate()
    assert result.rewards == {"reward": 0.75, "style": 1.0} and result.reward == 0.75


def test_tests_that_fail_are_a_zero_not_an_error(tmp_path, episode):
    episode.reset(make_task(tmp_path, test_sh="echo 'assert failed'\necho 0 > /logs/verifier/reward.txt\nexit 1\n"))
    result = episode.evaluate()
    assert result.reward == 0.0 and result.exit_code == 1 and "assert failed" in result.output


def test_a_failed_bootstrap_is_an_error_not_a_zero(tmp_path, episode):
    # TB2's script writes 0 whenever uvx fails; the runner saw uvx start but never pytest.
    script = ("uvx -p 3.99 -w pytest==8.4.1 pytest --ctrf /logs/verifier/ctrf.json /tests -rA\n"
              "if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n")
    episode.reset(make_task(tmp_path, test_sh=script))
    with pytest.raises(VerifierCouldNotRun, match="never started pytest") as err:
        episode.evaluate()
    assert "3.99" in err.value.output  # uv's own message is kept for the host


def test_an_agent_that_kills_pytest_gets_a_zero_not_an_error(tmp_path, episode):
    """The agent's program, run by the tests, kills pytest: no ctrf.json is written, but
    the runner had said pytest started, so this is the agent's 0, not a void."""
    tests = "import os, signal, subprocess\ndef test_it():\n    subprocess.run(['/app/solve'])\n"
    script = ("uvx -p 3.11 -w pytest==8.4.1 -w pytest-json-ctrf==0.3.5 pytest --ctrf /logs/verifier/ctrf.json "
              "/tests/test_outputs.py -rA\n"
              "if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n")
    episode.reset(make_task(tmp_path, test_sh=script, files={"tests/test_outputs.py": tests}))
    episode.exec("printf '#!/bin/sh\\nkill -9 $PPID\\n' > /app/solve && chmod +x /app/solve")
    result = episode.evaluate()
    assert result.reward == 0.0 and "ctrf.json" not in result.files


def test_verifier_timeout_is_the_agents_zero(tmp_path, episode):
    episode.reset(make_task(tmp_path, test_sh="sleep 30\necho 1 > /logs/verifier/reward.txt\n", verifier_timeout=1))
    started = time.monotonic()
    result = episode.evaluate()
    assert result.reward == 0.0 and "ran over its 1 s" in result.zero_reason
    assert time.monotonic() - started < 5


def test_pytest_fallback_without_test_sh(tmp_path, episode):
    task = make_task(tmp_path, files={"tests/test_things.py": "def test_ok():\n    assert open('/app/out').read() == 'ok'\n"})
    (task / "tests" / "test.sh").unlink()
    episode.reset(task)
    assert episode.evaluate().reward == 0.0
    episode.exec("printf ok > /app/out")
    assert episode.evaluate().reward == 1.0


def test_verifier_environment_is_scrubbed_and_private(tmp_path, episode):
    script = "env | sort > /logs/verifier/env.txt\nls /proc | grep -c '^[0-9]' > /logs/verifier/procs.txt\n" \
             "echo 1 > /logs/verifier/reward.txt\n"
    episode.reset(make_task(tmp_path, test_sh=script, dockerfile="FROM x\nWORKDIR /app\nENV FROM_IMAGE=yes\n"))
    episode.exec("export PYTEST_ADDOPTS=-p no:x PYTHONPATH=/evil LD_PRELOAD=/evil.so BASH_ENV=/evil.sh; "
                 "echo 'export INJECTED=1' > /root/.bashrc; sleep 300 &")
    result = episode.evaluate()
    env = result.files["env.txt"].decode()
    for name in ("PYTEST_ADDOPTS", "PYTHONPATH", "LD_PRELOAD", "BASH_ENV", "INJECTED"):
        assert name not in env
    assert "FROM_IMAGE=yes" in env and "UV_OFFLINE=1" in env and "UV_NO_CONFIG=1" in env
    assert "PATH=/opt/sequester-verifier/bin:" in env  # the runner's tools first
    # The verifier's own PID namespace: it sees its processes, not the agent's sleep.
    assert int(result.files["procs.txt"]) < 6


def test_freeze_stops_the_agent_during_the_verify_window(tmp_path, episode):
    script = "a=$(wc -l < /app/ticks); sleep 0.4; b=$(wc -l < /app/ticks)\n" \
             "if [ \"$a\" = \"$b\" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n"
    episode.reset(make_task(tmp_path, test_sh=script))
    episode.exec("(while true; do echo t >> /app/ticks; sleep 0.02; done) > /dev/null 2>&1 &")
    time.sleep(0.2)
    assert episode.evaluate(freeze=False).reward == 0.0  # control: the agent keeps writing
    frozen = episode.evaluate(freeze=True)
    assert frozen.reward == 1.0 and frozen.frozen
    count = int(episode.exec("wc -l < /app/ticks").stdout)
    time.sleep(0.3)
    assert int(episode.exec("wc -l < /app/ticks").stdout) > count  # thawed afterwards


@writable_usr
def test_tampering_is_reported_but_decides_nothing(tmp_path):
    """Tampering with what a naive verifier would run (a shadowing python3, a preload)
    is listed, and the verdict is the tests' own: the runner never runs the agent's."""
    task = make_task(tmp_path)
    with Episode() as ep:
        ep.reset(task)
        ep.exec("printf '#!/bin/sh\\nexit 0\\n' > /usr/local/bin/python3; chmod +x /usr/local/bin/python3; "
                "echo /lib/x86_64-linux-gnu/libc.so.6 > /etc/ld.so.preload")
        result = ep.evaluate()
        assert any("python3" in t for t in result.tampering)
        assert any("ld.so.preload" in t for t in result.tampering)
        assert result.reward == 1.0  # make_task's default test.sh writes 1


@pytest.mark.skipif(not Path("/bin").is_symlink(), reason="a merged-/usr system: /bin is a symlink")
def test_replacing_a_top_level_symlink_is_reported(tmp_path, episode):
    episode.reset(make_task(tmp_path))
    assert episode.tampering() == []
    episode.exec("rm /bin && mkdir /bin && printf '#!/usr/bin/sh\\nexit 0\\n' > /bin/bash && chmod +x /bin/bash")
    assert any("/bin" in t and "symlink" in t for t in episode.evaluate().tampering)


def test_concurrent_episodes_have_private_tests(tmp_path):
    tasks = [make_task(tmp_path, f"task{i}", f"cat /tests/secret > /logs/verifier/seen\necho 1 > /logs/verifier/reward.txt\n",
                       files={"tests/secret": f"secret-{i}"}) for i in range(6)]
    seen = {}

    def run(i):
        with Episode() as ep:
            ep.reset(tasks[i])
            seen[i] = ep.evaluate().files["seen"].decode()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {i: f"secret-{i}" for i in range(6)}


def test_close_leaves_nothing(tmp_path):
    ep = Episode()
    ep.reset(EXAMPLES / "http-kv-server")
    load_agent("oracle").run(ep.instruction, ep)
    init = ep.init_pid
    state = ep._run.dirs.root
    assert Path(f"/proc/{init}").exists() and state.exists()
    ep.close()
    assert not Path(f"/proc/{init}").exists() and not state.exists()
    with pytest.raises(EpisodeError):
        ep.exec("true")


HARNESS = r'''
import sys, json
from sequester.episodes.episode import Episode
from sequester.episodes.settings import EpisodeSettings
ep = Episode(EpisodeSettings(state_dir=sys.argv[2]))
ep.reset(sys.argv[1])
print(json.dumps({"init": ep.init_pid, "state": str(ep._run.dirs.root)}), flush=True)
ep.evaluate()
'''


def test_killing_the_host_mid_verify_leaves_no_process_and_no_tests(tmp_path):
    marker = "MIDVERIFY-SECRET-9c1d"
    task = make_task(tmp_path, test_sh=f"# {marker}\nsleep 0.3; cp /tests/test.sh /app/copy; sleep 30\n",
                     files={"tests/data.txt": marker})
    state_dir = tmp_path / "state"
    host = subprocess.Popen([sys.executable, "-c", HARNESS, str(task), str(state_dir)], stdout=subprocess.PIPE, text=True)
    info = json.loads(host.stdout.readline())
    time.sleep(1.0)  # the verifier is running (and copied the tests into the agent's layer? no: see below)
    verifier_pids = [p for p in _all_pids() if _cmdline(p).startswith("sleep 30")]
    assert verifier_pids
    host.send_signal(signal.SIGKILL)
    host.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (Path(f"/proc/{info['init']}").exists() or
                                           any(Path(f"/proc/{p}").exists() for p in verifier_pids)):
        time.sleep(0.05)
    assert not Path(f"/proc/{info['init']}").exists()
    assert not any(Path(f"/proc/{p}").exists() and _cmdline(p) for p in verifier_pids)
    # What the verifier wrote into the agent's layers is the task's own doing (it copied
    # test.sh into /app); the staged /tests lived only in the verifier's tmpfs.
    leftovers = [p for p in state_dir.rglob("*") if p.is_file() and marker in p.read_text(errors="ignore")
                 and p.name != "copy"]
    assert leftovers == []
    # The next start removes the dead episode's folder.
    with Episode(EpisodeSettings(state_dir=state_dir)) as ep:
        ep.reset(EXAMPLES / "python-csv-stats")
        assert not Path(info["state"]).exists()


def _all_pids():
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _cmdline(pid):
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_host_scratch_space_is_not_in_the_view(episode):
    marker = Path(tempfile.mkdtemp(prefix="seq-scratch-", dir="/var/tmp"))
    try:
        episode.reset(EXAMPLES / "python-csv-stats")
        assert marker.name not in episode.exec("ls -A /var/tmp").stdout
        assert episode.exec("echo x > /var/tmp/mine && cat /var/tmp/mine").stdout == "x\n"  # writable, private
        assert not Path("/var/tmp/mine").exists()
    finally:
        marker.rmdir()


SYSCALL_PROBE = r"""
import ctypes, errno, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(nr, *args):
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    return "ok" if r >= 0 else errno.errorcode[ctypes.get_errno()]
# x86_64 numbers: keyctl(KEYCTL_GET_KEYRING_ID, @u), bpf(BPF_PROG_LOAD, NULL), io_uring_setup(1, NULL),
# unshare(CLONE_NEWNS), mount(NULL, "/", NULL, 0, NULL), add_key
print(json.dumps({"keyctl": call(250, 0, -4, 0), "bpf": call(321, 5, 0, 0), "io_uring": call(425, 1, 0),
                  "unshare": call(272, 0x20000), "mount": call(165, 0, 0, 0, 0, 0)}))
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="syscall numbers are x86_64's")
def test_agent_seccomp_refuses_kernel_attack_surface(episode, tmp_path):
    probe_file = tmp_path / "probe.py"
    probe_file.write_text(SYSCALL_PROBE)
    control = json.loads(subprocess.run([sys.executable, str(probe_file)], capture_output=True, text=True).stdout)
    assert control["keyctl"] == "ok" and control["io_uring"] != "EPERM"  # the host may use them
    episode.reset(EXAMPLES / "python-csv-stats")
    episode.write_file("/tmp/probe.py", SYSCALL_PROBE)
    seen = json.loads(episode.exec("python3 /tmp/probe.py").stdout)
    assert seen == {"keyctl": "EPERM", "bpf": "EPERM", "io_uring": "EPERM", "unshare": "EPERM", "mount": "EPERM"}


def test_nothing_in_an_episode_holds_the_hosts_output(tmp_path):
    """The agent (through its init) and the tests' programs (through the verifier's init,
    PID 1 of the verifier's namespace) write to /proc/1/fd/{1,2}: none of it reaches the
    process that runs the episode."""
    import subprocess
    import sys

    task = make_task(tmp_path, test_sh="for fd in 1 2; do echo VERIFIER-FORGED >> /proc/1/fd/$fd && echo wrote $fd; "
                                       "done > /logs/verifier/fds.txt 2>&1\necho 1 > /logs/verifier/reward.txt\n")
    harness = (
        "import sys\nfrom sequester.episodes.episode import Episode\n"
        "with Episode() as ep:\n"
        f"    ep.reset({str(task)!r})\n"
        "    out = ep.exec('for fd in 1 2; do printf \"AGENT-FORGED\\\\033[2J\" >> /proc/1/fd/$fd && echo agent wrote $fd; "
        "done 2>/dev/null; true').stdout\n"
        "    sys.stderr.write(out)\n"
        "    r = ep.evaluate()\n"
        "    print('REWARD', r.reward)\n"
        "    sys.stderr.write(r.files['fds.txt'].decode())\n"
    )
    proc = subprocess.run([sys.executable, "-c", harness], capture_output=True, text=True, timeout=120)
    assert "REWARD 1.0" in proc.stdout, proc.stderr
    assert "FORGED" not in proc.stdout + proc.stderr and "\033[2J" not in proc.stdout + proc.stderr
    # control: the agent's write to fd 1 did happen (into /dev/null; fd 2 is a pipe whose
    # reader is gone); the tests' programs cannot even open the verifier's init's
    assert "agent wrote 1" in proc.stderr
    assert "/proc/1/fd/1" in proc.stderr


def test_a_frozen_evaluation_of_a_live_service_says_why_it_failed(tmp_path, episode):
    """Issue #7: a task scored on a service the agent runs cannot pass frozen; the notes say so."""
    script = ("if curl -s -m 3 http://127.0.0.1:8123/ >/dev/null; then echo 1; else echo 0; fi"
              " > /logs/verifier/reward.txt\n")
    episode.reset(make_task(tmp_path, test_sh=script))
    episode.exec("(python3 -m http.server 8123 --bind 127.0.0.1 >/dev/null 2>&1 &) ; sleep 1")
    live = episode.evaluate(freeze=False)
    assert live.reward == 1.0 and not any("frozen" in n for n in live.notes)  # control
    frozen = episode.evaluate(freeze=True)
    assert frozen.reward == 0.0 and any("freeze_agent = false" in n for n in frozen.notes), frozen.notes


def test_the_verifier_has_its_own_dev_with_the_real_devices(tmp_path, episode):
    script = ('if [ -c /dev/null ] && [ -c /dev/urandom ] && [ ! -e /dev/planted ] && head -c1 /dev/zero | od -An -tx1'
              ' | grep -q 00; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n')
    episode.reset(make_task(tmp_path, test_sh=script))
    episode.exec("echo x > /dev/planted; rm -f /dev/null 2>/dev/null; true")
    assert episode.exec("test -e /dev/planted && echo yes").stdout.strip() == "yes"  # control: the agent's /dev has it
    assert episode.evaluate().reward == 1.0
