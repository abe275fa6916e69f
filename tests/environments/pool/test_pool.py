"""The episode pool's local backend (:mod:`sequester.environments.pool`) on real episodes.

Host-mode episodes of the example tasks, in this process: warm episodes handed out
already started and each only once; callers beyond capacity waiting first come first
served, refused past ``max_waiting`` and when their wait runs out; async waiters that never
block the loop and, cancelled, give back their place, their slot or their episode; warm
episodes giving way to a caller of another task; and nothing left behind (no process, no
state folder, no thread) after ``close`` and ``shutdown``. Ray is never imported.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from paths import EXAMPLES, SRC
from procs import pid_alive, pids_with_cmdline, wait_until

from sequester.environments.pool import EpisodeHandle, EpisodePool, PoolFull
from sequester.environments.settings import EpisodeSettings
from sequester.errors import EpisodeError, PolicyError, SandboxError
from sequester.images.image_settings import ImageSettings

TASK, OTHER = "python-csv-stats", "c-word-count"
SOLVE = (EXAMPLES / TASK / "solution" / "solve.sh").read_text()


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def settings(state: Path) -> EpisodeSettings:
    """Host mode (no image: nothing is pulled), the episodes' layers under the test's folder."""
    return EpisodeSettings(images=ImageSettings(source="host"), state_dir=state)


def pool_of(settings: EpisodeSettings, **kw) -> EpisodePool:
    return EpisodePool(EXAMPLES, settings=settings, calibration="off", **kw)


def layers(state: Path) -> list[Path]:
    """This process's episode folders under the state folder (their writable layers)."""
    return sorted(state.glob(f"{os.getpid()}-*")) if state.is_dir() else []


def episode_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("episode-", "episode-pool-"))]


def wait_for(condition, timeout: float = 60) -> bool:
    return wait_until(condition, timeout, interval=0.01)


def warm_ids(pool: EpisodePool) -> set[str]:
    with pool._lock:
        return {episode_id for ready in pool._warm.values() for episode_id in ready}


def marker() -> str:
    return f"{4000 + secrets.randbelow(5000)}.{secrets.randbelow(10**6)}"


def sleeper(ep: EpisodeHandle) -> str:
    """A process of the episode's, found on the host by its command line."""
    mark = marker()
    assert ep.exec(f"nohup sleep {mark} >/dev/null 2>&1 & echo started").stdout == "started\n"
    assert wait_for(lambda: pids_with_cmdline(b"sleep\0" + mark.encode() + b"\0"), 10)
    return mark


def sleeping(mark: str) -> list[int]:
    return pids_with_cmdline(b"sleep\0" + mark.encode() + b"\0")


# -- warm episodes ---------------------------------------------------------------------------


@pytest.mark.slow
def test_a_warm_acquire_hands_out_a_started_episode_once(settings, state):
    with pool_of(settings, capacity=4, warm={TASK: 2}) as pool:
        assert wait_for(lambda: pool.stats().warm.get(TASK) == 2), pool.stats()
        before = warm_ids(pool)
        started = time.perf_counter()
        ep = pool.acquire(TASK)
        took = time.perf_counter() - started
        print(f"warm acquire: {took * 1e3:.3f} ms")  # measured, not asserted (docs/benchmarks.md)
        assert ep.episode_id in before, "the episode handed out is one of the warm ones"
        assert pid_alive(pool.init_pid(ep)), "it was started before it was asked for"
        assert ep.instruction.strip() == (EXAMPLES / TASK / "instruction.md").read_text().strip()
        assert ep.workdir == "/app" and ep.node_id == "local" and ep.actor == -1
        secret = secrets.token_hex(8)
        assert ep.write_file("/app/secret", secret) == len(secret)
        assert ep.exec("cat /app/secret").stdout == secret
        assert wait_for(lambda: pool.stats().warm.get(TASK) == 2), "a replacement is started in the background"
        pid = pool.init_pid(ep)
        ep.close()
        assert not pid_alive(pid), "closed: its processes are gone"
        with pytest.raises(EpisodeError, match="closed"):
            ep.exec("true")
        seen = {ep.episode_id}
        for _ in range(3):  # every episode handed out is a fresh one: none comes back
            with pool.acquire(TASK) as again:
                assert again.episode_id not in seen
                seen.add(again.episode_id)
                assert again.exec("cat /app/secret 2>&1; ls /app").stdout.startswith("cat: /app/secret: No such file")
        assert pool.stats().held == 0
    assert layers(state) == [], "shut down: every episode's layers are removed, the warm ones' too"


