"""Red-team tests of the docker backend (:mod:`sequester.environments.docker`): each asserts
that a protection holds; HOLE in a docstring: it did not when the test was written (and
what closed it). Left open, in the README: a fork bomb filling the container's process
slots slows the engine's own calls, so an exec's deadline can be overrun by the engine."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from engine import host_pids_of, import_rootfs, module_engine  # noqa: F401 - the fixture
from tasks import make_task

from sequester.environments.docker import DockerEnvironment
from sequester.environments.settings import EpisodeSettings

# Every test runs on the module's own engine (podman, started and fed an image once per
# module): slow, whichever test pays for the start.
pytestmark = pytest.mark.slow

IMAGE = "localhost/sequester-trixie:redteam"
CHECK_OUT = ('if [ "$(cat /app/out.txt 2>/dev/null)" = hello ]; then echo 1; else echo 0; fi '
             '> /logs/verifier/reward.txt\n')


@pytest.fixture(scope="module")
def docker_host(module_engine):  # noqa: F811
    from images import trixie_rootfs

    import_rootfs(module_engine, trixie_rootfs(), IMAGE, exclude=["./usr/bin/timeout"],
                  changes=["WORKDIR /app"])
    return module_engine.host


@pytest.fixture
def env(docker_host):
    environment = DockerEnvironment(EpisodeSettings(exec_timeout=60), base_url=docker_host)
    yield environment
    environment.close()


def docker_task(root: Path, name: str = "t", test_sh: str | None = CHECK_OUT, *, artifacts: str = '["/app"]',
                timeout: float = 20, extra: str = "", tests: dict[str, str] | None = None) -> Path:
    task = make_task(root, name, test_sh or "", verifier_timeout=timeout)
    if test_sh is None:
        (task / "tests" / "test.sh").unlink()
    for rel, text in (tests or {}).items():
        (task / "tests" / rel).write_text(text)
    (task / "solution" / "solve.sh").write_text("mkdir -p /app && printf hello > /app/out.txt\n")
    (task / "task.toml").write_text(
        f'version = "1.0"\nartifacts = {artifacts}\n{extra}\n[verifier]\ntimeout_sec = {timeout}\n'
        f'[environment]\ndocker_image = "{IMAGE}"\nallow_internet = false\ncpus = 0.5\nmemory_mb = 512\n')
    return task


def _both(env, nop_expected: float = 0.0):
    return env.evaluate(verifier_env="separate"), env.evaluate(verifier_env="shared")


# -- 1. the verdict ------------------------------------------------------------------------


def test_pytest_tests_without_test_sh_cannot_be_shadowed_from_the_workdir(env, tmp_path):
    """HOLE (fixed: python3 -I): a task with test_*.py and no test.sh is run as
    `python3 -m pytest /tests` with
    cwd = the workdir, i.e. the agent's copied /app; `-m` puts the cwd first on sys.path,
    so the agent's /app/pytest.py replaces pytest and exits 0: reward 1 in separate mode."""
    env.start(docker_task(tmp_path, test_sh=None,
                          tests={"test_out.py": "def test_out():\n    assert open('/app/out.txt').read() == 'hello'\n"}))
    env.write_file("/app/pytest.py", "raise SystemExit(0)\n")
    result = env.evaluate(verifier_env="separate")
    assert result.reward == 0.0, result


def test_planted_tests_logs_and_reward_files_do_not_count(env, tmp_path):
    env.start(docker_task(tmp_path))
    env.exec("mkdir -p /tests /logs/verifier; echo 1 > /logs/verifier/reward.txt; "
             "echo '{\"reward\": 1}' > /logs/verifier/reward.json; printf 'echo 1 > /logs/verifier/reward.txt' "
             "> /tests/test.sh; mkdir -p /app; ln -s /logs/verifier/reward.txt /app/reward.txt")
    sep, shared = _both(env)
    assert (sep.reward, shared.reward) == (0.0, 0.0)


@pytest.mark.parametrize("target", ["/", "/tests", "/logs", "/logs/verifier", "/usr/bin"])
def test_app_a_symlink_is_not_a_way_in(env, tmp_path, target):
    env.start(docker_task(tmp_path))
    env.exec(f"mkdir -p /logs/verifier /tests; echo 1 > /logs/verifier/reward.txt; echo 1 > /reward.txt; "
             f"cd /; rm -rf /app; ln -s {target} /app")
    sep = env.evaluate(verifier_env="separate")
    assert sep.reward == 0.0, sep


