"""The docker backend's environment (:mod:`sequester.environments.docker.environment`) against a real engine: podman
serving the Docker API on a socket of the module's own (tests/helpers/engine.py), with an
image imported from the cached Debian trixie rootfs, without ``/usr/bin/timeout``."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from engine import host_pids_of, import_rootfs, module_engine  # noqa: F401 - the fixture
from many_fds import descriptors_above
from tasks import make_task

from sequester.environments.docker import DockerEnvironment
from sequester.environments.docker import engine as docker_engine
from sequester.environments.settings import EpisodeSettings

# Every test runs on the module's own engine (podman, started and fed an image once per
# module): slow, whichever test pays for the start.
pytestmark = pytest.mark.slow

IMAGE = "localhost/sequester-trixie:test"
CHECK_OUT = ('if [ "$(cat /app/out.txt 2>/dev/null)" = hello ]; then echo 1; else echo 0; fi '
             '> /logs/verifier/reward.txt\n')


@pytest.fixture(scope="module")
def docker_host(module_engine):  # noqa: F811
    """The engine's URL, with the test image imported once."""
    from images import trixie_rootfs

    import_rootfs(module_engine, trixie_rootfs(), IMAGE, exclude=["./usr/bin/timeout"])
    return module_engine.host


@pytest.fixture
def env(docker_host):
    environment = DockerEnvironment(EpisodeSettings(exec_timeout=60), base_url=docker_host)
    yield environment
    environment.close()


def docker_task(root: Path, name: str = "t", test_sh: str = CHECK_OUT, *, extra: str = "",
                environment: str = "", artifacts: str = '["/app"]', timeout: float = 30) -> Path:
    """A task on the test image (no internet, half a CPU, 512 MB), its tests: ``test_sh``."""
    task = make_task(root, name, test_sh, verifier_timeout=timeout)
    (task / "solution" / "solve.sh").write_text("mkdir -p /app && printf hello > /app/out.txt\n")
    (task / "task.toml").write_text(
        f'version = "1.0"\nartifacts = {artifacts}\n{extra}\n[verifier]\ntimeout_sec = {timeout}\n'
        f'[environment]\ndocker_image = "{IMAGE}"\nallow_internet = false\ncpus = 0.5\nmemory_mb = 512\n'
        f'{environment}')
    return task


def test_exec_output_exit_code_and_workdir(env, tmp_path):
    env.start(docker_task(tmp_path))
    result = env.exec("pwd; echo out; echo err >&2; exit 3")
    assert (result.stdout, result.stderr, result.exit_code, result.timed_out) == ("/app\nout\n", "err\n", 3, False)
    assert env.workdir == "/app" and env.system["mode"] == "docker" and env.system["image"] == IMAGE
    env.exec("cd /tmp; export X=1")  # each exec is a fresh sh: nothing persists
    assert env.exec('pwd; echo "x=$X"').stdout == "/app\nx=\n"


def test_exec_and_evaluate_with_descriptors_above_select_bound(env, tmp_path):
    """The exec's stream is read on a descriptor numbered above 1024 (select refused it:
    the caller a server with many episodes open), to its end and to its deadline."""
    with descriptors_above() as fill:
        env.start(docker_task(tmp_path))
        fill()  # a low descriptor another test's client left may have been collected meanwhile
        probe = os.open("/dev/null", os.O_RDONLY)
        os.close(probe)
        assert probe > 1024
        result = env.exec("echo out; echo err >&2; exit 3")
        assert (result.stdout, result.stderr, result.exit_code) == ("out\n", "err\n", 3)
        assert env.exec("sleep 1000", timeout=1).timed_out
        env.exec("mkdir -p /app && printf hello > /app/out.txt")
        assert env.evaluate().reward == 1.0


def test_tests_and_solution_never_in_the_agent_container(env, tmp_path):
    env.start(docker_task(tmp_path))
    assert env.exec("test -e /tests || test -e /solution || test -e /logs/verifier; echo $?").stdout == "1\n"
    assert env.exec("grep -rl 'verifier/reward' / --exclude-dir=proc --exclude-dir=sys 2>/dev/null | head -1"
                    ).stdout == ""


def test_timeout_is_enforced_from_the_host_and_kills_the_tree(env, tmp_path):
    env.start(docker_task(tmp_path))
    assert env.exec("command -v timeout || echo absent").stdout == "absent\n"  # the image has no timeout binary
    started = time.monotonic()
    result = env.exec("sleep 1000 & sh -c 'sleep 1001'; echo never", timeout=2)
    took = time.monotonic() - started
    assert result.timed_out and "never" not in result.stdout and "killed" in result.note
    assert 1.9 <= result.duration <= 3.0 and took <= 4.0
    time.sleep(0.2)
    assert host_pids_of(b"sleep\x001000\x00") == [] and host_pids_of(b"sleep\x001001\x00") == []


