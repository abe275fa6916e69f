"""A thousand idle episodes in one process (issue #25, part 2), side by side with the issue's
targets, in one run.

    python benchmarks/thousand_bench.py [-n 1000] [--parallel 8] [--network] [--serve]
                                        [--sample 200] [--execs 5] [--task python-csv-stats]

Starts ``-n`` host-mode episodes of an example task (``examples/tasks/python-csv-stats``)
at once, ``--parallel`` resets at a time from a pool of threads that lives as long as the
episodes (a sandbox dies with the thread that started it: ``bwrap --die-with-parent``), as
a trainer would; then, with all of them open and idle:

* **start rate**: episodes per second over the whole start (and over its first and last
  tenth: a start that slows down as episodes pile up shows there);
* **memory per idle episode**: the proportional set size (PSS, ``/proc/PID/smaps_rollup``)
  of every process of the run, summed, less the same sum before the first episode started,
  over ``-n``. The processes are this one (or, with ``--serve``, the server) and every
  process below it: each episode's bwrap, its init (``bash``, its ``sleep``), its shell
  (``bash``), with ``--network`` its ``slirp4netns``, and the namespace helper. PSS counts
  a page shared by k processes as 1/k in each, so the sum is what those processes use of
  the machine's memory; the kernel's own memory for them (page tables, namespaces,
  cgroups, sockets, the tmpfs of each view) is not in it, so the drop of the host's
  ``MemAvailable`` over the same time is shown beside it (the whole machine: other work
  moves it too);
* **exec p50 / p99**: ``--execs`` runs of ``true`` in each of ``--sample`` episodes picked at
  random, one after another, with every episode open; then every episode answers one
  ``echo`` (any that does not is a failure);

then closes them all (from the same threads) and checks that nothing is left: no process
below this one but the namespace helper, no state folder of this process, the open
descriptors back where they were. ``--network``: each episode gets the task's network
(a copy of the task with ``allow_internet = true``: the public mode's router, rules,
slirp4netns and DNS responder; nothing is asked, so no packet leaves the machine).
``--serve``: the same through ``sequester serve`` (``-n`` WebSocket sessions, driven by
:class:`~sequester.serve.client.AsyncSequesterClient` from this process; the memory is the
server's and its processes').

The reference column is the same measure with one episode open (before the others start).
A process or machine that cannot hold ``-n`` of them (the open-file limit, ptys, processes,
namespaces, memory: :func:`sequester.environments.local.capacity.shortfalls`) is told so
before any starts, exit status 2.
An interrupted run (Ctrl-C, SIGTERM) closes what it started; a killed one leaves its
sandboxes to die with it (``--die-with-parent``), and its state folders, cgroups and any
sandbox it was still starting to the next start's clean-up of dead processes' (the next
run removes its memory cgroup).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _report import Row, report

from sequester.environments.local.capacity import shortfalls
from sequester.environments.local.episode import Episode
from sequester.environments.settings import EpisodeSettings
from sequester.sandbox.cgroups.pool import remove_stale_cgroups
from sequester.sandbox.fdlimit import open_descriptors
from sequester.sandbox.procs import descendants

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "tasks"
TOKEN = "bench-" + os.urandom(16).hex()
TARGET_MB, TARGET_P99_MS = 3.0, 10.0


# -- measures ------------------------------------------------------------------------------


def pss_kb(pid: int) -> int:
    """Proportional set size of a process, in KiB (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def processes(root: int, charged: Charged | None) -> list[int]:
    """``root``, every process below it, and every process of the run's memory cgroup (one
    that left the tree, reparented to init, is still the run's)."""
    found = [root, *descendants(root)]
    more = set(charged.pids() if charged is not None else ()) - set(found)
    return found + sorted(more)


def memory(root: int, charged: Charged | None = None) -> tuple[int, collections.Counter[str], collections.Counter[str]]:
    """PSS of the run's processes (:func:`processes`), in KiB; per command name, KiB and count."""
    kb: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for pid in processes(root, charged):
        name = comm(pid)
        kb[name] += pss_kb(pid)
        count[name] += 1
    return sum(kb.values()), kb, count


class Charged:
    """A memory cgroup (v1) of the run's own, below this process's, with the process that
    runs the episodes moved into it (this one, or with --serve the server): what the kernel
    charges to it and to the cgroups below it (every process of the run, the episodes'
    limit cgroups, the kernel memory they allocate: namespaces, sockets, page tables, tmpfs
    pages). Root and cgroup v1's memory controller only; else ``path`` is None and nothing
    is measured."""

    def __init__(self, pid: int) -> None:
        self.path: Path | None = None
        self._old: Path | None = None
        try:
            with open("/proc/self/cgroup") as f:
                own = next((line.split(":", 2)[2].strip() for line in f if ":memory:" in line), None)
        except OSError:
            own = None
        mount = Path("/sys/fs/cgroup/memory")
        if own is None or os.getuid() != 0 or not (mount / "memory.usage_in_bytes").exists():
            return
        self._old = mount / own.lstrip("/")
        for stale in self._old.glob("seq-thousand-*"):  # a killed run's (its episodes' cgroups below it)
            owner = stale.name.rsplit("-", 1)[1]
            if owner.isdigit() and not Path(f"/proc/{owner}").exists():
                remove_stale_cgroups(stale)
                with contextlib.suppress(OSError):
                    stale.rmdir()
        path = self._old / f"seq-thousand-{os.getpid()}"
        try:
            path.mkdir()
            (path / "cgroup.procs").write_text(str(pid))
        except OSError:
            with contextlib.suppress(OSError):
                path.rmdir()
            return
        self.path = path

    def pids(self) -> list[int]:
        """Every process in it and in the cgroups below it."""
        found: list[int] = []
        if self.path is not None:
            for folder, _, _ in os.walk(self.path):
                with contextlib.suppress(OSError):
                    found += [int(p) for p in (Path(folder) / "cgroup.procs").read_text().split()]
        return found

    def kb(self) -> tuple[int, int, int, int]:
        """All charged, and of it: the kernel's memory, anonymous memory, the page cache
        (tmpfs included), in KiB; zeros when not measured."""
        if self.path is None:
            return 0, 0, 0, 0
        usage = int((self.path / "memory.usage_in_bytes").read_text())
        kmem = int((self.path / "memory.kmem.usage_in_bytes").read_text())
        stat = dict(line.split() for line in (self.path / "memory.stat").read_text().splitlines())
        return usage // 1024, kmem // 1024, int(stat["total_rss"]) // 1024, int(stat["total_cache"]) // 1024

    def close(self) -> None:
        if self.path is None or self._old is None:
            return
        for _ in range(50):  # every process of it back (the namespace helper too), then it goes
            with contextlib.suppress(OSError):
                for pid in (self.path / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):
                        (self._old / "cgroup.procs").write_text(pid)
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def mem_available_kb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1])
    return 0


