"""``sequester serve`` under load, side by side with the same work done in-process, in one run.

    python benchmarks/serve_bench.py [--sessions 64] [--execs 50] [--trials 32] [--concurrency 8] [--think-ms 200]

A real server (``sequester serve --port 0 --tasks-dir examples/tasks --image-source host``)
on loopback, driven by :class:`sequester.serve.client.AsyncSequesterClient` from this
process (one event loop, so client and server share this machine's cores):

* ``--sessions`` concurrent episode sessions (python-csv-stats), each running ``--execs``
  ``exec`` of ``echo hi`` back to back: no failure; p50 and p99 of a step's round trip
  (frame out to observation in), goal p50 at most 5 ms; the CPU a step costs. With every
  session always waiting on a step, the round trip is the sessions over the throughput
  (Little's law), so the same sessions then step *paced* (a random pause averaging
  ``--think-ms`` before each step, as a trainer's model would take), and one session alone;
* ``--trials`` sessions of reset + evaluate of python-csv-stats, ``--concurrency`` at a
  time: sessions per second;
* the server's resident memory per idle session (its RSS with ``--sessions`` sessions
  reset and idle, less its RSS before, over the sessions), and the episodes' own
  processes (init, shell) beside it.

The reference column is the same work through :class:`sequester.Episode` in this process
(threads instead of connections), with no server in between.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _report import report, rss_kb
from sequester.environments.local.episode import Episode
from sequester.sandbox.procs import descendants
from sequester.serve.client import AsyncSequesterClient

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "tasks"
TASK = "python-csv-stats"
TOKEN = "bench-" + os.urandom(16).hex()


def start_server(log: Path, max_sessions: int) -> tuple[subprocess.Popen[bytes], str]:
    env = {**os.environ, "SEQUESTER_SERVE_TOKEN": TOKEN}
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "sequester.cli", "serve", "--host", "127.0.0.1", "--port", "0",
                                 "--tasks-dir", str(EXAMPLES), "--image-source", "host",
                                 "--max-sessions", str(max_sessions)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        found = re.search(r"sequester serve: (http://127\.0\.0\.1:\d+)", log.read_text(errors="replace"))
        if found:
            return proc, found[1]
        time.sleep(0.05)
    proc.kill()
    raise SystemExit(f"sequester serve did not start:\n{log.read_text()[-3000:]}")


def cpu_s(pid: int) -> float:
    """User + system CPU time of a process (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    """The q-quantile of xs, in ms."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


def exec_ok(stdout: str, exit_code: int | None) -> bool:
    return stdout == "hi\n" and exit_code == 0


# -- through the server ------------------------------------------------------------------


async def served_load(url: str, sessions: int, execs: int, think_s: float, pid: int) -> dict:
    """``sessions`` sessions reset (memory measured while they idle), then all exec at once:
    back to back, then paced (a random pause of 0 to 2 × ``think_s`` before each step)."""
    clients = [AsyncSequesterClient(url, TOKEN, message_timeout_s=120) for _ in range(sessions)]
    out: dict = {"failures": 0, "times": [], "paced": []}
    before = rss_kb(pid)
    results = await asyncio.gather(*(c.reset(TASK) for c in clients), return_exceptions=True)
    live = [c for c, r in zip(clients, results) if not isinstance(r, BaseException)]
    out["failures"] += 2 * execs * (sessions - len(live))
    await asyncio.sleep(1.0)  # idle: nothing in flight
    out["server_kb"], out["sandbox_kb"] = rss_kb(pid) - before, sum(rss_kb(p) for p in descendants(pid))

    async def one(client: AsyncSequesterClient, times: list[float], think: float) -> None:
        for _ in range(execs):
            if think:
                await asyncio.sleep(random.uniform(0, 2 * think))
            t = time.perf_counter()
            try:
                r = await client.exec("echo hi")
            except Exception:  # noqa: BLE001 - counted
                out["failures"] += 1
                continue
            times.append(time.perf_counter() - t)
            out["failures"] += not exec_ok(r.observation.get("stdout", ""), r.observation.get("exit_code"))

    wall, server_cpu, client_cpu = time.perf_counter(), cpu_s(pid), time.process_time()
    await asyncio.gather(*(one(c, out["times"], 0) for c in live))
    out["wall"] = time.perf_counter() - wall
    out["server_cpu"], out["client_cpu"] = cpu_s(pid) - server_cpu, time.process_time() - client_cpu
    await asyncio.gather(*(one(c, out["paced"], think_s) for c in live))
    await asyncio.gather(*(c.close() for c in clients))
    return out


async def served_alone(url: str, execs: int) -> list[float]:
    async with AsyncSequesterClient(url, TOKEN) as client:
        await client.reset(TASK)
        times = []
        for _ in range(execs):
            t = time.perf_counter()
            r = await client.exec("echo hi")
            times.append(time.perf_counter() - t)
            assert exec_ok(r.observation["stdout"], r.observation["exit_code"]), r
        return times


async def served_trials(url: str, trials: int, concurrency: int) -> tuple[int, float]:
    gate = asyncio.Semaphore(concurrency)

    async def trial() -> bool:
        async with gate, AsyncSequesterClient(url, TOKEN, message_timeout_s=300) as client:
            await client.reset(TASK)
            return (await client.evaluate()).reward is not None

    wall = time.perf_counter()
    ok = await asyncio.gather(*(trial() for _ in range(trials)), return_exceptions=True)
    return sum(r is not True for r in ok), time.perf_counter() - wall


# -- in-process (the reference) -----------------------------------------------------------


def local_load(sessions: int, execs: int, think_s: float) -> dict:
    episodes = [Episode() for _ in range(sessions)]
    barrier, lock = threading.Barrier(sessions), threading.Lock()
    out: dict = {"failures": 0, "times": [], "paced": []}

    def run(ep: Episode, times: list[float], think: float) -> None:
        mine, bad = [], 0
        for _ in range(execs):
            if think:
                time.sleep(random.uniform(0, 2 * think))
            t = time.perf_counter()
            try:
                r = ep.exec("echo hi")
                bad += not exec_ok(r.stdout, r.exit_code)
            except Exception:  # noqa: BLE001 - counted
                bad += 1
            mine.append(time.perf_counter() - t)
        with lock:
            times.extend(mine)
            out["failures"] += bad

    def one(ep: Episode) -> None:
        ep.reset(EXAMPLES / TASK)
        if barrier.wait() == 0:
            out["wall"], out["cpu"] = time.perf_counter(), time.process_time()
        run(ep, out["times"], 0)
        if barrier.wait() == 0:
            out["wall"], out["cpu"] = time.perf_counter() - out["wall"], time.process_time() - out["cpu"]
        run(ep, out["paced"], think_s)

    try:
        with ThreadPoolExecutor(sessions) as pool:
            list(pool.map(one, episodes))
    finally:
        for ep in episodes:
            ep.close()
    return out


def local_alone(execs: int) -> list[float]:
    with Episode() as ep:
        ep.reset(EXAMPLES / TASK)
        times = []
        for _ in range(execs):
            t = time.perf_counter()
            ep.exec("echo hi")
            times.append(time.perf_counter() - t)
        return times


def local_trials(trials: int, concurrency: int) -> tuple[int, float]:
    def trial(_: int) -> bool:
        with Episode() as ep:
            ep.reset(EXAMPLES / TASK)
            return ep.evaluate().reward is not None

    wall = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        ok = list(pool.map(trial, range(trials)))
    return sum(not r for r in ok), time.perf_counter() - wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--execs", type=int, default=50)
    parser.add_argument("--trials", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--think-ms", type=float, default=200.0, help="mean pause between paced steps")
    args = parser.parse_args()
    n, k = args.sessions, args.execs
    with tempfile.TemporaryDirectory(prefix="seq-serve-bench-") as tmp:
        proc, url = start_server(Path(tmp) / "serve.log", max(n, args.concurrency) + 4)
        try:
            asyncio.run(served_alone(url, 5))  # warm: imports, the first sandbox
            alone = asyncio.run(served_alone(url, k * 4))
            load = asyncio.run(served_load(url, n, k, args.think_ms / 1000, proc.pid))
            trial_failures, trial_wall = asyncio.run(served_trials(url, args.trials, args.concurrency))
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    local_alone(5)
    ref_alone = local_alone(k * 4)
    ref = local_load(n, k, args.think_ms / 1000)
    ref_trial_failures, ref_wall = local_trials(args.trials, args.concurrency)

    total = n * k
    p50, p99 = pct(load["times"], 0.5), pct(load["times"], 0.99)
    rows = [
        (f"{n} sessions × {k} exec `echo hi` (× 2: back to back, paced): failures",
         f"{load['failures']} of {2 * total}",
         f"in-process: {ref['failures']} of {2 * total}", "0", load["failures"] == 0),
        (f"step round trip p50, {n} concurrent", f"{p50:.2f} ms",
         f"Episode.exec, {n} threads: {pct(ref['times'], 0.5):.2f} ms", "≤ 5 ms", p50 <= 5),
        (f"step round trip p99, {n} concurrent", f"{p99:.2f} ms",
         f"Episode.exec, {n} threads: {pct(ref['times'], 0.99):.2f} ms", "report", True),
        (f"step round trip p50 / p99, {n} concurrent, paced (~{args.think_ms:g} ms between steps)",
         f"{pct(load['paced'], 0.5):.2f} / {pct(load['paced'], 0.99):.2f} ms",
         f"Episode.exec: {pct(ref['paced'], 0.5):.2f} / {pct(ref['paced'], 0.99):.2f} ms", "≤ 5 ms (p50)",
         pct(load["paced"], 0.5) <= 5),
        ("exec throughput, all sessions", f"{total / load['wall']:.0f} steps/s",
         f"in-process: {total / ref['wall']:.0f} steps/s", "report", True),
        ("CPU per step (server process / client)", f"{load['server_cpu'] / total * 1000:.2f} / "
         f"{load['client_cpu'] / total * 1000:.2f} ms", f"in-process: {ref['cpu'] / total * 1000:.2f} ms", "report",
         True),
        ("step round trip p50 / p99, one session alone",
         f"{pct(alone, 0.5):.2f} / {pct(alone, 0.99):.2f} ms",
         f"Episode.exec alone: {pct(ref_alone, 0.5):.2f} / {pct(ref_alone, 0.99):.2f} ms", "report", True),
        (f"reset + evaluate ({TASK}, host), {args.concurrency} at a time",
         f"{args.trials / trial_wall:.1f} sessions/s ({trial_failures} failed)",
         f"in-process: {args.trials / ref_wall:.1f} episodes/s ({ref_trial_failures} failed)", "report",
         trial_failures == 0),
        ("resident memory per idle session (server RSS delta / sessions)", f"{load['server_kb'] / n / 1024:.2f} MB",
         f"its episode's processes (init, shell): {load['sandbox_kb'] / n / 1024:.1f} MB", "report", True),
    ]
    return report(f"sequester serve benchmark ({n} sessions, {os.cpu_count()} CPUs, uid {os.getuid()})", rows)


if __name__ == "__main__":
    sys.exit(main())