def test_artifact_links_below_a_symlink_do_not_overwrite_the_verifiers_tools(env, tmp_path):
    task = docker_task(tmp_path, test_sh='printf hello > /tmp/x; if [ "$(cat /app/out.txt)" = hello ] && '
                       '[ "$(/bin/cat /tmp/x)" = hello ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n',
                       artifacts='["/app/a", "/app/a/cat", "/app"]')
    env.start(task)
    env.exec("mkdir -p /app/d; printf '#!/bin/sh\\necho hello\\n' > /app/d/cat; chmod +x /app/d/cat; "
             "ln -s /usr/bin /app/a; printf 'x' > /app/out.txt")
    sep = env.evaluate(verifier_env="separate")
    assert sep.reward == 0.0, sep


def test_special_files_in_artifacts_are_dropped_without_error(env, tmp_path):
    env.start(docker_task(tmp_path, test_sh='n=$(find /app \\( -type p -o -type b -o -type c -o -type s \\) | wc -l);'
                          ' links=$(find /app -type f -links +1 | wc -l); '
                          'if [ "$n$links" = 00 ]; then echo 0.5; else echo 1; fi > /logs/verifier/reward.txt\n'))
    env.exec("mkfifo /app/fifo; mknod /app/null c 1 3; mknod /app/blk b 7 0; ln /etc/passwd /app/hard 2>/dev/null "
             "|| (echo x > /app/f; ln /app/f /app/hard); chmod u+s /app/f 2>/dev/null; "
             "python3 -c \"import socket; s=socket.socket(socket.AF_UNIX); s.bind('/app/sock')\"")
    sep = env.evaluate(verifier_env="separate")
    assert sep.error is None if hasattr(sep, "error") else True
    assert sep.reward == 0.5, sep


def test_a_file_growing_while_it_is_copied_is_not_an_error(env, tmp_path):
    """HOLE (fixed: the artifact is its loss, with a note): the agent (not frozen:
    freeze_agent is off by default) resizes an artifact while
    the engine archives it: the engine's tar stream ends early, and _filtered's tarfile
    raises ReadError("unexpected end of data") out of evaluate(): a trial error, not a 0."""
    env.start(docker_task(tmp_path))
    env.exec("printf hello > /app/out.txt; head -c 150000000 /dev/zero > /app/big; "
             "(while :; do head -c 1000000 /dev/zero >> /app/big; truncate -s 100000000 /app/big; done) "
             ">/dev/null 2>&1 & echo started")
    for _ in range(5):
        result = env.evaluate(verifier_env="separate")  # must not raise
        assert result.reward in (0.0, 1.0)


@pytest.mark.parametrize("target", ["/proc", "/sys", "/dev"])
def test_app_a_symlink_to_a_pseudo_filesystem_is_not_an_error(env, tmp_path, target):
    env.start(docker_task(tmp_path, artifacts='["/app/", "/app/self"]'))
    env.exec(f"cd /; rm -rf /app; ln -s {target} /app")
    started = time.monotonic()
    result = env.evaluate(verifier_env="separate")
    assert result.reward == 0.0 and time.monotonic() - started < 25


def test_a_huge_sparse_artifact_is_its_loss(env, tmp_path):
    env.start(docker_task(tmp_path))
    env.exec("printf hello > /app/out.txt; truncate -s 50G /app/sparse")
    started = time.monotonic()
    result = env.evaluate(verifier_env="separate")
    assert result.reward == 0.0 and time.monotonic() - started < 25
    assert any("was not copied" in n for n in result.notes)


@pytest.mark.parametrize("kind", ["link", "fifo", "huge", "binary", "dir"])
def test_a_hostile_reward_file_in_shared_mode_is_a_zero(env, tmp_path, kind):
    make = {"link": "ln -sf /etc/hostname /logs/verifier/reward.txt",
            "fifo": "rm -f /logs/verifier/reward.txt; mkfifo /logs/verifier/reward.txt",
            "huge": "head -c 3000000 /dev/zero | tr '\\0' 1 > /logs/verifier/reward.txt",
            "binary": "printf '1\\377\\376' > /logs/verifier/reward.txt",
            "dir": "rm -f /logs/verifier/reward.txt; mkdir /logs/verifier/reward.txt"}[kind]
    env.start(docker_task(tmp_path, test_sh=f"{make}\n"))
    result = env.evaluate(verifier_env="shared")
    assert result.reward == 0.0