@pytest.mark.slow
def test_a_warm_episode_of_another_task_gives_way(settings):
    with pool_of(settings, capacity=2, warm={TASK: 2}) as pool:
        assert wait_for(lambda: pool.stats().warm.get(TASK) == 2)
        other = pool.reset(OTHER, wait_timeout=30)  # the pool is full of warm episodes: one is closed for it
        assert other.task == OTHER and other.exec("echo ok").stdout == "ok\n"
        stats = pool.stats()
        assert stats.held == 1 and stats.warm == {TASK: 1} and stats.capacity == 2
        same = pool.reset(TASK, wait_timeout=0)  # the warm one left: no wait, no slot needed
        assert pool.stats().warm == {} and pool.stats().held == 2
        other.close()
        same.close()
        assert wait_for(lambda: pool.stats().warm.get(TASK) == 2), "both slots warm again"


# -- waiting at capacity ---------------------------------------------------------------------


@pytest.mark.slow
def test_callers_beyond_capacity_wait_first_come_first_served(settings):
    with pool_of(settings, capacity=1, wait_timeout=120) as pool:
        held = pool.reset(TASK)
        order: list[str] = []
        got: dict[str, EpisodeHandle] = {}

        def caller(name: str) -> None:
            got[name] = pool.reset(OTHER if name == "first" else TASK)
            order.append(name)

        first = threading.Thread(target=caller, args=("first",))
        first.start()
        assert wait_for(lambda: pool.stats().waiting == 1)
        second = threading.Thread(target=caller, args=("second",))
        second.start()
        assert wait_for(lambda: pool.stats().waiting == 2)
        time.sleep(0.2)
        assert order == [], "nobody gets a slot while the pool is full"
        held.close()
        first.join(60)
        assert order == ["first"] and pool.stats().waiting == 1, "the first to wait has the freed slot"
        assert got["first"].task == OTHER and got["first"].exec("echo 1").stdout == "1\n"
        got["first"].close()
        second.join(60)
        assert order == ["first", "second"] and pool.stats().waiting == 0
        got["second"].close()


@pytest.mark.slow
def test_a_wait_runs_out_and_max_waiting_refuses_one_more(settings):
    with pool_of(settings, capacity=1, max_waiting=1) as pool:
        held = pool.reset(TASK)
        started = time.monotonic()
        with pytest.raises(PoolFull, match=r"no slot came free within 0\.3 s .* all 1 are taken \(1 handed out"):
            pool.reset(TASK, wait_timeout=0.3)
        assert 0.3 <= time.monotonic() - started < 5
        with pytest.raises(PoolFull, match=r"1 of its 1 slots are taken"):
            pool.reset(TASK, wait_timeout=0)  # 0: refused at once
        waiting = threading.Thread(target=lambda: pytest.raises(PoolFull, pool.reset, TASK, wait_timeout=1.5))
        waiting.start()
        assert wait_for(lambda: pool.stats().waiting == 1)
        started = time.monotonic()
        with pytest.raises(PoolFull, match=r"1 callers wait already \(max_waiting 1"):
            pool.reset(TASK)
        assert time.monotonic() - started < 1, "one more than max_waiting is refused at once"
        waiting.join(30)
        assert pool.stats().waiting == 0 and pool.stats().held == 1
        held.close()
        pool.reset(TASK, wait_timeout=0).close()  # nothing leaked: the slot is free


