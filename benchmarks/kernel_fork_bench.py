"""Warm kernels that fork, side by side with a cold start and an unconfined ``os.fork``.

    python benchmarks/kernel_fork_bench.py [--runs N] [--init CODE]

Every row is measured in this one run (ratios hold on a noisy machine). The init cell
imports numpy (``--init`` for another); each measure is from the request to the first
cell's result (``a.sum()`` of an array init made):

* a fork of a warm kernel (:meth:`Kernel.fork`): the fork ready and its first cell;
* a cold kernel: started, then the init cell, then the same cell (what a user pays
  without a warm kernel);
* an unconfined ``os.fork`` of a Python that ran the same init: the child answering the
  same cell over a pipe (no sandbox at all: the floor);
* the fork's own memory (private pages, ``smaps_rollup``) against a cold kernel's
  resident memory with the same init; a pool's ``acquire`` of a fork
  (:class:`~sequester.kernel.pool.KernelPool` with ``init``).

Sandlock's published figure (an initialised sandbox forked in under 0.7 ms, 1,000 in
718 ms) is a native in-process fork with no namespaces of its own per copy; a sequester
fork makes six namespaces, a /proc, a workspace and a network per fork.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from _report import report, rss_kb
from sequester import Kernel, Policy
from sequester.kernel.pool import KernelPool

INIT = "import numpy as np\na = np.arange(1000)"
CELL = "int(a.sum())"


def private_kb(pid: int) -> int:
    """Private (copy-on-write broken or never shared) memory of a process, in KiB."""
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(("Private_Clean:", "Private_Dirty:")):
                    total += int(line.split()[1])
    except OSError:
        return 0
    return total


def fork_ms(warm: Kernel) -> float:
    started = time.perf_counter()
    fork = warm.fork()
    result = fork.run(CELL)
    took = (time.perf_counter() - started) * 1000
    assert result.error is None, result.error
    fork.close()
    return took


def cold_ms(policy: Policy, init: str) -> float:
    started = time.perf_counter()
    with Kernel(policy) as kernel:
        assert kernel.run(init).error is None
        result = kernel.run(CELL)
        took = (time.perf_counter() - started) * 1000
    assert result.error is None, result.error
    return took


def os_fork_ms(init: str) -> float:
    namespace: dict = {}
    exec(init, namespace)
    read, write = os.pipe()
    started = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os.write(write, repr(eval(CELL, namespace)).encode())
        os._exit(0)
    os.read(read, 100)
    took = (time.perf_counter() - started) * 1000
    os.waitpid(pid, 0)
    os.close(read)
    os.close(write)
    return took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--init", default=INIT)
    args = parser.parse_args()
    policy = Policy()
    started = time.perf_counter()
    warm = Kernel(policy, init=args.init).start()
    warm_start = (time.perf_counter() - started) * 1000
    try:
        for _ in range(3):
            fork_ms(warm)
            cold_ms(policy, args.init)
        forks, colds, plain = [], [], []
        for _ in range(args.runs):
            forks.append(fork_ms(warm))
            colds.append(cold_ms(policy, args.init))
            plain.append(os_fork_ms(args.init))
        held = [warm.fork() for _ in range(5)]
        for fork in held:
            fork.run(CELL)
        fork_private = statistics.median(private_kb(f.process.popen.pid) for f in held)
        for fork in held:
            fork.close()
        with Kernel(policy) as cold:
            cold.run(args.init)
            cold.run(CELL)
            cold_rss = sum(rss_kb(pid) for pid in cold.process.host_pids())
        with KernelPool(policy, size=2, init=args.init) as pool:
            pool.release(pool.acquire(timeout=120))
            acquires = []
            for _ in range(10):
                while pool.ready < 2:
                    time.sleep(0.01)
                t = time.perf_counter()
                kernel = pool.acquire(timeout=60)
                acquires.append((time.perf_counter() - t) * 1000)
                pool.release(kernel)
    finally:
        warm.close()
    fork_med, cold_med, plain_med = statistics.median(forks), statistics.median(colds), statistics.median(plain)
    fork_p99 = sorted(forks)[min(len(forks) - 1, int(len(forks) * 0.99))]
    print(f"init: {args.init!r}; the warm kernel started (and ran init) in {warm_start:.0f} ms; load "
          f"{os.getloadavg()[0]:.1f}; {args.runs} runs each")
    return report(
        "Warm kernels that fork (ms from the request to the first cell's result)",
        [
            ("fork of a warm kernel, median (p99)", f"{fork_med:.1f} ({fork_p99:.1f})",
             f"cold kernel + init: {cold_med:.1f}", "faster than a cold start", fork_med < cold_med),
            ("fork against an unconfined os.fork", f"{fork_med:.1f}", f"os.fork: {plain_med:.2f}",
             "reported (no sandbox in the reference)", True),
            ("speed-up over a cold start", f"{cold_med / fork_med:.1f}x", "1x", "at least 2x", cold_med >= 2 * fork_med),
            ("a fork's private memory (KiB)", f"{fork_private:.0f}", f"a cold kernel's RSS: {cold_rss}",
             "below the cold kernel's", fork_private < cold_rss),
            ("pool acquire of a fork, median (ms)", f"{statistics.median(acquires):.2f}", "-", "at most 1 ms",
             statistics.median(acquires) <= 1.0),
        ],
    )


if __name__ == "__main__":
    sys.exit(main())
