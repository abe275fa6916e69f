"""``sequester serve --kernel-pool N`` and ``--episode-pool TASK=N`` (:mod:`sequester.serve.sessions`):
kernel sessions start on warm kernels, episode sessions on warm episodes, each used once."""

from __future__ import annotations

import asyncio
import time

import pytest

from serve_harness import Server, ask, connect, wait_gone
from procs import pid_alive

from sequester.errors import PolicyError
from sequester.serve.serve_settings import ServeSettings


def run(coro):
    return asyncio.run(coro)


def test_kernel_sessions_take_warm_kernels_and_never_share_one() -> None:
    with Server(kernel_pool=2) as server:
        pool = server.manager.kernel_pool
        deadline = time.monotonic() + 60
        while pool.ready < 2:
            assert time.monotonic() < deadline, "the pool did not fill"
            time.sleep(0.02)
        warm = set(id(k) for k in pool._ready)

        async def go():
            async with connect(server) as first:
                await ask(first, {"type": "reset", "data": {"kind": "kernel"}})
                (session,) = server.sessions()
                kernel, pids = session._kernel, session._kernel.process.host_pids()
                await ask(first, {"type": "step", "data": {"type": "cell", "code": "secret = 1"}})
            async with connect(server) as second:
                await ask(second, {"type": "reset", "data": {"kind": "kernel"}})
                (other,) = server.sessions()
                seen = await ask(second, {"type": "step", "data": {"type": "cell", "code": "secret"}})
            return kernel, pids, other._kernel, seen

        kernel, pids, other, seen = run(go())
        assert id(kernel) in warm and kernel is not other, "a warm kernel each, never the same one"
        assert seen["data"]["observation"]["error"]["type"] == "NameError"
        assert all(wait_gone(pid) for pid in pids), "the first session's kernel closed with it"
    pool._filler.join(10)  # shut down: the pool closed, every kernel of it closed, its thread ended
    assert pool.ready == 0 and not pool._filler.is_alive()


def test_the_pool_size_is_checked() -> None:
    with pytest.raises(PolicyError, match="serve.kernel_pool"):
        ServeSettings(kernel_pool=-1)
    assert ServeSettings().kernel_pool == 0
    with pytest.raises(PolicyError, match="needs serve.kernel_pool"):
        ServeSettings(kernel_init="import json")
    with pytest.raises(PolicyError, match="not valid Python"):
        ServeSettings(kernel_pool=1, kernel_init="import (")


def test_kernel_sessions_of_a_pool_with_init_are_forks_with_its_state_each_used_once() -> None:
    with Server(kernel_pool=1, kernel_init="import json\nloaded = json.loads('[1, 2, 3]')") as server:
        async def go():
            seen = []
            for _ in range(2):
                async with connect(server) as ws:
                    await ask(ws, {"type": "reset", "data": {"kind": "kernel"}})
                    (session,) = server.sessions()
                    seen.append(session._kernel.report["view"])
                    got = await ask(ws, {"type": "step", "data": {"type": "cell", "code": "loaded.append(4); loaded"}})
                    seen.append(got["data"]["observation"]["value"])
            return seen

        assert run(go()) == ["fork", "[1, 2, 3, 4]", "fork", "[1, 2, 3, 4]"]


def test_episode_sessions_take_warm_episodes_and_never_share_one(tmp_path) -> None:
    with Server(episode_pool={"python-csv-stats": 2}, max_sessions=3) as server:
        pool = server.manager.episode_pool
        assert pool is not None and pool.capacity == 3
        deadline = time.monotonic() + 60
        while pool.stats().warm.get("python-csv-stats") != 2:
            assert time.monotonic() < deadline, f"the pool did not fill: {pool.stats()}"
            time.sleep(0.02)
        with pool._lock:
            warm = {episode_id for ready in pool._warm.values() for episode_id in ready}

        async def go():
            async with connect(server) as first:
                answer = await ask(first, {"type": "reset", "data": {"task": "python-csv-stats"}})
                assert answer["type"] == "observation", answer
                assert answer["data"]["observation"]["workdir"] == "/app"
                (session,) = server.sessions()
                handle, pid = session._handle, session.init_pid
                await ask(first, {"type": "step", "data": {"type": "exec", "command": "echo secret > /app/left"}})
            async with connect(server) as second:
                await ask(second, {"type": "reset", "data": {"task": "python-csv-stats"}})
                (other,) = server.sessions()
                seen = await ask(second, {"type": "step", "data": {"type": "exec", "command": "cat /app/left"}})
                other_handle = other._handle
            return handle, pid, other_handle, seen

        handle, pid, other, seen = run(go())
        assert handle.episode_id in warm and other.episode_id in warm and handle != other, "a warm one each"
        assert seen["data"]["observation"]["exit_code"] != 0, "nothing of the first session reached the second"
        assert wait_gone(pid), "the first session's episode closed with it"
        deadline = time.monotonic() + 60
        while pool.stats().warm.get("python-csv-stats") != 2:
            assert time.monotonic() < deadline, f"the pool did not fill again: {pool.stats()}"
            time.sleep(0.02)
        with pool._lock:
            inits = [pool._backend.init_pid(e) for ready in pool._warm.values() for e in ready]
    assert inits and not any(pid_alive(p) for p in inits), "the server's stop closed its warm episodes"
    assert pool.stats().warm == {}


def test_the_episode_pool_setting_is_checked() -> None:
    with pytest.raises(PolicyError, match="serve.episode_pool.x"):
        ServeSettings(episode_pool={"x": -1})
    with pytest.raises(PolicyError, match="more than max_sessions"):
        ServeSettings(episode_pool={"x": 3, "y": 2}, max_sessions=4)
    with pytest.raises(PolicyError, match="serve.episode_pool"):
        ServeSettings(episode_pool=["x"])  # type: ignore[arg-type]
    assert ServeSettings().episode_pool == {}
    with pytest.raises(PolicyError, match=r"warm\['no-such'\]"):
        Server(episode_pool={"no-such": 1})
