"""``sequester serve --kernel-pool N`` (:mod:`sequester.serve.sessions`): kernel sessions start on warm kernels, each used once."""

from __future__ import annotations

import asyncio
import time

import pytest

from serve_harness import Server, ask, connect, wait_gone

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