def test_a_background_process_survives_a_normal_exec(env, tmp_path):
    env.start(docker_task(tmp_path))
    started = time.monotonic()
    result = env.exec("sleep 1002 & echo $! > /tmp/bg; echo started")
    assert result.stdout == "started\n" and result.exit_code == 0 and time.monotonic() - started < 2
    time.sleep(0.3)
    assert len(host_pids_of(b"sleep\x001002\x00")) == 1
    assert env.exec('kill -0 "$(cat /tmp/bg)" && echo alive').stdout == "alive\n"


def test_a_background_writer_on_the_stream_does_not_hold_the_exec(env, tmp_path):
    """The command ends while a process it left keeps writing to its output: the exec
    returns (the engine says it no longer runs), it does not wait for its deadline."""
    env.start(docker_task(tmp_path))
    started = time.monotonic()
    result = env.exec("(while :; do echo x; sleep 0.01; done) & echo started", timeout=60)
    assert result.exit_code == 0 and not result.timed_out and "started" in result.stdout
    assert time.monotonic() - started < 5


def test_an_agent_that_ends_its_container(env, tmp_path):
    env.start(docker_task(tmp_path))
    env.exec("printf hello > /app/out.txt; kill -TERM 1")
    time.sleep(0.5)
    result = env.exec("echo hi")
    assert result.exit_code is None and "no longer running" in result.note
    shared = env.evaluate(verifier_env="shared")
    assert shared.reward == 0.0 and "no longer running" in shared.zero_reason
    assert env.evaluate(verifier_env="separate").reward == 1.0  # its artifacts are still copied


def test_output_is_bounded(docker_host, tmp_path):
    with DockerEnvironment(EpisodeSettings(output_bytes=1000), base_url=docker_host) as env:
        env.start(docker_task(tmp_path))
        result = env.exec("head -c 5000000 /dev/zero | tr '\\0' x; echo done >&2")
        assert len(result.stdout) == 1000 and result.stderr == "done\n" and "cut at 1000" in result.note


def test_write_read_and_upload(env, tmp_path):
    env.start(docker_task(tmp_path))
    env.write_file("sub/dir/a.txt", "hello\n", mode=0o600)
    assert env.exec("cat /app/sub/dir/a.txt; stat -c %a /app/sub/dir/a.txt").stdout == "hello\n600\n"
    assert env.read_file("/app/sub/dir/a.txt") == b"hello\n"
    env.exec("ln -s /app/sub/dir/a.txt /app/link")
    assert env.read_file("link") == b"hello\n"
    with pytest.raises(Exception, match="no such file"):
        env.read_file("/nope")
    with pytest.raises(Exception, match="not a regular file"):
        env.read_file("/app/sub")
    folder = tmp_path / "up"
    (folder / "deep").mkdir(parents=True)
    (folder / "deep" / "f").write_bytes(b"\x00\x01")
    env.upload_dir(folder, "/opt/up")
    assert env.read_file("/opt/up/deep/f") == b"\x00\x01"


@pytest.mark.parametrize("mode", ["separate", "shared"])
def test_oracle_gets_1_and_nothing_gets_0(env, tmp_path, mode):
    task = docker_task(tmp_path)
    env.start(task)
    assert env.evaluate(verifier_env=mode).reward == 0.0
    env.upload_dir(task / "solution", "/oracle")
    assert env.exec("bash /oracle/solve.sh").exit_code == 0
    result = env.evaluate(verifier_env=mode)
    assert result.reward == 1.0 and result.zero_reason is None, result
    assert env.exec("test -e /tests || test -e /logs/verifier; echo $?").stdout == "1\n"
    assert env._client.containers.list(all=True, filters={"label": f"{docker_engine.ROLE}=verifier"}) == []


@pytest.mark.parametrize("mode", ["separate", "shared"])
def test_planted_tests_and_reward_do_not_count(env, tmp_path, mode):
    env.start(docker_task(tmp_path))
    env.exec("mkdir -p /tests /logs/verifier && echo 'echo 1 > /logs/verifier/reward.txt' > /tests/test.sh && "
             "echo 1 > /logs/verifier/reward.txt && echo '{\"reward\": 1}' > /logs/verifier/reward.json")
    assert env.evaluate(verifier_env=mode).reward == 0.0


def test_separate_freeze_pauses_and_resumes(env, tmp_path):
    env.start(docker_task(tmp_path))
    env.exec("printf hello > /app/out.txt")
    result = env.evaluate(verifier_env="separate", freeze=True)
    assert result.reward == 1.0 and result.frozen == "pause"
    assert env.exec("echo alive").stdout == "alive\n"


