"""KernelPool (:mod:`sequester.kernel.pool`): kernels started ahead, handed out once each, with real sandboxes."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest
from procs import pid_alive

from sequester.errors import KernelClosedError, PolicyError
from sequester.kernel.client import Kernel
from sequester.kernel.pool import KernelPool
from sequester.policy import Policy


def wait_ready(pool: KernelPool, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while pool.ready < n:
        assert time.monotonic() < deadline, f"the pool did not reach {n} ready kernels"
        time.sleep(0.01)


def gone(pids: list[int]) -> bool:
    return not any(pid_alive(pid) for pid in pids)


def test_a_kernel_is_handed_out_ready_and_used_once() -> None:
    with KernelPool(size=2) as pool:
        wait_ready(pool, 2)
        first = pool.acquire()
        assert first.run("secret = 'of the first user'; import os; open('left', 'w').write('x')").error is None
        pids = first.process.host_pids()
        pool.release(first)
        assert first.closed and gone(pids), "released: its processes are gone"
        wait_ready(pool, 2)
        with pool.acquire() as second:
            assert second is not first
            assert second.run("secret").error.type == "NameError"
            assert second.run("import os; os.path.exists('left')").value == "False"
        assert second.closed


def test_pooled_kernels_keep_the_isolation_of_a_cold_one() -> None:
    with Kernel() as cold, KernelPool(size=1) as pool, pool.acquire() as warm:
        assert warm.mode == cold.mode and warm.report == cold.report
        for probe in ("import ctypes", "import subprocess; subprocess.run(['true'])", "os.fork()"):
            assert (warm.run(f"import os\n{probe}").error is None) == (cold.run(f"import os\n{probe}").error is None)


@pytest.mark.slow
def test_the_lifetime_counts_from_the_hand_out() -> None:
    policy = dataclasses.replace(Policy(), limits=dataclasses.replace(Policy().limits, kernel_timeout=3.0))
    with KernelPool(policy, size=1) as pool:
        wait_ready(pool, 1)
        time.sleep(3.5)  # older than its lifetime while it waited in the pool
        with pool.acquire() as kernel:
            assert kernel.run("1 + 1").value == "2"


@pytest.mark.slow
def test_a_kernel_that_died_in_the_pool_is_never_handed_out() -> None:
    with KernelPool(size=1) as pool:
        wait_ready(pool, 1)
        dead = pool._ready[0]
        os.kill(dead.process.popen.pid, signal.SIGKILL)
        dead.process.popen.wait()
        with pool.acquire(timeout=60) as kernel:
            assert kernel is not dead and kernel.run("2 * 3").value == "6"
        assert dead.closed


@pytest.mark.slow
def test_a_kernel_handed_out_outlives_the_pool() -> None:
    pool = KernelPool(size=1)
    kernel = pool.acquire(timeout=60)
    pool.close()
    time.sleep(1.0)  # the pool's thread must not end (its sandboxes would die with it)
    assert pool._filler.is_alive() and kernel.run("40 + 2").value == "42"
    kernel.close()
    pool._filler.join(10)
    assert not pool._filler.is_alive(), "every kernel closed: the pool's thread ends"


def test_bad_use_is_a_clear_error() -> None:
    with pytest.raises(PolicyError, match="size 0"):
        KernelPool(size=0)
    pool = KernelPool(size=1)
    try:
        other = dataclasses.replace(Policy(), limits=dataclasses.replace(Policy().limits, cell_timeout=1.0))
        with pytest.raises(PolicyError, match="policy the pool was made with"):
            pool.acquire(policy=other)
    finally:
        pool.close()
    with pytest.raises(KernelClosedError, match="pool is closed"):
        pool.acquire()


def test_the_idle_cost_is_reported() -> None:
    with KernelPool(size=2) as pool:
        wait_ready(pool, 2)
        idle = pool.idle_memory()
        one = pool._ready[0].resident_bytes()
        assert one > 1 << 20 and idle >= 2 * one * 0.5
    assert pool.idle_memory() == 0
