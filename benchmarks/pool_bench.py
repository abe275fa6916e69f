"""``EpisodePool`` on a two-node Ray cluster, side by side with the same episodes in-process, in one run.

    python benchmarks/pool_bench.py [--episodes 96] [--concurrency 32] [--execs 50] [--actors 2]

A real cluster on loopback (``tests/helpers/ray_cluster.py``: ``ray start --head`` plus a
second node, each with its own raylet, object store and workers), an
:class:`~sequester.cluster.EpisodePool` of ``--actors`` actors spread over both nodes,
driven from this process with the async API (one event loop):

* ``--episodes`` episodes of python-csv-stats (reset + one exec + evaluate + close),
  ``--concurrency`` in flight at once: episodes per second, no failure;
* ``exec`` of ``echo hi``: the round trip p50 / p99 of one episode alone (``--execs`` back to
  back), and of ``--concurrency`` episodes stepping at once.

The reference column is the same work in this process: ``open_environment`` (the local
backend) on threads, no Ray in between. On one machine both share its cores, so the pool's
column shows what the actors, the object store and the routing cost; across real nodes the
pool adds their cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "helpers"))

import ray_cluster  # noqa: E402
from _report import report  # noqa: E402
from sequester.cluster import EpisodePool  # noqa: E402
from sequester.environments import open_environment  # noqa: E402
from sequester.sandbox.nsexec.client import shared_nsexec  # noqa: E402
from sequester.environments.settings import EpisodeSettings  # noqa: E402

EXAMPLES = ROOT / "examples" / "tasks"
TASK = "python-csv-stats"


def pct(xs: list[float], q: float) -> float:
    """The q-quantile of xs, in ms."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")


# -- through the pool ------------------------------------------------------------------------


async def pool_episodes(pool: EpisodePool, episodes: int, concurrency: int) -> tuple[int, float, set[str]]:
    gate = asyncio.Semaphore(concurrency)
    nodes: set[str] = set()

    async def one() -> bool:
        async with gate:
            ep = await pool.areset(TASK)
            nodes.add(ep.node_id)
            try:
                ok = (await ep.aexec("echo hi")).stdout == "hi\n"
                return ok and (await ep.aevaluate()).reward == 0.0
            finally:
                await ep.aclose()

    wall = time.perf_counter()
    results = await asyncio.gather(*(one() for _ in range(episodes)), return_exceptions=True)
    return sum(r is not True for r in results), time.perf_counter() - wall, nodes


async def pool_steps(pool: EpisodePool, sessions: int, execs: int) -> tuple[list[float], int]:
    eps = await asyncio.gather(*(pool.areset(TASK) for _ in range(sessions)))
    times: list[float] = []
    bad = 0

    async def steps(ep) -> None:
        nonlocal bad
        for _ in range(execs):
            t = time.perf_counter()
            out = await ep.aexec("echo hi")
            times.append(time.perf_counter() - t)
            bad += out.stdout != "hi\n"

    try:
        await asyncio.gather(*(steps(ep) for ep in eps))
    finally:
        await asyncio.gather(*(ep.aclose() for ep in eps))
    return times, bad


# -- in-process (the reference) ----------------------------------------------------------------


def local_episode(_: int = 0) -> bool:
    env = open_environment(EpisodeSettings(), nsexec=shared_nsexec())
    try:
        env.start(EXAMPLES / TASK)
        ok = env.exec("echo hi").stdout == "hi\n"
        return ok and env.evaluate().reward == 0.0
    except Exception:  # noqa: BLE001 - counted
        return False
    finally:
        env.close()


def local_episodes(episodes: int, concurrency: int) -> tuple[int, float]:
    wall = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as threads:
        ok = list(threads.map(local_episode, range(episodes)))
    return sum(not r for r in ok), time.perf_counter() - wall


def local_steps(sessions: int, execs: int) -> tuple[list[float], int]:
    envs = [open_environment(EpisodeSettings(), nsexec=shared_nsexec()) for _ in range(sessions)]
    times: list[float] = []
    bad = 0

    def steps(env) -> None:
        nonlocal bad
        env.start(EXAMPLES / TASK)
        mine = []
        for _ in range(execs):
            t = time.perf_counter()
            out = env.exec("echo hi")
            mine.append(time.perf_counter() - t)
            bad += out.stdout != "hi\n"
        times.extend(mine)

    try:
        with ThreadPoolExecutor(sessions) as threads:
            list(threads.map(steps, envs))
    finally:
        for env in envs:
            env.close()
    return times, bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--execs", type=int, default=50)
    parser.add_argument("--actors", type=int, default=2)
    args = parser.parse_args()
    n, c, k = args.episodes, args.concurrency, args.execs
    cluster = ray_cluster.start_cluster(cpus_per_node=1, nodes=2)
    try:
        ray = ray_cluster.join(cluster)
        start = time.perf_counter()
        pool = EpisodePool(args.actors, EXAMPLES, actor_cpus=1.0, episodes_per_actor=max(c, 8))
        pool_start = time.perf_counter() - start
        try:
            asyncio.run(pool_episodes(pool, 2 * args.actors, 2 * args.actors))  # warm: every actor's first episode
            failures, wall, nodes = asyncio.run(pool_episodes(pool, n, c))
            alone, alone_bad = asyncio.run(pool_steps(pool, 1, k * 4))
            many, many_bad = asyncio.run(pool_steps(pool, c, k))
        finally:
            pool.shutdown()
        ray.shutdown()
    finally:
        ray_cluster.stop_cluster(cluster)
    local_episode()  # warm: the namespace helper, the first sandbox
    ref_failures, ref_wall = local_episodes(n, c)
    ref_alone, ref_alone_bad = local_steps(1, k * 4)
    ref_many, ref_many_bad = local_steps(c, k)

    rows = [
        (f"episodes/s: {n} × (reset + exec + evaluate + close), {c} concurrent",
         f"{n / wall:.1f} ({failures} failed, on {len(nodes)} nodes)",
         f"in-process, {c} threads: {n / ref_wall:.1f} ({ref_failures} failed)", "0 failed",
         failures == 0 and ref_failures == 0),
        ("exec round trip p50 / p99, one episode alone", f"{pct(alone, 0.5):.2f} / {pct(alone, 0.99):.2f} ms",
         f"in-process: {pct(ref_alone, 0.5):.2f} / {pct(ref_alone, 0.99):.2f} ms", "report",
         alone_bad == 0 and ref_alone_bad == 0),
        (f"exec round trip p50 / p99, {c} episodes at once", f"{pct(many, 0.5):.2f} / {pct(many, 0.99):.2f} ms",
         f"in-process: {pct(ref_many, 0.5):.2f} / {pct(ref_many, 0.99):.2f} ms", "report",
         many_bad == 0 and ref_many_bad == 0),
        (f"pool start ({args.actors} actors placed and ready)", f"{pool_start:.1f} s", "-", "report", True),
    ]
    return report(f"EpisodePool benchmark ({args.actors} actors on a 2-node loopback cluster, {os.cpu_count()} CPUs, "
                  f"uid {os.getuid()})", rows)


if __name__ == "__main__":
    sys.exit(main())