def test_shared_freeze_stops_the_agent(env, tmp_path):
    # The tests see whether the agent's counter moves while they run.
    probe = 'a=$(cat /tmp/n); sleep 1; b=$(cat /tmp/n); [ "$a" = "$b" ] && echo 1 > /logs/verifier/reward.txt\n'
    env.start(docker_task(tmp_path, test_sh=probe))
    env.exec("(i=0; while :; do i=$((i+1)); echo $i > /tmp/n; sleep 0.05; done) >/dev/null 2>&1 &")
    time.sleep(0.3)
    assert env.evaluate(verifier_env="shared", freeze=True).reward == 1.0
    assert env.evaluate(verifier_env="shared", freeze=False).reward == 0.0


def test_an_unremovable_tests_folder_in_shared_mode_is_the_agents_zero(env, tmp_path):
    env.start(docker_task(tmp_path))
    env.exec("printf hello > /app/out.txt")
    env.exec("mkdir -p /tests && printf '#!/bin/sh\\nexit 0\\n' > /usr/bin/rm")  # an rm that removes nothing
    result = env.evaluate(verifier_env="shared")
    assert result.reward == 0.0 and "could not be removed" in result.zero_reason
    # The same agent in separate mode gets its verdict: nothing of it runs there.
    assert env.evaluate(verifier_env="separate").reward == 1.0


def test_a_process_recreating_tests_is_stopped_before_the_wipe_with_freeze(env, tmp_path):
    """A process re-creating /tests as fast as it can: without freezing, it races the
    wipe's check (and runs beside the tests: the README's residual of shared mode); with
    freeze_agent it is stopped first, so the wipe takes and nothing of it is among the
    pristine tests."""
    env.start(docker_task(tmp_path, test_sh='test -e /tests/x && exit 0; '
                      '[ "$(cat /app/out.txt)" = hello ] && echo 1 > /logs/verifier/reward.txt\n'))
    env.exec("printf hello > /app/out.txt")
    env.exec("(while :; do mkdir -p /tests/x; done) >/dev/null 2>&1 &")
    time.sleep(0.2)
    result = env.evaluate(verifier_env="shared", freeze=True)
    assert result.reward == 1.0 and result.frozen == "sigstop", result


def test_the_agent_cannot_make_tests_immutable(env, tmp_path):
    # chattr +i needs CAP_LINUX_IMMUTABLE, which an engine's default capabilities lack:
    # the agent's attempt (by ioctl: the image has no chattr) fails, and the wipe takes.
    env.start(docker_task(tmp_path))
    env.exec("printf hello > /app/out.txt; mkdir -p /tests; : > /tests/keep")
    attempt = env.exec("python3 -c \"import fcntl, os, struct; fd = os.open('/tests/keep', os.O_RDONLY); "
                       "fcntl.ioctl(fd, 0x40086602, struct.pack('i', 0x10))\"")  # FS_IOC_SETFLAGS, IMMUTABLE
    assert attempt.exit_code != 0 and "Operation not permitted" in attempt.stderr
    assert env.evaluate(verifier_env="shared").reward == 1.0


@pytest.mark.parametrize("mode", ["separate", "shared"])
def test_a_working_directory_the_agent_replaced(env, tmp_path, mode):
    env.start(docker_task(tmp_path, test_sh="echo 0.5 > /logs/verifier/reward.txt\n"))
    env.exec("cd / && rm -rf /app && echo x > /app")
    assert env.exec("pwd").stdout == "/\n"
    assert env.evaluate(verifier_env=mode).reward == 0.5


def test_verifier_timeout_is_the_agents_zero(env, tmp_path):
    env.start(docker_task(tmp_path, test_sh="sleep 100\n", timeout=2))
    started = time.monotonic()
    result = env.evaluate(verifier_env="separate")
    assert result.reward == 0.0 and "ran over" in result.zero_reason and time.monotonic() - started < 10


def test_limits_labels_and_network(env, tmp_path):
    env.start(docker_task(tmp_path))
    env.container.reload()
    host = env.container.attrs["HostConfig"]
    assert (host["NanoCpus"], host["Memory"], host["PidsLimit"]) == (500_000_000, 512 << 20, 4096)
    assert host["NetworkMode"] == "none"
    labels = env.container.labels
    assert labels[docker_engine.MANAGED] == "1" and labels[docker_engine.ROLE] == "agent"
    assert labels[docker_engine.OWNER] == docker_engine.owner_label()
    assert env.exec("ls /sys/class/net").stdout.split() == ["lo"]