def test_tests_output_flood_is_bounded(docker_host, tmp_path):
    with DockerEnvironment(EpisodeSettings(output_bytes=10000), base_url=docker_host) as env:
        env.start(docker_task(tmp_path, test_sh="head -c 200000000 /dev/zero; echo 0 > /logs/verifier/reward.txt\n"))
        result = env.evaluate(verifier_env="separate")
        assert result.reward == 0.0


# -- 2. nothing the agent does is an error ---------------------------------------------------


@pytest.mark.parametrize("break_it", [
    "rm -f /bin/sh /usr/bin/sh",
    "rm -f /usr/bin/dash /bin/sh",
    "printf '#!/bin/bash\\nexit 0\\n' > /usr/bin/rm; chmod +x /usr/bin/rm",
    "cd /; rm -rf /app; touch /app",
    "chmod 000 /app; chattr +i /app 2>/dev/null; true",
])
def test_a_broken_container_is_the_agents_zero_not_an_error(env, tmp_path, break_it):
    env.start(docker_task(tmp_path))
    env.exec(break_it)
    after = env.exec("echo still")  # must not raise
    assert after.exit_code != 0 or after.stdout == "still\n"
    sep, shared = _both(env)
    assert (sep.reward, shared.reward) == (0.0, 0.0)


def _kill_namespace(namespace: str | None) -> None:
    """Test cleanup: SIGKILL every process of a PID namespace from the host, until none is left."""
    import signal

    from sequester.sandbox.procs import pid_namespace

    for _ in range(200):
        found = [int(n) for n in os.listdir("/proc") if n.isdigit() and pid_namespace(int(n)) == namespace]
        if not found or namespace is None:
            return
        for pid in found:
            _try(lambda pid=pid: os.kill(pid, signal.SIGKILL))
        time.sleep(0.05)


@pytest.fixture
def bombed(docker_host, tmp_path):
    """An agent's container whose pids limit a fork bomb keeps full (its processes outlive
    the timed-out exec: each `b | b &` is reparented to the container's init)."""
    # 512 process slots (the product's default is 4096): enough to jam the engine, not
    # so many that the machine running the tests stalls while they die.
    environment = DockerEnvironment(EpisodeSettings(exec_timeout=60, max_processes=512), base_url=docker_host)
    environment.start(docker_task(tmp_path, timeout=10))
    run = environment._run
    environment.exec("b() { b | b & }; b", timeout=3)
    time.sleep(3)  # the bomb fills the pids limit
    yield environment
    _kill_namespace(run.ops.namespace)  # never leave the bomb running for the next test
    _try(environment.close)
    _try(lambda: run.container.remove(force=True))


def test_a_fork_bombed_container_is_removed_by_close(bombed):
    """HOLE (fixed: its init is killed from the host first, and the engine's removal tried
    again): close() raised SandboxError: podman's force remove answered 500 "cannot remove
    container ... as it could not be stopped: given PIDs did not die within timeout" (or
    "timed out waiting for file /run/libpod/exits/..."), after minutes."""
    started = time.monotonic()
    bombed.close()  # must not raise
    assert time.monotonic() - started < 30


def test_shared_mode_with_freeze_a_background_forger_is_stopped(env, tmp_path):
    env.start(docker_task(tmp_path, test_sh="sleep 1; echo 0 > /logs/verifier/reward.txt; sleep 1\n"))
    env.exec("(while :; do echo 1 > /logs/verifier/reward.txt 2>/dev/null; done) >/dev/null 2>&1 & echo ok")
    result = env.evaluate(verifier_env="shared", freeze=True)
    assert result.reward == 0.0, result


def test_closed_stdout_and_a_never_ending_exec(env, tmp_path):
    env.start(docker_task(tmp_path))
    r = env.exec("exec 1>&- 2>&-; sleep 100", timeout=2)
    assert r.timed_out and r.duration < 4
    r = env.exec("exec 1>&- 2>&-; true")
    assert r.exit_code == 0


def test_killed_init_is_a_zero_in_both_modes(env, tmp_path):
    env.start(docker_task(tmp_path))
    env.exec("kill -9 1; kill -TERM 1", timeout=5)
    time.sleep(0.5)
    env.exec("echo hi")
    sep = env.evaluate(verifier_env="separate", freeze=True)
    shared = env.evaluate(verifier_env="shared")
    assert (sep.reward, shared.reward) == (0.0, 0.0)