@pytest.mark.slow
def test_async_waiters_do_not_block_the_loop_and_all_score(settings):
    """Four episodes on a pool of two: two wait on the loop while a heartbeat goes on."""

    async def main(pool: EpisodePool) -> tuple[list[float | None], int, int]:
        beats = 0
        stop = asyncio.Event()

        async def heartbeat() -> None:
            nonlocal beats
            while not stop.is_set():
                beats += 1
                await asyncio.sleep(0.005)

        async def one(oracle: bool) -> float | None:
            async with await pool.aacquire(TASK) as ep:
                if oracle:
                    assert await ep.awrite_file("/tmp/solve.sh", SOLVE) == len(SOLVE.encode())
                    assert (await ep.aexec("bash /tmp/solve.sh", 120)).exit_code == 0
                assert len(await ep.aread_file("/app/data.csv")) > 0
                return (await ep.aevaluate()).reward

        beat = asyncio.ensure_future(heartbeat())
        work = asyncio.gather(*(one(i % 2 == 0) for i in range(4)))
        await asyncio.sleep(0.05)
        most_waiting = pool.stats().waiting
        rewards = await work
        stop.set()
        await beat
        return rewards, beats, most_waiting

    with pool_of(settings, capacity=2) as pool:
        rewards, beats, waited = asyncio.run(main(pool))
        assert rewards == [1.0, 0.0, 1.0, 0.0]
        assert waited == 2, "two callers waited for a slot"
        assert beats > 20, "the event loop went on while they waited and their episodes ran"
        assert pool.stats().held == 0


@pytest.mark.slow
def test_a_cancelled_async_caller_gives_back_its_place_its_slot_and_its_episode(settings, state):
    async def main(pool: EpisodePool) -> None:
        held = await pool.aacquire(TASK)
        # Cancelled while it waits: it leaves the queue.
        waiter = asyncio.ensure_future(pool.aacquire(TASK))
        while pool.stats().waiting != 1:
            await asyncio.sleep(0.005)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert pool.stats().waiting == 0
        # Cancelled just as it is given the slot (the close hands it over, then the cancel
        # comes before the caller runs again): the slot goes back.
        waiter = asyncio.ensure_future(pool.aacquire(TASK))
        while pool.stats().waiting != 1:
            await asyncio.sleep(0.005)
        pool.close(held)  # (on the loop's thread: the waiter cannot run before the cancel)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        stats = pool.stats()
        assert (stats.waiting, stats.held, stats.starting) == (0, 0, 0), stats
        # Cancelled while its episode starts: the episode is closed, then its slot freed.
        starting = asyncio.ensure_future(pool.aacquire(TASK))
        while pool.stats().starting != 1:
            await asyncio.sleep(0)
        starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starting
        while pool.stats().closing:
            await asyncio.sleep(0.01)
        # No slot leaked: the one slot is free at once, for a caller that will not wait.
        again = await pool.aacquire(TASK, wait_timeout=0)
        await again.aclose()

    with pool_of(settings, capacity=1) as pool:
        asyncio.run(main(pool))
        assert pool.stats() == type(pool.stats())(capacity=1, held=0)
        assert layers(state) == [], "the cancelled start's episode was closed and its layers removed"


# -- errors, ends ----------------------------------------------------------------------------


@pytest.mark.slow
def test_unknown_closed_and_evaluated_episodes_are_refused_clearly(settings):
    with pool_of(settings, capacity=2) as pool:
        with pytest.raises(EpisodeError, match="not an episode of this pool"):
            pool.exec("0" * 32, "true")
        with pytest.raises(EpisodeError, match="not an episode of this pool"):
            pool.close("0" * 32)
        for task_id in ("../tasks", "/etc", ".hidden", "", "no-such", f"{TASK}/../../x"):
            with pytest.raises(PolicyError, match="task_id"):
                pool.reset(task_id)
        ep = pool.reset(TASK)
        with pytest.raises(SandboxError, match="No such file"):
            ep.read_file("/no/such/file")
        big = ep.exec("head -c 100 /dev/zero > /app/z && echo ok")
        assert big.stdout == "ok\n"
        out = ep.exec(f"cat {EXAMPLES / TASK / 'solution' / 'solve.sh'}")
        assert out.exit_code != 0, "the tasks folder is hidden from the agent"
        assert ep.evaluate().reward == 0.0
        for call in (lambda: ep.exec("true"), ep.evaluate, lambda: ep.read_file("/app/data.csv")):
            with pytest.raises(EpisodeError, match="verdict is final"):
                call()
        ep.close()
        ep.close()  # idempotent
        with pytest.raises(EpisodeError, match="closed"):
            asyncio.run(ep.aexec("true"))