def test_close_removes_the_container_even_after_an_error(docker_host, tmp_path):
    env = DockerEnvironment(base_url=docker_host)
    env.start(docker_task(tmp_path))
    client, name = env._client, env.container.name
    with pytest.raises(Exception):
        env.read_file("/no/such/file")
    env.close()
    env.close()
    assert client.containers.list(all=True, filters={"name": name}) == []
    with pytest.raises(Exception, match="closed"):
        env.exec("true")


def test_abort_ends_a_command_in_flight(env, tmp_path):
    import threading

    env.start(docker_task(tmp_path))
    threading.Timer(1.0, env.abort).start()
    started = time.monotonic()
    env.exec("sleep 30", timeout=20)
    assert time.monotonic() - started < 8
    with pytest.raises(Exception, match="aborted"):
        env.exec("true")


def test_an_orphan_is_reaped_on_the_next_start(docker_host, tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    import docker
    import socket

    client = docker.DockerClient(base_url=docker_host)
    orphan = client.containers.run(IMAGE, entrypoint=["/bin/sh", "-c", "sleep 1000"], detach=True, labels={
        docker_engine.MANAGED: "1", docker_engine.ROLE: "agent",
        docker_engine.OWNER: f"{socket.gethostname()}:{dead.pid}:1"})
    foreign = client.containers.run(IMAGE, entrypoint=["/bin/sh", "-c", "sleep 1000"], detach=True, labels={
        docker_engine.MANAGED: "1", docker_engine.OWNER: f"elsewhere:{dead.pid}:1"})
    try:
        docker_engine._reaped.clear()  # reaping happens once a process: as in a new one
        with DockerEnvironment(base_url=docker_host) as env:
            env.start(docker_task(tmp_path))
            names = {c.name for c in client.containers.list(all=True)}
            assert orphan.name not in names and foreign.name in names and env.container.name in names
    finally:
        foreign.remove(force=True)


def test_a_timeout_without_host_pids_is_killed_from_inside(env, tmp_path):
    # As with an engine on another host: the exec's pid is not visible here.
    env.start(docker_task(tmp_path))
    env._running().ops.namespace = None
    result = env.exec("sleep 1003 & sh -c 'sleep 1004'; echo never", timeout=2)
    assert result.timed_out and "never" not in result.stdout and result.stderr == ""
    assert 1.9 <= result.duration <= 4.0
    time.sleep(0.3)
    assert host_pids_of(b"sleep\x001003\x00") == [] and host_pids_of(b"sleep\x001004\x00") == []
    assert env.exec("echo ok").stdout == "ok\n"


def test_build_from_the_tasks_environment_folder(docker_host, tmp_path):
    task = docker_task(tmp_path)
    (task / "environment" / "Dockerfile").write_text(f"FROM {IMAGE}\nRUN echo built > /built\nWORKDIR /work\n")
    with DockerEnvironment(base_url=docker_host, build=True) as env:
        env.start(task)
        assert env.workdir == "/work" and env.system["image"].startswith("localhost/sequester-build/")
        assert env.exec("cat /built; ls / | grep -cx -e tests -e solution").stdout == "built\n0\n"


def test_tests_a_shared_evaluation_left_are_gone_before_the_agents_next_call(env, tmp_path):
    """Unfrozen, the wipe after a shared evaluation waits for the agent's next call (its
    processes ran beside the tests all along): the tests are still there until then, and
    nothing the agent asks for runs before they are gone."""
    env.start(docker_task(tmp_path))
    env.exec("printf hello > /app/out.txt")
    assert env.evaluate(verifier_env="shared").reward == 1.0
    assert env.container.exec_run(["test", "-e", "/tests/test.sh"]).exit_code == 0  # left, for now
    out = env.exec("ls /tests /logs/verifier 2>&1; echo end").stdout
    assert out.count("No such file") == 2 and out.endswith("end\n"), out


def test_a_wipe_the_agent_breaks_after_the_tests_went_in_kills_its_container(env, tmp_path):
    """Its process waits for the pristine tests, then replaces rm: the wipe before its next
    call does not take, so the container is killed (fail closed) and the notes say why."""
    env.start(docker_task(tmp_path))
    env.exec("printf hello > /app/out.txt; (while [ ! -e /tests/test.sh ]; do sleep 0.01; done; "
             "printf '#!/bin/sh\\nexit 0\\n' > /usr/bin/rm) >/dev/null 2>&1 &")
    assert env.evaluate(verifier_env="shared").reward == 1.0
    time.sleep(0.3)
    result = env.exec("cat /tests/test.sh")
    assert result.exit_code is None and "no longer running" in result.note and "pristine" not in result.stdout
    assert any("could not be removed from the agent's container after scoring" in n for n in env.notes)