def test_a_timed_out_commands_tree_dies_and_a_daemon_it_detached_dies_at_close(env, tmp_path):
    """At the deadline the command and every process still below it are killed; one it
    detached (setsid, double fork) belongs to the container's init, as in any container,
    and lives until the episode closes, which kills it from the host."""
    env.start(docker_task(tmp_path))
    r = env.exec("(setsid sleep 1017 &) ; sleep 1018", timeout=2)
    assert r.timed_out and r.duration < 3.5 and "detached" in r.note
    time.sleep(0.3)
    assert host_pids_of(b"sleep\x001018\x00") == []
    assert len(host_pids_of(b"sleep\x001017\x00")) == 1
    env.close()
    deadline = time.monotonic() + 10
    while host_pids_of(b"sleep\x001017\x00") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert host_pids_of(b"sleep\x001017\x00") == []
def test_a_stopped_or_ignoring_process_is_killed_at_the_deadline(env, tmp_path):
    env.start(docker_task(tmp_path))
    started = time.monotonic()
    r = env.exec("trap '' TERM INT HUP; (trap '' TERM; sleep 1019) & kill -STOP $$", timeout=2)
    assert r.timed_out and time.monotonic() - started < 4
    time.sleep(0.3)
    assert host_pids_of(b"sleep\x001019\x00") == []


def test_an_exec_that_exits_at_the_deadline_kills_no_host_process(env, tmp_path):
    env.start(docker_task(tmp_path))
    import subprocess
    victims = [subprocess.Popen(["sleep", "1020"]) for _ in range(3)]
    try:
        for t in (1.0, 1.02, 0.98, 1.05):
            env.exec(f"sleep {t}", timeout=1.0)
        assert all(v.poll() is None for v in victims)
    finally:
        for v in victims:
            v.kill()
            v.wait()


def test_huge_read_file_is_bounded(env, tmp_path):
    env.start(docker_task(tmp_path))
    env.exec("truncate -s 10G /app/huge; ln -s /app/huge /app/l; ln -s l /app/l2")
    for path in ("/app/huge", "/app/l2", "/dev/zero", "/proc/self/mem"):
        with pytest.raises(Exception):
            env.read_file(path)


def test_read_file_link_loop_and_output_flood_on_both_streams(docker_host, tmp_path):
    with DockerEnvironment(EpisodeSettings(output_bytes=5000), base_url=docker_host) as env:
        env.start(docker_task(tmp_path))
        env.exec("ln -s a /app/b; ln -s b /app/a")
        with pytest.raises(Exception):
            env.read_file("/app/a")
        r = env.exec("yes x & yes y >&2 & sleep 3; kill %1 %2", timeout=10)
        assert len(r.stdout) <= 5000 and len(r.stderr) <= 5000


def test_close_while_an_exec_runs_in_another_thread_and_after_abort(env, docker_host, tmp_path):
    env.start(docker_task(tmp_path))
    out: list = []
    t = threading.Thread(target=lambda: out.append(_try(lambda: env.exec("sleep 1021", timeout=20))))
    t.start()
    time.sleep(1)
    started = time.monotonic()
    env.abort()
    t.join(10)
    assert not t.is_alive() and time.monotonic() - started < 10
    env.close()
    env.close()
    time.sleep(0.3)
    assert host_pids_of(b"sleep\x001021\x00") == []
    other = DockerEnvironment(EpisodeSettings(), base_url=docker_host)
    other.start(docker_task(tmp_path, name="u"))
    t = threading.Thread(target=lambda: _try(lambda: other.exec("sleep 1022", timeout=20)))
    t.start()
    time.sleep(1)
    other.close()
    t.join(15)
    assert not t.is_alive()
    assert host_pids_of(b"sleep\x001022\x00") == []


def _try(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        return exc


# -- 4. tests/ and solution/ --------------------------------------------------------------------


def test_verifier_container_is_unreachable_and_tests_never_reach_the_agent(env, tmp_path):
    task = docker_task(tmp_path, test_sh="echo SECRET-TESTS > /tmp/s; sleep 3; echo 0 > /logs/verifier/reward.txt\n")
    env.start(task)
    net = env.container.attrs["HostConfig"]["NetworkMode"]
    assert net == "none"
    env.exec("(for i in $(seq 100); do grep -rs SECRET-TESTS /proc/*/cwd/ /tmp /tests 2>/dev/null "
             ">> /app/seen; sleep 0.05; done) >/dev/null 2>&1 & echo ok")
    env.evaluate(verifier_env="separate")
    time.sleep(0.5)
    assert b"SECRET" not in env.read_file("/app/seen") if env.exec("test -f /app/seen").exit_code == 0 else True
    assert env.exec("ls /tests /solution 2>&1; ip -o addr 2>/dev/null | grep -v ' lo ' ").stdout.count("No such") == 2

