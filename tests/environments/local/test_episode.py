"""Episodes (:mod:`sequester.environments.local.episode`) against real sandboxes: lifecycle,
the agent's view, the shell (the verifier: tests/environments/local/test_evaluation.py)."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from sequester.agents import load_agent
from sequester.environments.local.episode import Episode
from sequester.errors import EpisodeError
from sequester.environments.settings import EpisodeSettings
from sequester.errors import TaskError
from paths import EXAMPLES
from tasks import make_task, writable_usr

pytestmark = pytest.mark.skipif(os.geteuid() != 0 and not Path("/proc/self/ns/user").exists(), reason="needs namespaces")


def tree_hash(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        digest.update(str(path.relative_to(root)).encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


# -- example tasks: the oracle solves each, nop solves none -----------------------------------


# pinned-pytest's verifier runs pytest through uvx, http-kv-server's waits for its service: over 2 s.
@pytest.mark.parametrize("task", [pytest.param(name, marks=pytest.mark.slow) if name in ("pinned-pytest", "http-kv-server")
                                  else name
                                  for name in sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir())])
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


@pytest.mark.slow
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
    # (/logs holds only the agent's own folders, empty)
    assert episode.exec("ls -A /tests /logs /logs/agent /logs/artifacts").stdout.split() == [
        "/logs:", "agent", "artifacts", "/logs/agent:", "/logs/artifacts:", "/tests:"]


def test_verifier_mount_points_cannot_be_planted_or_replaced(episode):
    episode.reset(EXAMPLES / "python-csv-stats")
    r = episode.exec("echo x > /tests/conftest.py; mkdir -p /logs/verifier; rm -rf /tests; mv /tests /t; "
                     "ln -s /tmp /tests; umount /tests; echo done")
    assert r.stdout == "done\n"
    assert "Read-only file system" in r.stderr and "Device or resource busy" in r.stderr
    # (/logs holds only the agent's own folders, empty)
    assert episode.exec("ls -A /tests /logs /logs/agent /logs/artifacts").stdout.split() == [
        "/logs:", "agent", "artifacts", "/logs/agent:", "/logs/artifacts:", "/tests:"]





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


@pytest.mark.slow
def test_shell_state_persists_and_timeouts_are_exact(episode):
    episode.reset(EXAMPLES / "python-csv-stats")
    episode.exec("cd /tmp && export GREETING=hello")
    assert episode.exec("pwd; echo $GREETING").stdout == "/tmp\nhello\n"
    lag = _exec_lag(episode)  # this machine's delay on one command now (a loaded one is slower)
    started = time.monotonic()
    r = episode.exec("sleep 2; echo finished", timeout=10)  # no hidden shorter default
    assert r.stdout == "finished\n" and not r.timed_out and r.exit_code == 0
    r = episode.exec("sleep 30; echo never", timeout=1)
    assert r.timed_out and "never" not in r.stdout and 1 <= r.duration < 3 + 10 * lag
    r = episode.exec("trap '' INT; sleep 30", timeout=0.5)  # ignores ^C: killed
    assert r.timed_out and r.duration < 4 + 10 * lag
    assert episode.exec("echo $GREETING; pwd").stdout == "hello\n/tmp\n"  # the shell survived both
    assert time.monotonic() - started < 15 + 30 * lag


def _exec_lag(episode) -> float:
    """How much longer than asked a short command takes here now (the reference the
    timing bounds above scale with, measured in the same test: a loaded machine is slower)."""
    return max(episode.exec("sleep 0.1").duration - 0.1 for _ in range(3))


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


@pytest.mark.slow
def test_episode_time_bounds_every_exec(tmp_path, episode):
    episode.reset(make_task(tmp_path, toml="[agent]\ntimeout_sec = 1.5\n"))
    lag = _exec_lag(episode)
    r = episode.exec("sleep 10", timeout=60)
    assert r.timed_out and r.duration < 3 + 10 * lag
    r = episode.exec("echo late", timeout=60)
    assert r.timed_out and "over" in r.note


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
from sequester.environments.local.episode import Episode
from sequester.environments.settings import EpisodeSettings
ep = Episode(EpisodeSettings(state_dir=sys.argv[2]))
ep.reset(sys.argv[1])
print(json.dumps({"init": ep.init_pid, "state": str(ep._run.dirs.root)}), flush=True)
ep.evaluate()
'''


@pytest.mark.slow
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


# -- nothing of the task silently ignored: GPUs, Compose services -------------------------------


def test_a_task_that_asks_for_gpus_is_refused_on_a_host_without_them(tmp_path, episode):
    """This machine has no GPU: the task's gpus is refused before anything starts (no
    image chosen, no view), naming the task's gpus and where the host was looked at."""
    from sequester.environments.base import UnsupportedByBackend
    from sequester.sandbox.gpus import available_gpus

    assert available_gpus()[0] == 0, "this test needs a host without GPUs"
    state = list(EpisodeSettings().state_dir.glob("*")) if EpisodeSettings().state_dir.is_dir() else []
    with pytest.raises(UnsupportedByBackend, match=r"gpus = 1\).*no CDI specification") as caught:
        episode.reset(make_task(tmp_path, toml="[environment]\ngpus = 1\n"))
    assert "/dev/nvidia" in str(caught.value)
    with pytest.raises(EpisodeError, match="not running"):
        episode.notes  # nothing started
    after = list(EpisodeSettings().state_dir.glob("*")) if EpisodeSettings().state_dir.is_dir() else []
    assert sorted(after) == sorted(state)
    episode.reset(make_task(tmp_path / "control"))  # control: the same task without gpus starts