def test_the_read_cap_cuts_what_comes_back(settings):
    with pool_of(settings, capacity=1, read_cap=10) as pool, pool.reset(TASK) as ep:
        ep.write_file("/app/long", b"x" * 25)
        content = ep.read_file("/app/long")
        assert content == b"x" * 10 and content.truncated
        ep.write_file("/app/short", b"y" * 10)
        exact = ep.read_file("/app/short")
        assert exact == b"y" * 10 and not exact.truncated


@pytest.mark.slow
def test_shutdown_leaves_no_process_no_layers_and_no_thread(settings, state):
    pool = pool_of(settings, capacity=4, warm={TASK: 2})
    try:
        assert wait_for(lambda: pool.stats().warm.get(TASK) == 2)
        held = [pool.reset(TASK), pool.reset(OTHER)]
        marks = [sleeper(ep) for ep in held]
        inits = [pool.init_pid(ep) for ep in held]
        assert len(layers(state)) >= 3
        ended: list[object] = []

        def long_command() -> None:
            try:
                ended.append(held[0].exec("sleep 600"))
            except Exception as exc:  # noqa: BLE001 - what it ends with does not matter: that it ends
                ended.append(exc)

        slow = threading.Thread(target=long_command)
        slow.start()  # a command in flight: it ends at once
        time.sleep(0.2)
    except BaseException:
        pool.shutdown()
        raise
    started = time.monotonic()
    pool.shutdown()
    assert time.monotonic() - started < 20
    slow.join(10)
    assert not slow.is_alive() and ended
    assert not any(sleeping(m) for m in marks) and not any(pid_alive(p) for p in inits)
    assert layers(state) == [], "every episode's layers are removed: handed out, warm and starting"
    assert wait_for(lambda: not episode_threads(), 10), episode_threads()
    with pytest.raises(EpisodeError, match="shut down"):
        held[1].exec("true")
    with pytest.raises(EpisodeError, match="shut down"):
        pool.reset(TASK)
    pool.shutdown()  # idempotent


def test_bad_arguments_are_refused_naming_them(settings, tmp_path):
    for kw, name in (
        ({"capacity": 0}, "capacity"),
        ({"capacity": True}, "capacity"),
        ({"warm": {"no-such": 1}}, "warm"),
        ({"warm": {TASK: -1}}, "warm"),
        ({"warm": {TASK: 2, f"{TASK}/": 1}}, "warm"),
        ({"warm": [TASK]}, "warm"),
        ({"capacity": 2, "warm": {TASK: 2, OTHER: 1}}, "warm"),
        ({"wait_timeout": -1}, "wait_timeout"),
        ({"wait_timeout": float("nan")}, "wait_timeout"),
        ({"max_waiting": -1}, "max_waiting"),
        ({"calibration": "sometimes"}, "calibration"),
        ({"backend": "k8s"}, "backend"),
        ({"episodes_per_actor": 4}, "episodes_per_actor"),
        ({"n_actors": 2, "backend": "local"}, "n_actors"),
        ({"backend": "ray", "capacity": 2}, "capacity"),
    ):
        with pytest.raises(PolicyError, match=name):
            EpisodePool(EXAMPLES, settings=settings, **kw)
    with pytest.raises(PolicyError, match="tasks_dir"):
        EpisodePool(tmp_path / "missing")
    assert not episode_threads(), "a refused pool starts nothing"


@pytest.mark.slow
def test_the_local_backend_never_imports_ray(tmp_path):
    code = f"""
import sys
from pathlib import Path
from sequester.cluster import EpisodePool
from sequester.environments.settings import EpisodeSettings
from sequester.images.image_settings import ImageSettings
settings = EpisodeSettings(images=ImageSettings(source="host"), state_dir=Path({str(tmp_path / "state")!r}))
with EpisodePool({str(EXAMPLES)!r}, capacity=1, settings=settings, calibration="off") as pool:
    with pool.reset({TASK!r}) as ep:
        print(ep.exec("echo ok").stdout.strip())
print("ray" in sys.modules, any(m.startswith("ray.") for m in sys.modules))
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok", "False", "False"]


@pytest.fixture(autouse=True)
def _no_episode_left(state: Path) -> Iterator[None]:
    yield
    assert layers(state) == [], "a test left an episode's layers behind"
