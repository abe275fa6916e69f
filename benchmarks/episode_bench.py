"""Speed and memory of episodes, side by side with their references, in one run.

    python benchmarks/episode_bench.py [--runs N] [--concurrency 32]

* ``reset`` (view planned, files staged, sandbox up, shell ready): at most 30 ms median,
  next to a bare bwrap start and, where podman is installed, ``podman run`` of a static
  ``true`` (no network, the same rootfs each time: the cost of a container's start alone);
  with the task's network (public: router, rules, slirp4netns, DNS responder) at most 1.5
  times a reset without (no packet leaves: nothing is asked);
* ``evaluate`` overhead beyond test.sh's own time: at most 20 ms median, next to the same
  test.sh run by bash directly on the host; in a separate verifier environment (a fresh
  pristine view plus the artifacts: for a task that declares it, started with the
  episode; asked ad hoc, started then), at most 50 ms; and once more after 100 ms idle
  (reported: where the kernel's cgroup v1 moves a process only after an RCU grace
  period, idle makes that wait cold);
* N concurrent episodes of an example task (reset, oracle, evaluate, close) with no
  failure, and the memory one episode holds (its init and shell, resident).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


from _report import report, rss_kb
from sequester.agents import load_agent
from sequester.environments.local.episode import Episode
from sequester.sandbox.procs import descendants
from sequester.sandbox.probe import bwrap_path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "tasks"
TEST_SH = "echo 1 > /logs/verifier/reward.txt\n"
SETTLE = 0.1  # seconds before each measure (see main)


def minimal_task(root: Path, *, base: str = "debian:12", environment: str = "", verifier: str = "") -> Path:
    """A task with nothing to do whose test.sh writes reward 1; ``environment``: lines of
    its ``[environment]`` table (docker_bench names its image there); ``verifier``: more
    lines of its ``[verifier]`` table."""
    task = root / "bench-task"
    for sub in ("tests", "environment", "solution"):
        (task / sub).mkdir(parents=True)
    (task / "instruction.md").write_text("Nothing to do.\n")
    (task / "task.toml").write_text('version = "1.0"\n[verifier]\ntimeout_sec = 60\n' + verifier
                                    + (f"[environment]\n{environment}" if environment else ""))
    (task / "environment" / "Dockerfile").write_text(f"FROM {base}\nWORKDIR /app\n")
    (task / "tests" / "test.sh").write_text(TEST_SH)
    (task / "solution" / "solve.sh").write_text("true\n")
    return task


def podman_start(root: Path) -> list[str] | None:
    """``podman run`` of a static ``true`` in a rootfs of its own (built with the host's C
    compiler), or None where podman or a compiler is missing."""
    import shutil

    if not shutil.which("podman") or not shutil.which("cc"):
        return None
    rootfs = root / "podman-rootfs"
    rootfs.mkdir()
    (root / "true.c").write_text("int main(void) { return 0; }\n")
    built = subprocess.run(["cc", "-static", "-O2", "-o", str(rootfs / "true"), str(root / "true.c")],
                           capture_output=True)
    if built.returncode != 0:
        return None
    # explicit limits: podman's defaults (and "host") may exceed what the caller may set
    argv = ["podman", "run", "--rm", "--network", "none", "--ulimit", "nofile=1024:1024", "--ulimit",
            "nproc=4096:4096", "--rootfs", str(rootfs), "/true"]
    return argv if subprocess.run(argv, capture_output=True).returncode == 0 else None


def one_trial(task: Path) -> float:
    with Episode() as ep:
        ep.reset(task)
        load_agent("oracle").run(ep.instruction, ep)
        return ep.evaluate().reward


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="seq-ep-bench-") as tmp:
        task = minimal_task(Path(tmp), environment="allow_internet = false\n")
        public = minimal_task(Path(tmp) / "public", environment="allow_internet = true\n")
        separate_task = minimal_task(Path(tmp) / "separate", environment="allow_internet = false\n",
                                     verifier='environment_mode = "separate"\n')
        bare = [bwrap_path(), "--unshare-user", "--unshare-pid", "--unshare-net", "--ro-bind", "/", "/", "--tmpfs",
                "/tmp", "--proc", "/proc", "--dev", "/dev", "/bin/true"]
        podman = podman_start(Path(tmp))
        resets, bares, evals, scripts, separates, networked, podmans, colds, spares = [], [], [], [], [], [], [], [], []
        with Episode() as warm:
            warm.reset(task)  # warm: the toolchain, the namespace helper
        for _ in range(args.runs):
            # sequester's measures back to back, as a trainer calls them; the references last,
            # and what a `podman run` leaves working after it returns (its clean-up) settles
            # before the next round. `evaluate` once more after 100 ms idle (as after a
            # model's turn): cold, see the row.
            ep = Episode()
            start = time.perf_counter()
            ep.reset(task)
            resets.append(time.perf_counter() - start)
            start = time.perf_counter()
            assert ep.evaluate().reward == 1.0
            evals.append(time.perf_counter() - start)
            start = time.perf_counter()
            assert ep.evaluate(verifier_env="separate").reward == 1.0
            separates.append(time.perf_counter() - start)
            with Episode() as net:
                start = time.perf_counter()
                net.reset(public)
                networked.append(time.perf_counter() - start)
            start = time.perf_counter()
            subprocess.run(bare, check=True)
            bares.append(time.perf_counter() - start)
            if podman:
                time.sleep(SETTLE)
                start = time.perf_counter()
                subprocess.run(podman, check=True, capture_output=True)
                podmans.append(time.perf_counter() - start)
            time.sleep(SETTLE)
            start = time.perf_counter()
            assert ep.evaluate().reward == 1.0
            colds.append(time.perf_counter() - start)
            # A task whose verifier runs separately: its pristine view starts with the
            # episode (a spare), evaluated after the agent's turn.
            with Episode() as sep:
                sep.reset(separate_task)
                time.sleep(SETTLE)
                start = time.perf_counter()
                assert sep.evaluate().reward == 1.0
                spares.append(time.perf_counter() - start)
            time.sleep(SETTLE)
            script = Path(tmp) / "logs"
            script.mkdir(exist_ok=True)
            start = time.perf_counter()
            subprocess.run(["bash", "-c", TEST_SH.replace("/logs/verifier", str(script))], check=True)
            scripts.append(time.perf_counter() - start)
            pids = [ep.init_pid, *descendants(ep.init_pid)]
            memory_mb = sum(rss_kb(p) for p in pids) / 1024
            disk = sum(f.stat().st_size for f in ep._run.dirs.root.rglob("*") if f.is_file()) / 1024  # noqa: SLF001
            ep.close()
        med = lambda xs: statistics.median(xs) * 1000  # noqa: E731
        podman_text = f"; `podman run` {med(podmans):.0f} ms" if podmans else "; podman: not installed here"
        rows.append(("reset (sandbox up, shell ready)", f"{med(resets):.1f} ms",
                     f"bare bwrap `true` {med(bares):.1f} ms{podman_text}", "≤ 30 ms", med(resets) <= 30))
        ratio = med(networked) / med(resets)
        rows.append(("reset with network (public)", f"{med(networked):.1f} ms",
                     f"without network {med(resets):.1f} ms ({ratio:.2f}x); bare bwrap {med(bares):.1f} ms",
                     "≤ 1.5x without", ratio <= 1.5))
        overhead = med(evals) - med(scripts)
        rows.append(("evaluate overhead beyond test.sh", f"{overhead:.1f} ms",
                     f"test.sh by bash on the host {med(scripts):.1f} ms (evaluate {med(evals):.1f} ms); "
                     f"{overhead / med(bares):.1f}x a bare bwrap start", "≤ 20 ms", overhead <= 20))
        cold = med(colds) - med(scripts)
        rows.append(("evaluate overhead after 100 ms idle", f"{cold:.1f} ms",
                     f"back to back {overhead:.1f} ms (cgroup v1: a process joins the verifier's pids "
                     "cgroup after an RCU grace period, which idle makes cold)", "report", True))
        separate = med(spares) - med(scripts)
        ad_hoc = med(separates) - med(scripts)
        rows.append(("evaluate overhead, separate verifier env (a task that declares it: its pristine view "
                     "started with the episode), after the agent's turn", f"{separate:.1f} ms",
                     f"{separate / med(bares):.1f}x a bare bwrap start; asked ad hoc of a shared-mode episode "
                     f"(the view started then) {ad_hoc:.1f} ms ({ad_hoc / med(bares):.1f}x); shared mode's "
                     f"{overhead:.1f} ms", "≤ 50 ms", separate <= 50))

        start = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            rewards = list(pool.map(one_trial, [EXAMPLES / "python-csv-stats"] * args.concurrency))
        wall = time.perf_counter() - start
        failures = sum(r != 1.0 for r in rewards)
        rows.append((f"{args.concurrency} concurrent episodes (oracle, python-csv-stats)",
                     f"{failures} failures, {wall:.1f} s wall", f"{wall / args.concurrency * 1000:.0f} ms per trial",
                     "no failure", failures == 0))
        rows.append(("one idle episode, resident (init, sleep, shell)", f"{memory_mb:.1f} MB",
                     f"its writable layers on disk: {disk:.0f} KB", "report", True))

    return report(f"sequester episode benchmark ({args.runs} runs, {os.cpu_count()} CPUs, uid {os.getuid()})", rows)


if __name__ == "__main__":
    sys.exit(main())