def pct(xs: list[float], q: float) -> float:
    """The q-quantile of xs (seconds), in ms."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")


def rate(stamps: list[float], lo: float, hi: float) -> float:
    """Episodes per second over the part [lo, hi) of the finished starts (by order)."""
    stamps = sorted(stamps)
    a, b = int(lo * len(stamps)), max(int(hi * len(stamps)) - 1, int(lo * len(stamps)) + 1)
    if b >= len(stamps) or stamps[b] <= stamps[a]:
        return float("nan")
    return (b - a) / (stamps[b] - stamps[a])


def leftovers(root: int, state_dir: Path, keep: set[int], charged: Charged | None = None) -> list[str]:
    """What is left of the run's processes (but ``root`` and ``keep``) and in the state
    folder of ``root``'s episodes."""
    left = [f"process {p} ({comm(p)})" for p in processes(root, charged)
            if p != root and p not in keep and comm(p) != "?"]
    with contextlib.suppress(OSError):
        left += [f"state folder {state_dir / n}" for n in os.listdir(state_dir) if n.startswith(f"{root}-")]
    return left


def helper_pids(root: int) -> set[int]:
    """The namespace helper (``sequester.sandbox.nsexec.server``) of ``root``: stays for the process's life."""
    out = set()
    for pid in descendants(root):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"sequester.sandbox.nsexec.server" in f.read():
                    out.add(pid)
        except OSError:
            pass
    return out


