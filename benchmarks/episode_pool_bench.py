"""The episode pool's local backend: a warm ``acquire`` side by side with a fresh ``reset``, in one run.

    python benchmarks/episode_pool_bench.py [--acquisitions 200] [--warm 4]

An :class:`~sequester.environments.pool.EpisodePool` (local backend, host mode) keeping
``--warm`` episodes of an example task started:

* ``acquire`` of a warm episode, sync and async (``aacquire`` on an event loop): p50 and p99
  over ``--acquisitions`` calls, each checked to hand out one of the episodes that were
  warm just before (a miss, a caller that had to start its own, is counted); between
  calls (not timed) the episode is closed and the pool is let fill again;
* the reference, in the same run: a fresh start of the same task, both as a bare
  :class:`~sequester.environments.local.episode.Episode` ``reset`` and through the pool
  with nothing warm (a cold ``reset``: what the pool adds to a start);
* how long a replacement takes to be warm again after an ``acquire`` (p50);
* the floor of the same loop (an uncontended lock taken where ``acquire`` is timed): on a
  busy machine the p99 of anything is the scheduler's.

Target: a warm ``acquire`` at most 1 ms (issue 25).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from _report import report

from sequester.environments.local.episode import Episode
from sequester.environments.pool import EpisodePool
from sequester.environments.settings import EpisodeSettings
from sequester.images.image_settings import ImageSettings

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "tasks"
TASK, COLD = "python-csv-stats", "c-word-count"


def pct(xs: list[float], q: float) -> float:
    """The q-quantile of xs, in ms."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")


def warm_ids(pool: EpisodePool) -> set[str]:
    with pool._lock:  # noqa: SLF001 - which episodes were warm, to check the one handed out
        return {e for ready in pool._warm.values() for e in ready}  # noqa: SLF001


def wait_warm(pool: EpisodePool, n: int) -> float:
    """Seconds until ``n`` episodes of TASK are warm."""
    start = time.perf_counter()
    while pool.stats().warm.get(TASK, 0) < n:
        time.sleep(0.0005)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--acquisitions", type=int, default=200)
    parser.add_argument("--warm", type=int, default=4)
    args = parser.parse_args()
    n, warm = args.acquisitions, args.warm
    with tempfile.TemporaryDirectory(prefix="seq-pool-bench-") as tmp:
        settings = EpisodeSettings(images=ImageSettings(source="host"), state_dir=Path(tmp) / "state")
        with Episode(settings) as first:
            first.reset(EXAMPLES / TASK)  # warm: the toolchain, the namespace helper
        with EpisodePool(EXAMPLES, capacity=warm + 2, warm={TASK: warm}, settings=settings, calibration="off") as pool:
            sync, refills, floor, misses = [], [], [], 0
            wait_warm(pool, warm)
            for _ in range(n):
                before = warm_ids(pool)
                start = time.perf_counter()
                with pool._lock:  # noqa: SLF001 - the machine's floor: the same loop, no work
                    pass
                floor.append(time.perf_counter() - start)
                start = time.perf_counter()
                ep = pool.acquire(TASK)
                sync.append(time.perf_counter() - start)
                misses += ep.episode_id not in before
                refills.append(wait_warm(pool, warm))  # the replacement, started in the background
                ep.close()

            async def acquire_async() -> tuple[list[float], int]:
                times, missed = [], 0
                for _ in range(n):
                    await asyncio.to_thread(wait_warm, pool, warm)
                    before = warm_ids(pool)
                    start = time.perf_counter()
                    ep = await pool.aacquire(TASK)
                    times.append(time.perf_counter() - start)
                    missed += ep.episode_id not in before
                    await ep.aclose()
                return times, missed

            asyncs, amisses = asyncio.run(acquire_async())
            colds = []
            for _ in range(max(10, n // 5)):
                start = time.perf_counter()
                ep = pool.reset(COLD)
                colds.append(time.perf_counter() - start)
                ep.close()
        bares: dict[str, list[float]] = {TASK: [], COLD: []}
        for _ in range(max(10, n // 5)):
            for task, times in bares.items():
                ep = Episode(settings)
                start = time.perf_counter()
                ep.reset(EXAMPLES / task)
                times.append(time.perf_counter() - start)
                ep.close()
    fresh = f"fresh `Episode.reset` p50 {pct(bares[TASK], 0.5):.1f} ms, p99 {pct(bares[TASK], 0.99):.1f} ms"
    cold = bares[COLD]
    fresh_cold = f"fresh `Episode.reset` of {COLD} p50 {pct(cold, 0.5):.1f} ms, p99 {pct(cold, 0.99):.1f} ms"
    jitter = f"; the same loop's floor (a lock taken) p50 {pct(floor, 0.5):.4f}, p99 {pct(floor, 0.99):.3f} ms"
    rows = [
        (
            f"acquire, warm (sync), p50 / p99 of {n}",
            f"{pct(sync, 0.5):.3f} / {pct(sync, 0.99):.3f} ms",
            fresh + jitter,
            "p50 ≤ 1 ms",
            pct(sync, 0.5) <= 1,
        ),
        (
            f"aacquire, warm (async), p50 / p99 of {n}",
            f"{pct(asyncs, 0.5):.3f} / {pct(asyncs, 0.99):.3f} ms",
            fresh,
            "p50 ≤ 1 ms",
            pct(asyncs, 0.5) <= 1,
        ),
        (
            "handed out warm (not started for the caller)",
            f"{2 * n - misses - amisses} of {2 * n}",
            "-",
            f"{2 * n} of {2 * n}",
            misses + amisses == 0,
        ),
        (
            f"reset of {COLD} through the pool, nothing warm, p50 / p99",
            f"{pct(colds, 0.5):.1f} / {pct(colds, 0.99):.1f} ms",
            fresh_cold,
            "report",
            True,
        ),
        (
            "a replacement warm again after an acquire, p50",
            f"{pct(refills, 0.5):.1f} ms",
            f"fresh `Episode.reset` p50 {pct(bares[TASK], 0.5):.1f} ms",
            "report",
            True,
        ),
    ]
    return report("sequester episode pool (local backend, host mode)", rows)


if __name__ == "__main__":
    raise SystemExit(main())
