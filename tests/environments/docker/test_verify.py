"""Scoring of the docker backend (:mod:`sequester.environments.docker.verify`) with a fake
container: every failure injected where a real engine could not be made to fail."""

from __future__ import annotations

import io
import tarfile

import pytest
from tasks import make_task

from sequester.environments.docker import verify
from sequester.environments.docker.engine import EngineError
from sequester.environments.verdict import VerifierCouldNotRun
from sequester.tasks import load_task


class FakeOps:
    """A container: ``gone`` answers the wipe checks in turn; ``run`` is what the tests do."""

    def __init__(self, *, gone=(True, True), run=(0, b"tests ran\n", False), files=None, tars=None,
                 fail_remove_at=None):
        self.gone = list(gone)
        self.run = run
        self.files = dict(files if files is not None else {"/logs/verifier/reward.txt": b"1\n"})
        self.tars = dict(tars or {})
        self.calls: list[tuple] = []
        self.discarded = False
        self.fail_remove_at = fail_remove_at

    def exec(self, argv, timeout, *, env=None, workdir=None):
        self.calls.append(("exec", tuple(argv)))
        if argv[:3] == ["/bin/sh", "-c", verify._PARENT]:
            return 0, b"", False
        if isinstance(self.run, Exception):
            raise self.run
        return self.run

    def put_tar(self, path, data):
        self.calls.append(("put_tar", path))

    def get_tar(self, path, limit):
        return self.tars.get(path)

    def read_file(self, path, limit):
        return self.files.get(path)

    def remove(self, paths):
        self.calls.append(("remove", tuple(paths)))
        if self.fail_remove_at is not None and sum(c[0] == "remove" for c in self.calls) == self.fail_remove_at:
            raise EngineError("the engine went away")
        return self.gone.pop(0)

    def discard(self):
        self.discarded = True

    def ran_tests(self) -> bool:
        return any(c[0] == "exec" and c[1][:1] == ("bash",) for c in self.calls)


@pytest.fixture
def task(tmp_path):
    return load_task(make_task(tmp_path))


def shared(ops, task):
    return verify.evaluate_shared(ops, task, workdir="/app", output_limit=10_000)


def test_a_wipe_that_does_not_take_is_the_agents_zero_and_stages_nothing(task):
    ops = FakeOps(gone=(False,))
    verdict = shared(ops, task)
    assert verdict.result.reward == 0.0 and "could not be removed" in verdict.result.zero_reason
    assert not ops.ran_tests() and not any(c[0] == "put_tar" for c in ops.calls)


def test_a_wipe_the_engine_fails_is_an_error(task):
    with pytest.raises(VerifierCouldNotRun, match="went away"):
        shared(FakeOps(fail_remove_at=1), task)


def test_the_verdict_of_a_clean_run(task):
    ops = FakeOps()
    verdict = shared(ops, task)
    assert verdict.result.reward == 1.0 and verdict.clean and not ops.discarded
    assert [c[0] for c in ops.calls].count("remove") == 2  # before and after


def test_a_cleanup_that_does_not_take_kills_the_agents_container(task):
    ops = FakeOps(gone=(True, False))
    verdict = shared(ops, task)
    assert verdict.result.reward == 1.0 and not verdict.clean and ops.discarded
    assert any("container was killed" in n for n in verdict.result.notes)


def test_a_cleanup_the_engine_fails_kills_the_agents_container(task):
    ops = FakeOps(fail_remove_at=2)
    verdict = shared(ops, task)
    assert not verdict.clean and ops.discarded


def test_scoring_that_raises_still_cleans_up(task):
    ops = FakeOps(run=EngineError("exec broke"))
    with pytest.raises(VerifierCouldNotRun, match="exec broke"):
        shared(ops, task)
    assert [c[0] for c in ops.calls].count("remove") == 2 and not ops.discarded


def test_an_engine_failure_in_the_agents_container_only_is_the_agents_zero(task):
    # The pristine container runs the same tests without failing: the agent's container did it.
    pristine = FakeOps()
    ops = FakeOps(run=EngineError("exec broke"))
    verdict = verify.evaluate_shared(ops, task, workdir="/app", output_limit=100, start_verifier=lambda: pristine)
    assert verdict.result.reward == 0.0 and "not in the task's pristine container" in verdict.result.zero_reason
    assert pristine.ran_tests() and pristine.discarded and verdict.clean
    # ... and when it fails there too, the engine is to blame.
    with pytest.raises(VerifierCouldNotRun, match="exec broke"):
        verify.evaluate_shared(FakeOps(run=EngineError("exec broke")), task, workdir="/app", output_limit=100,
                               start_verifier=lambda: FakeOps(run=EngineError("also broke")))