def raise_nofile() -> None:
    """This process's soft open-file limit to its hard one (the client's sockets, with --serve)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


@contextlib.contextmanager
def interrupts_raise() -> Iterator[None]:
    """SIGTERM as Ctrl-C: the ``finally`` blocks close what was started."""

    def stop(*_: object) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def network_task(tmp: Path, task: str) -> Path:
    """A copy of the example task whose network is public (the episodes issue's network)."""
    copy = tmp / "tasks" / task
    shutil.copytree(EXAMPLES / task, copy)
    toml = copy / "task.toml"
    text = toml.read_text()
    if "allow_internet = false" not in text:
        raise SystemExit(f"{toml}: expected allow_internet = false to turn into true")
    toml.write_text(text.replace("allow_internet = false", "allow_internet = true"))
    return copy


# -- in this process ------------------------------------------------------------------------


def in_process(task: Path, n: int, parallel: int, sample: int, execs: int, settings: EpisodeSettings,
               charged: Charged) -> dict:
    me = os.getpid()
    out: dict = {"errors": [], "execs": [], "alone_execs": []}
    # The reference: one episode alone (it also starts the namespace helper and warms up).
    with Episode(settings) as alone:
        alone.reset(task, image=None)
        time.sleep(1.0)
        before_one, _, _ = memory(me, charged)
        with Episode(settings) as one:
            t = time.perf_counter()
            one.reset(task, image=None)
            out["alone_reset"] = time.perf_counter() - t
            time.sleep(1.0)
            out["alone_kb"] = memory(me, charged)[0] - before_one
            for _ in range(max(sample * execs, 200)):
                t = time.perf_counter()
                r = one.exec("true")
                out["alone_execs"].append(time.perf_counter() - t)
                assert r.exit_code == 0, r
    time.sleep(0.5)
    keep = helper_pids(me)
    fds_before, threads_before = open_descriptors(), threading.active_count()
    base_kb, _, _ = memory(me, charged)
    avail_before, charged_before = mem_available_kb(), charged.kb()
    episodes = [Episode(settings) for _ in range(n)]
    # An episode is not thread-safe: its reset and its close (after an interrupt, queued
    # behind the resets still in flight) never run at once; none starts once stopping.
    held = {id(ep): threading.Lock() for ep in episodes}
    stopping = threading.Event()
    started: list[float] = []
    lock = threading.Lock()

    def reset(ep: Episode) -> None:
        with held[id(ep)]:
            if stopping.is_set():
                return
            try:
                ep.reset(task, image=None)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                with lock:
                    out["errors"].append(f"{type(exc).__name__}: {exc}")
                return
        with lock:
            started.append(time.perf_counter())

    def close(ep: Episode) -> str | None:
        with held[id(ep)]:
            return _close_quietly(ep)

    # The pool lives until every episode is closed: they die with the thread that started them.
    pool = ThreadPoolExecutor(parallel, thread_name_prefix="bench-start")
    try:
        t0 = time.perf_counter()
        list(pool.map(reset, episodes))
        out["start_wall"] = time.perf_counter() - t0
        out["stamps"] = [s - t0 for s in started]
        out["opened"] = len(started)
        out["fds_open"], out["threads_open"] = (
            open_descriptors() - fds_before,
            threading.active_count() - threads_before - parallel,  # less the pool's own
        )
        time.sleep(2.0)  # idle: nothing in flight
        total_kb, out["by_kb"], out["by_count"] = memory(me, charged)
        out["pss_kb"] = total_kb - base_kb
        out["avail_drop_kb"] = avail_before - mem_available_kb()
        out["charged_kb"] = [a - b for a, b in zip(charged.kb(), charged_before, strict=True)]
        live = [ep for ep in episodes if ep._run is not None]  # noqa: SLF001 - the ones that started
        out["sampled"] = min(sample, len(live))
        for ep in random.sample(live, out["sampled"]):
            for _ in range(execs):
                t = time.perf_counter()
                r = ep.exec("true")
                out["execs"].append(time.perf_counter() - t)
                if r.exit_code != 0:
                    out["errors"].append(f"exec true: {r}")

        def answer(ep: Episode) -> bool:
            r = ep.exec("echo hi")
            return r.stdout == "hi\n" and r.exit_code == 0

        t = time.perf_counter()
        answers = list(pool.map(answer, live))
        out["answer_wall"] = time.perf_counter() - t
        out["answered"] = sum(answers)
    finally:
        stopping.set()
        t = time.perf_counter()
        closing = list(pool.map(close, episodes))
        out["close_wall"] = time.perf_counter() - t
        out["errors"] += [c for c in closing if c]
        pool.shutdown()
    time.sleep(0.5)
    out["avail_back_kb"] = avail_before - mem_available_kb()
    out["left"] = leftovers(me, settings.state_dir, keep, charged)
    out["fds_left"] = open_descriptors() - fds_before
    return out


def _close_quietly(ep: Episode) -> str | None:
    try:
        ep.close()
    except Exception as exc:  # noqa: BLE001 - reported
        return f"close: {type(exc).__name__}: {exc}"
    return None


# -- through sequester serve ---------------------------------------------------------------


def start_server(tasks_dir: Path, log: Path, max_sessions: int) -> tuple[subprocess.Popen[bytes], str]:
    env = {**os.environ, "SEQUESTER_SERVE_TOKEN": TOKEN}
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "sequester.cli", "serve", "--host", "127.0.0.1", "--port", "0",
                                 "--tasks-dir", str(tasks_dir), "--image-source", "host",
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


async def served(url: str, task: str, n: int, parallel: int, sample: int, execs: int, pid: int,
                 charged: Charged) -> dict:
    from sequester.serve.client import AsyncSequesterClient

    out: dict = {"errors": [], "execs": [], "alone_execs": []}

    def client() -> AsyncSequesterClient:
        return AsyncSequesterClient(url, TOKEN, message_timeout_s=600)

    async with client() as alone:  # warm: imports, the helper
        await alone.reset(task)
        await asyncio.sleep(1.0)
        before_one, _, _ = memory(pid, charged)
        async with client() as one:
            t = time.perf_counter()
            await one.reset(task)
            out["alone_reset"] = time.perf_counter() - t
            await asyncio.sleep(1.0)
            out["alone_kb"] = memory(pid, charged)[0] - before_one
            for _ in range(max(sample * execs, 200)):
                t = time.perf_counter()
                r = await one.exec("true")
                out["alone_execs"].append(time.perf_counter() - t)
                assert r.observation.get("exit_code") == 0, r
    await asyncio.sleep(1.0)
    keep = helper_pids(pid)
    base_kb, _, _ = memory(pid, charged)
    avail_before, charged_before = mem_available_kb(), charged.kb()
    clients = [client() for _ in range(n)]
    gate = asyncio.Semaphore(parallel)
    t0 = time.perf_counter()
    stamps: list[float] = []

    async def reset(c: AsyncSequesterClient) -> bool:
        async with gate:
            try:
                await c.reset(task)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                out["errors"].append(f"{type(exc).__name__}: {exc}")
                return False
            stamps.append(time.perf_counter() - t0)
            return True

    try:
        ok = await asyncio.gather(*(reset(c) for c in clients))
        out["start_wall"] = time.perf_counter() - t0
        out["stamps"], out["opened"] = stamps, sum(ok)
        await asyncio.sleep(2.0)
        total_kb, out["by_kb"], out["by_count"] = memory(pid, charged)
        out["pss_kb"] = total_kb - base_kb
        out["avail_drop_kb"] = avail_before - mem_available_kb()
        out["charged_kb"] = [a - b for a, b in zip(charged.kb(), charged_before, strict=True)]
        live = [c for c, good in zip(clients, ok, strict=True) if good]
        out["sampled"] = min(sample, len(live))
        for c in random.sample(live, out["sampled"]):
            for _ in range(execs):
                t = time.perf_counter()
                r = await c.exec("true")
                out["execs"].append(time.perf_counter() - t)
                if r.observation.get("exit_code") != 0:
                    out["errors"].append(f"exec true: {r}")

        async def answer(c: AsyncSequesterClient) -> bool:
            async with gate:
                r = await c.exec("echo hi")
                return r.observation.get("stdout") == "hi\n" and r.observation.get("exit_code") == 0

        t = time.perf_counter()
        out["answered"] = sum(await asyncio.gather(*(answer(c) for c in live)))
        out["answer_wall"] = time.perf_counter() - t
    finally:
        t = time.perf_counter()

        async def close(c: AsyncSequesterClient) -> None:
            async with gate:
                await c.close()

        await asyncio.gather(*(close(c) for c in clients), return_exceptions=True)
        out["close_wall"] = time.perf_counter() - t
    # A session's close returns before its worker has removed everything: wait a little.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and leftovers(pid, EpisodeSettings().state_dir, keep, charged):
        await asyncio.sleep(0.5)
    out["left"] = leftovers(pid, EpisodeSettings().state_dir, keep, charged)
    out["avail_back_kb"] = avail_before - mem_available_kb()
    return out


# -- the table -----------------------------------------------------------------------------


def rows_for(out: dict, n: int, parallel: int, what: str) -> list[Row]:
    mb = out.get("pss_kb", 0) / max(out.get("opened", 0), 1) / 1024
    avail = out.get("avail_drop_kb", 0) / max(out.get("opened", 0), 1) / 1024
    back = out.get("avail_back_kb", 0) / max(out.get("opened", 0), 1) / 1024
    charged_mb, kmem_mb, anon_mb, cache_mb = (kb / max(out.get("opened", 0), 1) / 1024
                                              for kb in out.get("charged_kb", (0, 0, 0, 0)))
    p50, p99 = pct(out["execs"], 0.5), pct(out["execs"], 0.99)
    by = ", ".join(f"{name} {out['by_count'][name]}× {kb / 1024:.0f} MB"
                   for name, kb in out.get("by_kb", collections.Counter()).most_common(6))
    errors = out["errors"]
    first = f" (first: {errors[0][:300]})" if errors else ""
    wall, stamps = out.get("start_wall", float("nan")), out.get("stamps", [])
    rows: list[Row] = [
        (f"{what} open at once", f"{out.get('opened', 0)} of {n}{first}", "", f"{n}, no failure",
         out.get("opened") == n and not errors),
        (f"start rate ({parallel} at a time)", f"{out.get('opened', 0) / wall:.1f} episodes/s ({wall:.1f} s); "
         f"first tenth {rate(stamps, 0, 0.1):.1f}/s, last tenth {rate(stamps, 0.9, 1):.1f}/s",
         f"one reset alone {out['alone_reset'] * 1000:.0f} ms ({1 / out['alone_reset']:.1f}/s one at a time)",
         "report", True),
        ("memory per idle episode (PSS of every process of the run, less before, / N)", f"{mb:.2f} MB",
         f"one episode alone {out['alone_kb'] / 1024:.2f} MB; all processes then: {by}", f"≤ {TARGET_MB:g} MB",
         0 < mb <= TARGET_MB),
        ("the host's MemAvailable drop / N (kernel memory too; other work moves it)", f"{avail:.2f} MB",
         f"still down after they closed: {back:.2f} MB / N",
         "report", True),
        ("memory charged to the run's own memory cgroup / N (its processes and the kernel's memory for them)",
         f"{charged_mb:.2f} MB: kernel {kmem_mb:.2f}, anonymous {anon_mb:.2f}, page cache and tmpfs {cache_mb:.2f} MB"
         if charged_mb else "not measured (needs root and "
         "cgroup v1's memory controller)", "", "report", True),
        (f"exec `true` p50 / p99 ({len(out['execs'])} calls, {out.get('sampled', 0)} episodes, all open)",
         f"{p50:.2f} / {p99:.2f} ms (max {pct(out['execs'], 1.0):.1f}; "
         f"{sum(x > TARGET_P99_MS / 1000 for x in out['execs'])} over {TARGET_P99_MS:g} ms)",
         f"one episode open: {pct(out['alone_execs'], 0.5):.2f} / {pct(out['alone_execs'], 0.99):.2f} ms",
         f"p99 ≤ {TARGET_P99_MS:g} ms", p99 <= TARGET_P99_MS),
        ("every open episode answers `echo hi`", f"{out.get('answered', 0)} of {out.get('opened', 0)} "
         f"({out.get('answer_wall', float('nan')):.1f} s, {parallel} at a time)", "", "all",
         out.get("answered") == out.get("opened")),
        ("closed; left behind (processes, state folders)",
         f"{len(out['left'])} in {out.get('close_wall', float('nan')):.1f} s"
         + (f": {', '.join(out['left'][:5])}" if out["left"] else ""), "", "nothing", not out["left"]),
    ]
    if "fds_open" in out:
        rows.append(("descriptors this process held for them (open / after close)",
                     f"{out['fds_open']} ({out['fds_open'] / max(out['opened'], 1):.1f} each) / {out['fds_left']}",
                     f"threads for them while open (not the pool's): {out['threads_open']}", "none after close",
                     out["fds_left"] <= 0))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=1000, help="episodes open at once")
    parser.add_argument("--parallel", type=int, default=8, help="resets (and closes) at a time")
    parser.add_argument("--network", action="store_true", help="each episode with the task's network (public)")
    parser.add_argument("--serve", action="store_true", help="through sequester serve: one session per episode")
    parser.add_argument("--sample", type=int, default=200, help="episodes whose exec is timed")
    parser.add_argument("--execs", type=int, default=5, help="exec of `true` per sampled episode")
    parser.add_argument("--task", default="python-csv-stats", help="an example task (examples/tasks/NAME)")
    args = parser.parse_args()
    n = args.n
    what = f"{n} {'sessions' if args.serve else 'episodes'}{' with network' if args.network else ''}"
    raise_nofile()
    load_before = os.getloadavg()[0]
    short = shortfalls(n, network=args.network, session=args.serve)
    if short:  # the "a clear error up front"
        print(f"this process or machine cannot hold {what} at once:\n* " + "\n* ".join(short), file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="seq-thousand-") as tmp, interrupts_raise():
        task = network_task(Path(tmp), args.task) if args.network else EXAMPLES / args.task
        if args.serve:
            proc, url = start_server(task.parent, Path(tmp) / "serve.log", n + 8)
            charged = Charged(proc.pid)  # (it has started no episode yet: its helper comes with the first)
            try:
                out = asyncio.run(served(url, task.name, n, args.parallel, args.sample, args.execs, proc.pid,
                                         charged))
            finally:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                log = (Path(tmp) / "serve.log").read_text(errors="replace")
                if proc.returncode not in (0, -signal.SIGTERM):
                    print(f"sequester serve exited {proc.returncode}:\n{log[-3000:]}", file=sys.stderr)
                charged.close()
        else:
            charged = Charged(os.getpid())
            try:
                out = in_process(task, n, args.parallel, args.sample, args.execs, EpisodeSettings(), charged)
            finally:
                charged.close()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    title = (f"{what}, host mode, {args.task} ({os.cpu_count()} CPUs, uid {os.getuid()}, "
             f"open-file limit {soft}/{hard}, load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after)")
    return report(title, rows_for(out, n, args.parallel, what))


if __name__ == "__main__":
    sys.exit(main())
