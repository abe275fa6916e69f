"""``EpisodePool`` (:mod:`sequester.cluster.pool`) on a real two-node Ray cluster (loopback, :mod:`ray_cluster`).

Episodes of the example tasks through the pool, sync and async, spread over both nodes,
scored as the local backend scores them; each call routed to the episode's own actor;
bad use refused at once with clear errors; the verdict alone comes back; and an actor
killed outright, or the pool shut down, leaves no process of its episodes behind.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import shutil
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from paths import EXAMPLES

ray = pytest.importorskip("ray")

import ray_cluster  # noqa: E402 - after the skip: it is only of use with Ray
from conditions import visible_tempdir  # noqa: E402
from procs import pids_with_cmdline, wait_until  # noqa: E402

from sequester.cluster import ClusterError, EpisodePool  # noqa: E402
from sequester.cluster.node import cluster_cache  # noqa: E402
from sequester.cluster.pool import EpisodeHandle, Verdict  # noqa: E402
from sequester.errors import EpisodeError, PolicyError, SandboxError  # noqa: E402

TASKS = ("python-csv-stats", "c-word-count", "pinned-pytest", "workspace-git-free")
SOLVE = {name: (EXAMPLES / name / "solution" / "solve.sh").read_text() for name in TASKS}
JOBS = [(task, oracle) for task in TASKS for oracle in (True, False)]  # 8 episodes


@pytest.fixture(scope="module")
def cluster() -> Iterator[ray_cluster.RayCluster]:
    with ray_cluster.running() as started:
        yield started


@pytest.fixture(scope="module")
def pool(cluster: ray_cluster.RayCluster) -> Iterator[EpisodePool]:
    # Half a CPU per actor: the tests' smaller pools fit beside it on the 2-CPU cluster.
    with EpisodePool(2, EXAMPLES, actor_cpus=0.5, episodes_per_actor=8) as p:
        yield p


def marked(marker: str) -> list[int]:
    """Pids of processes whose command line is ``sleep <marker>``."""
    return pids_with_cmdline(b"sleep\0" + marker.encode() + b"\0")


def wait_for(condition: Any, timeout: float = 15.0) -> bool:
    return wait_until(condition, timeout, interval=0.1)


def new_marker() -> str:
    return f"{4000 + secrets.randbelow(5000)}.{secrets.randbelow(10**6)}"


def start_sleeper(ep: EpisodeHandle, marker: str) -> None:
    out = ep.exec(f"nohup sleep {marker} >/dev/null 2>&1 & echo started", timeout=30)
    assert out.stdout == "started\n", out
    assert wait_for(lambda: marked(marker), 10), "the episode's sleep is not visible in /proc"


def local_reward(task: str, oracle: bool) -> float | None:
    """The same episode on the local backend, in this process (the reference)."""
    from sequester.environments import open_environment
    from sequester.sandbox.nsexec.client import shared_nsexec
    from sequester.environments.settings import EpisodeSettings

    env = open_environment(EpisodeSettings(), nsexec=shared_nsexec())
    try:
        env.start(EXAMPLES / task)
        if oracle:
            env.exec(SOLVE[task], 300)
        return env.evaluate().reward
    finally:
        env.close()


# -- episodes ------------------------------------------------------------------------------


@pytest.mark.slow
def test_eight_concurrent_episodes_score_as_the_local_backend_on_both_nodes(pool, cluster):
    def one(job: tuple[str, bool]) -> tuple[float | None, str]:
        task, oracle = job
        ep = pool.reset(task)
        try:
            assert ep.task == task
            assert ep.instruction.strip() == (EXAMPLES / task / "instruction.md").read_text().strip()
            if oracle:
                out = ep.exec(SOLVE[task], timeout=300)
                assert out.exit_code == 0 and not out.timed_out, out
            verdict = ep.evaluate()
            assert verdict.error is None, verdict
            return verdict.reward, ep.node_id
        finally:
            ep.close()

    with ThreadPoolExecutor(len(JOBS)) as threads:
        results = list(threads.map(one, JOBS))
        reference = list(threads.map(lambda job: local_reward(*job), JOBS))
    rewards = [reward for reward, _ in results]
    assert rewards == [1.0 if oracle else 0.0 for _, oracle in JOBS]
    assert rewards == reference
    assert {node for _, node in results} == set(cluster.node_ids) and len(cluster.node_ids) == 2
    assert all(a.alive and a.episodes == 0 for a in pool.actors())


@pytest.mark.slow
def test_each_call_is_routed_to_its_own_episode(pool):
    eps = [pool.reset("python-csv-stats") for _ in range(4)]
    try:
        assert len({ep.actor for ep in eps}) == 2  # and so two episodes share each actor
        tokens = [secrets.token_hex(8) for _ in eps]
        for ep, token in zip(eps, tokens):
            assert ep.write_file(f"/app/token-{token}", token) == len(token)
            assert pool.exec(ep, f"echo {token} > /app/token").exit_code == 0
        for ep, token in zip(eps, tokens):
            assert ep.exec("cat /app/token").stdout == f"{token}\n"
            assert ep.read_file("/app/token") == f"{token}\n".encode()
            assert ep.read_file(f"/app/token-{token}") == token.encode()
            others = [t for t in tokens if t != token]
            listing = ep.exec("ls /app").stdout
            assert all(f"token-{t}" not in listing for t in others), listing
            for other in others:  # another episode's file: not found, here
                with pytest.raises(SandboxError, match="No such file"):
                    ep.read_file(f"/app/token-{other}")
    finally:
        for ep in eps:
            pool.close(ep)


@pytest.mark.slow
def test_the_async_variants_run_eight_episodes_at_once(pool):
    async def one(task: str, oracle: bool) -> tuple[float | None, bytes, bool]:
        ep = await pool.areset(task)
        try:
            if oracle:
                assert await ep.awrite_file("/tmp/solve.sh", SOLVE[task]) == len(SOLVE[task].encode())
                out = await pool.aexec(ep, "bash /tmp/solve.sh", 300)
                assert out.exit_code == 0, out
            echoed = await ep.aexec("echo $((6 * 7))")
            assert echoed.stdout == "42\n"
            content = await pool.aread_file(ep, "/tmp/solve.sh") if oracle else b""
            verdict = await pool.aevaluate(ep)
            return verdict.reward, content, content.truncated if oracle else False
        finally:
            await ep.aclose()
            await pool.aclose(ep)  # idempotent

    async def main() -> list[Any]:
        return await asyncio.gather(*(one(task, oracle) for task, oracle in JOBS))

    results = asyncio.run(main())
    assert [r[0] for r in results] == [1.0 if oracle else 0.0 for _, oracle in JOBS]
    assert [r[1] for r in results] == [SOLVE[t].encode() if o else b"" for t, o in JOBS]
    assert not any(r[2] for r in results)


@pytest.mark.slow
def test_the_verdict_is_all_that_comes_back(pool):
    ep = pool.reset("pinned-pytest")  # pytest prints its tests' names and asserts
    try:
        verdict = ep.evaluate()
    finally:
        ep.close()
    assert isinstance(verdict, Verdict) and verdict.reward == 0.0 and verdict.error is None
    assert set(vars(verdict)) == {"reward", "rewards", "zero_reason", "tampering", "notes", "error"}
    assert not hasattr(verdict, "output") and not hasattr(verdict, "files")
    tests = (EXAMPLES / "pinned-pytest" / "tests" / "test_outputs.py").read_text()
    test_names = re.findall(r"^def (test_\w+)", tests, re.M)
    assert test_names
    text = repr(verdict)
    assert not any(name in text for name in test_names) and "pytest" not in text and "assert" not in text


# -- bad use -----------------------------------------------------------------------------------


def test_bad_arguments_are_refused_naming_them(tmp_path):
    for n in (0, -1, True, 1.5, "2"):
        with pytest.raises(PolicyError, match="n_actors"):
            EpisodePool(n, EXAMPLES)  # type: ignore[arg-type]
    with pytest.raises(PolicyError, match="episodes_per_actor"):
        EpisodePool(1, EXAMPLES, episodes_per_actor=0)
    with pytest.raises(PolicyError, match="actor_cpus"):
        EpisodePool(1, EXAMPLES, actor_cpus=float("nan"))
    with pytest.raises(PolicyError, match="tasks_dir"):
        EpisodePool(1, tmp_path / "missing")


@pytest.mark.slow
def test_tasks_outside_the_tasks_folder_are_refused_and_no_task_is_visible(cluster, tmp_path):
    # The tasks folder where a sandbox would see it if it were not hidden (root: /opt).
    root = visible_tempdir("pool-tasks", tmp_path)
    try:
        tasks = root / "tasks"
        ok = "python-csv-stats"  # (a copy under another name collides in the nodes' task cache: bundles.py)
        shutil.copytree(EXAMPLES / ok, tasks / ok)
        shutil.copytree(EXAMPLES / "python-csv-stats", root / "beside")
        (tasks / "escape").symlink_to(root / "beside")
        root.chmod(0o755)
        with EpisodePool(1, tasks, actor_cpus=0.25, episodes_per_actor=2) as small:
            for task_id in ("../beside", f"{ok}/../../beside", str(tasks / ok), "/etc", ".hidden", "", "no-such",
                            "escape", "escape/"):
                with pytest.raises(PolicyError, match="task_id"):
                    small.reset(task_id)
            assert [a.episodes for a in small.actors()] == [0]  # nothing reached the actor
            ep = small.reset(ok)
            assert ep.exec("test -f data.csv").exit_code == 0
            # Neither the driver's tasks folder nor the node's cache of shipped tasks (other
            # tasks' tests and solutions) is in the agent's view: no file of either.
            out = ep.exec(f"cat {tasks / ok / 'solution' / 'solve.sh'}")
            assert out.exit_code != 0 and "No such file" in out.stderr, out
            assert (cluster_cache() / "tasks").is_dir()
            out = ep.exec(f"find {cluster_cache()} {tasks} -type f 2>/dev/null | head")
            assert out.stdout == "", out
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_unknown_closed_and_evaluated_episodes_are_refused_clearly(pool):
    with pytest.raises(EpisodeError, match="not an episode of this pool"):
        pool.exec("0" * 32, "true")
    with pytest.raises(EpisodeError, match="not an episode of this pool"):
        pool.close("0" * 32)
    ep = pool.reset("python-csv-stats")
    with pytest.raises(SandboxError, match="No such file") as raised:
        ep.read_file("/no/such/file")
    assert not isinstance(raised.value, ray.exceptions.RayError)  # the actor's error, not Ray's wrapper
    assert "Traceback" not in str(raised.value)
    assert ep.evaluate().reward == 0.0
    for call in (lambda: ep.exec("true"), ep.evaluate, lambda: ep.read_file("/app/data.csv")):
        with pytest.raises(EpisodeError, match="verdict is final") as raised:
            call()
        assert not isinstance(raised.value, ray.exceptions.RayError)
    ep.close()
    ep.close()  # idempotent
    with pytest.raises(EpisodeError, match="closed"):
        ep.exec("true")
    with pytest.raises(EpisodeError, match="closed"):
        asyncio.run(ep.aexec("true"))


@pytest.mark.slow
def test_a_reset_beyond_capacity_waits_for_a_slot_or_is_refused(cluster):
    from sequester.errors import PoolFull

    with EpisodePool(1, EXAMPLES, actor_cpus=0.25, episodes_per_actor=2, max_waiting=1) as small:
        assert small.capacity == 2
        held = [small.reset("python-csv-stats") for _ in range(2)]
        for _ in range(3):  # wait_timeout=0: refused at once, a ClusterError as before
            start = time.monotonic()
            with pytest.raises(ClusterError, match="full") as refused:
                small.reset("python-csv-stats", wait_timeout=0)
            assert isinstance(refused.value, PoolFull) and time.monotonic() - start < 2
        with ThreadPoolExecutor(1) as waiting:
            later = waiting.submit(small.reset, "python-csv-stats")  # waits in the queue for a slot
            assert wait_for(lambda: small.stats().waiting == 1)
            with pytest.raises(ClusterError, match=r"max_waiting 1"):  # one more than max_waiting
                small.reset("python-csv-stats")
            time.sleep(0.5)
            assert not later.done(), "nobody gets a slot while the pool is full"
            held[0].close()
            again = later.result(60)  # the closed one's slot, to the caller that waited
        assert again.exec("echo ok").stdout == "ok\n"
        assert [a.episodes for a in small.actors()] == [2]


@pytest.mark.slow
def test_warm_episodes_are_kept_on_the_actors(cluster):
    with EpisodePool(1, EXAMPLES, actor_cpus=0.25, episodes_per_actor=2, warm={"python-csv-stats": 1}) as small:
        assert wait_for(lambda: small.stats().warm == {"python-csv-stats": 1}, 120), small.stats()
        with small._lock:
            warm = {e for ready in small._warm.values() for e in ready}
        ep = small.acquire("python-csv-stats")
        assert ep.episode_id in warm and ep.exec("echo ok").stdout == "ok\n"
        assert wait_for(lambda: small.stats().warm == {"python-csv-stats": 1}, 120), "refilled on the actor"
        assert [a.episodes for a in small.actors()] == [2]
        ep.close()
        assert [a.episodes for a in small.actors()] == [1]


@pytest.mark.slow
def test_a_pool_the_cluster_cannot_place_is_refused_not_awaited(cluster):
    start = time.monotonic()
    with pytest.raises(ClusterError, match="could not place"):
        EpisodePool(1, EXAMPLES, actor_cpus=64, start_timeout=3)
    assert time.monotonic() - start < 30


# -- losses and shutdown ---------------------------------------------------------------------


@pytest.mark.slow
def test_a_killed_actor_loses_its_episodes_and_leaves_no_process(cluster):
    pool = EpisodePool(2, EXAMPLES, actor_cpus=0.25, episodes_per_actor=4)
    try:
        eps = [pool.reset("python-csv-stats") for _ in range(3)]
        victim = eps[0].actor
        doomed = [ep for ep in eps if ep.actor == victim]
        survivor = next(ep for ep in eps if ep.actor != victim)
        markers = [new_marker() for _ in doomed]
        for ep, marker in zip(doomed, markers):
            start_sleeper(ep, marker)
        pid = next(a.pid for a in pool.actors() if a.index == victim)
        assert pid in cluster.processes()  # (an actor renames its process: not in worker_pids())
        os.kill(pid, signal.SIGKILL)  # the actor's worker process, killed outright
        for ep in doomed:
            with pytest.raises(ClusterError, match=f"episode {ep.episode_id}.*lost.*actor #{victim}"):
                ep.exec("true")
            with pytest.raises(ClusterError, match="lost"):  # and every later call too
                pool.evaluate(ep)
            ep.close()  # a lost episode is just forgotten
        assert wait_for(lambda: not any(marked(m) for m in markers), 15), "an episode process outlived its actor"
        assert [a.alive for a in sorted(pool.actors(), key=lambda a: a.index)] == [i != victim for i in range(2)]
        assert survivor.exec("echo still here").stdout == "still here\n"
        again = pool.reset("python-csv-stats")  # onto the live actor
        assert again.actor == survivor.actor and again.exec("echo ok").stdout == "ok\n"
        assert pool.capacity == 4
        marker = new_marker()
        start_sleeper(again, marker)
        survivor_pid = next(a.pid for a in pool.actors() if a.alive)
    except BaseException:
        pool.shutdown()
        raise
    pool.shutdown()
    assert wait_for(lambda: not marked(marker), 15), "an episode process outlived the pool's shutdown"
    assert wait_for(lambda: survivor_pid not in cluster.processes(), 15), "the actor outlived the shutdown"
    with pytest.raises(EpisodeError, match="shut down"):
        again.exec("true")
    with pytest.raises(ClusterError, match="shut down"):
        pool.reset("python-csv-stats")
    pool.shutdown()  # idempotent


@pytest.mark.slow
def test_a_task_whose_calibration_fails_is_refused_before_anything_starts(cluster, tmp_path, monkeypatch):
    """A record (as `sequester calibrate --backend ray` keeps it: the nodes choose their
    systems, so its key has none) whose oracle scored 0: the pool refuses the reset with
    TaskNotCalibrated, and no actor starts an episode."""
    from sequester import __version__
    from sequester.calibration import CalibrationRecord, calibration_key, default_store, settings_fields
    from sequester.environments.settings import EpisodeSettings
    from sequester.errors import TaskNotCalibrated
    from sequester.tasks.checksum import task_checksum

    monkeypatch.setenv("SEQUESTER_CALIBRATION_DIR", str(tmp_path / "store"))
    key = calibration_key(task_checksum=task_checksum(EXAMPLES / "python-csv-stats"), system=None,
                          settings=settings_fields(EpisodeSettings()), version=__version__)
    default_store().put(CalibrationRecord(key.digest, "python-csv-stats", key.fields,
                                          {"oracle": [0.0], "nop": [0.0]}, 1, "now"))
    with EpisodePool(1, EXAMPLES, actor_cpus=0.25, episodes_per_actor=2) as small:
        with pytest.raises(TaskNotCalibrated, match="oracle scored 0"):
            small.reset("python-csv-stats")
        assert [a.episodes for a in small.actors()] == [0]
    with pytest.raises(PolicyError, match="calibration"):
        EpisodePool(1, EXAMPLES, calibration="sometimes")