def test_a_timeout_is_the_agents_zero(task):
    verdict = shared(FakeOps(run=(None, b"", True)), task)
    assert verdict.result.reward == 0.0 and "ran over" in verdict.result.zero_reason


@pytest.mark.parametrize("files, reason", [
    ({}, "neither"),
    ({"/logs/verifier/reward.txt": b"nan"}, "not finite"),
    ({"/logs/verifier/reward.txt": b"2"}, "outside"),
])
def test_no_or_an_invalid_reward_is_the_agents_zero(task, files, reason):
    verdict = shared(FakeOps(files=files), task)
    assert verdict.result.reward == 0.0 and reason in verdict.result.zero_reason


def test_reward_json_the_tests_never_write_is_ignored(task):
    verdict = shared(FakeOps(files={"/logs/verifier/reward.txt": b"0", "/logs/verifier/reward.json": b'{"reward": 1}'}),
                     task)
    assert verdict.result.reward == 0.0 and any("reward.json ignored" in n for n in verdict.result.notes)


def _tar(entries) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, kind, data in entries:
            info = tarfile.TarInfo(name)
            info.type = kind
            if kind == tarfile.SYMTYPE:
                info.linkname = data
            elif kind == tarfile.REGTYPE:
                info.size, info.mode = len(data), 0o4755
            tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
    return buf.getvalue()


def test_artifacts_are_filtered():
    from sequester.tasks.task_toml import Artifact

    raw = _tar([("app", tarfile.DIRTYPE, b""), ("app/keep.txt", tarfile.REGTYPE, b"k"),
                ("app/x.o", tarfile.REGTYPE, b"o"), ("app/dev", tarfile.CHRTYPE, b""),
                ("app/link", tarfile.SYMTYPE, "/usr/bin"), ("app/link/python3", tarfile.REGTYPE, b"evil")])
    ops = FakeOps(tars={"/app": raw})
    packed, notes = verify.pack_artifacts(ops, [Artifact("/app", ("*.o",)), Artifact("/missing")])
    assert notes == ["artifact /missing does not exist in the agent's environment"]
    [(parent, data)] = packed
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = {m.name: m for m in tar}
    assert parent == "/" and set(members) == {"app", "app/keep.txt", "app/link"}
    assert members["app/keep.txt"].mode == 0o755  # no set-id bits


def test_separate_removes_the_verifier_container_whatever_happens(task):
    agent, made = FakeOps(), []

    def start(run):
        ops = FakeOps(run=run)
        made.append(ops)
        return ops

    verdict = verify.evaluate_separate(agent, lambda: start((0, b"", False)), task, workdir="/app", output_limit=100)
    assert verdict.result.reward == 1.0 and made[-1].discarded and not agent.ran_tests()
    with pytest.raises(VerifierCouldNotRun):
        verify.evaluate_separate(agent, lambda: start(EngineError("no")), task, workdir="/app", output_limit=100)
    assert made[-1].discarded and not agent.discarded


def test_separate_a_verifier_container_that_cannot_start_is_an_error(task):
    def start():
        raise EngineError("no image")

    with pytest.raises(VerifierCouldNotRun, match="no image"):
        verify.evaluate_separate(FakeOps(), start, task, workdir="/app", output_limit=100)


# -- the backend's other pure parts ------------------------------------------------------


def test_the_stream_is_demultiplexed_and_bounded():
    from sequester.environments.docker.exec import Demux

    frames = b"".join(bytes([sid, 0, 0, 0]) + len(p).to_bytes(4, "big") + p
                      for sid, p in [(1, b"hello "), (2, b"oops"), (1, b"world, and more")])
    demux = Demux(11)
    for i in range(0, len(frames), 3):  # frames split anywhere, headers too
        demux.feed(frames[i:i + 3])
    assert bytes(demux.out.data) == b"hello world" and demux.out.dropped == 10
    assert bytes(demux.err.data) == b"oops" and demux.err.dropped == 0