def test_a_gpu_spec_that_cannot_be_applied_is_refused_at_start(tmp_path, episode, monkeypatch):
    """The count comes from the spec's device names; its edits are checked when the view is
    planned: a spec that names a path it cannot bind refuses the task, before anything starts."""
    from sequester.environments.base import UnsupportedByBackend
    from sequester.sandbox import gpus

    (tmp_path / "cdi").mkdir()
    (tmp_path / "cdi" / "nvidia.yaml").write_text(
        'cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: "0"\n  containerEdits:\n    deviceNodes:\n'
        "    - path: dev/nvidia0\n")
    monkeypatch.setattr(gpus, "CDI_DIRS", (tmp_path / "cdi",))
    with pytest.raises(UnsupportedByBackend, match=r"gpus = 1\).*not an absolute path"):
        episode.reset(make_task(tmp_path, toml="[environment]\ngpus = 1\n"))


@pytest.mark.skipif(os.geteuid() != 0, reason="an ordinary caller's host view shows the host's /usr read-only: the "
                    "stand-in spec's mount point (a path the host lacks) cannot be made; real specs mount libraries "
                    "at their host paths")
@writable_usr  # (Debian's own python3 is /usr: the view mounts it back read-only, no mount point can be made there)
def test_gpus_from_a_cdi_spec_are_bound_into_the_view(tmp_path, episode, monkeypatch):
    """The whole path with a stand-in spec (no GPU here): its device node (``/dev/null``
    as ``/dev/nvidia0``), a library read-only at its containerPath, its environment, the
    create-symlinks and update-ldcache hooks."""
    import shutil

    from sequester.sandbox import gpus

    lib = next(p for p in (Path("/usr/lib/x86_64-linux-gnu"), Path("/lib/x86_64-linux-gnu"))
               if (p / "libz.so.1").exists()) / "libz.so.1"
    shutil.copy(lib.resolve(), tmp_path / "libfake.so.1.0")
    (tmp_path / "cdi").mkdir()
    (tmp_path / "cdi" / "nvidia.json").write_text(json.dumps({
        "cdiVersion": "0.5.0", "kind": "nvidia.com/gpu",
        "devices": [{"name": "0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0", "hostPath": "/dev/null"}]}}],
        "containerEdits": {
            "env": ["FAKE_GPU=yes"],
            "mounts": [{"hostPath": str(tmp_path / "libfake.so.1.0"), "containerPath": "/usr/lib/seq-gpu/libfake.so.1.0",
                        "options": ["ro", "nosuid", "nodev", "bind"]}],
            "hooks": [{"hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook",
                       "args": ["nvidia-cdi-hook", "create-symlinks", "--link", "libfake.so.1.0::/usr/lib/seq-gpu/libfake.so"]},
                      {"hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook",
                       "args": ["nvidia-cdi-hook", "update-ldcache", "--folder", "/usr/lib/seq-gpu"]}]}}))
    monkeypatch.setattr(gpus, "CDI_DIRS", (tmp_path / "cdi",))
    episode.reset(make_task(tmp_path, toml="[environment]\ngpus = 1\n"))
    assert any("1 GPU from the CDI specification" in n for n in episode.notes), episode.notes
    r = episode.exec("test -c /dev/nvidia0 && echo char; echo $FAKE_GPU; readlink /usr/lib/seq-gpu/libfake.so; "
                     "sha256sum < /usr/lib/seq-gpu/libfake.so.1.0; ldconfig -p | grep -c /usr/lib/seq-gpu/; "
                     "echo x >> /usr/lib/seq-gpu/libfake.so.1.0 || echo read-only")
    digest = hashlib.sha256((tmp_path / "libfake.so.1.0").read_bytes()).hexdigest()
    assert r.stdout.split() == ["char", "yes", "libfake.so.1.0", digest, "-", "1", "read-only"], r
    # The view's own mount points and links are not reported as the agent's; what the
    # update-ldcache hook's ldconfig wrote in the agent's layer is (information only).
    seen = [t for t in episode.tampering() if "seq-gpu" in t]
    assert seen == ["added /usr/lib/seq-gpu/libz.so.1 (symlink): a native library or Python's standard library"], seen


def test_a_task_with_compose_services_is_refused_naming_the_file(tmp_path, episode):
    from sequester.environments.base import UnsupportedByBackend

    task = make_task(tmp_path)
    (task / "environment" / "compose.yaml").write_text("services:\n  redis:\n    image: redis\n")
    with pytest.raises(UnsupportedByBackend, match=f"{task}/environment/compose.yaml asks for Docker Compose"):
        episode.reset(task)