def test_network_modes(tmp_path):
    from sequester.environments.base import UnsupportedByBackend
    from sequester.environments.docker.container import network_for

    def task(name, env):
        return load_task(make_task(tmp_path, name, toml=f"[environment]\n{env}\n"))

    from sequester.environments.settings import EpisodeSettings

    assert network_for(task("a", "allow_internet = false"))[0] == "none"
    name, record = network_for(task("b", ""))
    assert name is None and record["mode"] == "public" and "refuses nothing" in record["guarantee"]
    with pytest.raises(UnsupportedByBackend, match="allowlist"):
        network_for(task("c", 'network_mode = "allowlist"\nallowed_hosts = ["pypi.org"]'))
    # the run's network narrows it; an engine network of the operator's is used as named
    assert network_for(task("d", ""), EpisodeSettings(network="none")) == (
        "none", {"task_network_mode": "public", "run_network": "none", "backend": "docker", "mode": "none",
                 "decided_by": "operator"})
    with pytest.raises(UnsupportedByBackend, match="--network allowlist"):
        network_for(task("e", ""), EpisodeSettings(network="allowlist"))
    assert network_for(task("f", ""), EpisodeSettings(docker_network="sealed"))[0] == "sealed"


def test_no_engine_is_a_clear_error(tmp_path):
    from sequester.environments.base import UnsupportedByBackend
    from sequester.environments.docker import DockerEnvironment

    with DockerEnvironment(base_url=f"unix://{tmp_path}/none.sock") as env:
        with pytest.raises(UnsupportedByBackend, match="no Docker-API engine answers"):
            env.start(make_task(tmp_path))


def test_owners_that_are_gone():
    import os
    import socket
    import subprocess

    from sequester.environments.docker import engine

    me = engine.owner_label()
    host = socket.gethostname()
    dead = subprocess.Popen(["true"])
    dead.wait()
    assert not engine._owner_gone(me)
    assert engine._owner_gone(f"{host}:{dead.pid}:{engine.process_start_time()}")
    assert engine._owner_gone(f"{host}:{os.getpid()}:1")  # the pid was reused: another process
    assert not engine._owner_gone(f"elsewhere:{dead.pid}:1") and not engine._owner_gone("junk")


def test_kill_tree_kills_every_descendant():
    import os
    import subprocess
    import time

    from sequester.sandbox import procs

    shell = subprocess.Popen(["/bin/sh", "-c", "sleep 1005 & sh -c 'sleep 1006 & wait' & wait"])
    time.sleep(0.3)
    tree = procs.descendants(shell.pid)
    assert len(tree) >= 3
    assert procs.kill_tree(shell.pid, procs.pid_namespace(os.getpid()))
    shell.wait(5)
    time.sleep(0.2)
    assert all(procs.pid_namespace(p) is None or _zombie(p) for p in tree)
    assert not procs.kill_tree(shell.pid, "pid:[0]")  # gone, or not in that namespace: nothing is hit


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_shared_evaluation_can_leave_the_wipe_to_its_caller(task):
    ops = FakeOps(gone=(True,))
    verdict = verify.evaluate_shared(ops, task, workdir="/app", output_limit=4096, wipe_after=False)
    assert verdict.staged and verdict.clean and [c[0] for c in ops.calls].count("remove") == 1  # the one before
    ops.gone = [False]
    ops.discarded = False
    assert not verify.wipe_staged(ops) and ops.discarded  # the caller's wipe fails closed


class _FlakyContainer:
    """A container whose removal the engine fails ``failures`` times (podman under load)."""

    name = "flaky"

    def __init__(self, failures: int, error: Exception | None = None):
        self.failures, self.error, self.removed, self.killed = failures, error, 0, 0

    def kill(self):
        self.killed += 1

    def remove(self, force=False):
        if self.failures:
            self.failures -= 1
            raise self.error or RuntimeError('500 Server Error: "could not be stopped: timed out waiting for file"')
        self.removed += 1


def test_a_removal_the_engine_fails_is_tried_again(monkeypatch):
    from sequester.environments.docker import container as c

    monkeypatch.setattr(c, "_REMOVE_TRIES", (0.0, 0.0, 0.0, 0.0))
    flaky = _FlakyContainer(2)
    c.remove_container(flaky)
    assert flaky.removed == 1 and flaky.killed == 2  # killed before each later try
    with pytest.raises(EngineError, match="did not remove container flaky"):
        c.remove_container(_FlakyContainer(9))
    import docker.errors

    gone = _FlakyContainer(1, docker.errors.NotFound("no such container"))
    c.remove_container(gone)  # already gone: done
    assert gone.removed == 0
