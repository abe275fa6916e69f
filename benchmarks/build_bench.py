"""Dockerfile builds, side by side with ``podman build`` of the same file, in one run.

    python benchmarks/build_bench.py [--runs N]

* a fully cached build of a task (``sequester.imagebuild.build_task``, in-process): at most
  50 ms; ``podman build`` of the same file with its layer cache warm beside it;
* a cold build of a small Dockerfile (WORKDIR, two COPY and three RUN lines) on a busybox
  base, the build cache emptied before each run, against ``podman build --no-cache`` of the
  same file and context on the same machine (goal: a ratio of at most 1.0).

Both build on the same busybox root filesystem (tests/helpers/images.py), imported into
each one's own store, with no network for RUN. podman runs with private storage and runc
(see tests/images/test_sources.py for why); its figures are only taken when it is installed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "helpers"))

from _report import report  # noqa: E402
from images import busybox_rootfs  # noqa: E402

from sequester.imagebuild import build_task  # noqa: E402
from sequester.environments.settings import EpisodeSettings  # noqa: E402
from sequester.verifier.tree import runner_tree
from sequester.images import ImageSettings, ImageStore  # noqa: E402
from sequester.tasks import load_task  # noqa: E402

DOCKERFILE = """\
ARG BASE
FROM ${BASE}
WORKDIR /app
COPY data/ /app/data/
RUN mkdir -p /app/out && cp -r /app/data /app/out/ && echo built > /app/out/marker
COPY run.sh /app/run.sh
RUN sh /app/run.sh > /app/out/result
RUN rm -rf /app/data && ls -R /app > /app/out/listing
"""
CONTAINERS_CONF = '[containers]\ndefault_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]\n[engine]\nruntime = "runc"\n'


def make_task(root: Path, base: str) -> Path:
    task = root / "bench-build"
    for sub in ("environment/data", "tests"):
        (task / sub).mkdir(parents=True, exist_ok=True)
    (task / "instruction.md").write_text("Benchmark.\n")
    (task / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    (task / "task.toml").write_text('version = "1.0"\n')
    (task / "environment" / "Dockerfile").write_text(DOCKERFILE.replace("${BASE}", base).replace("ARG BASE\n", ""))
    for i in range(20):
        (task / "environment" / "data" / f"file{i}.txt").write_text(f"line {i}\n" * 200)
    (task / "environment" / "run.sh").write_text("for f in /app/data/*; do wc -l \"$f\"; done\n")
    return task


class Podman:
    def __init__(self, root: Path):
        root.mkdir(parents=True, exist_ok=True)
        conf = root / "containers.conf"
        conf.write_text(CONTAINERS_CONF)
        self.runroot = Path(tempfile.mkdtemp(prefix="pb-", dir="/tmp"))
        self.argv = ["podman", "--root", str(root / "storage"), "--runroot", str(self.runroot)]
        self.env = {**os.environ, "CONTAINERS_CONF": str(conf)}

    def run(self, *args: str) -> None:
        done = subprocess.run([*self.argv, *args], env=self.env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"podman {' '.join(args)}: {done.stderr[-2000:]}")

    def close(self) -> None:
        subprocess.run([*self.argv, "system", "reset", "--force"], env=self.env, capture_output=True, timeout=120)
        shutil.rmtree(self.runroot, ignore_errors=True)


def timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="build-bench-"))
    podman = Podman(root / "podman") if shutil.which("podman") and os.geteuid() == 0 else None
    try:
        rootfs = busybox_rootfs()
        settings = EpisodeSettings(images=ImageSettings(store_dir=root / "store", build_network="none"))
        store = ImageStore(settings.images)
        store.import_source(str(rootfs), "bench/busybox:1")
        runner = runner_tree(settings.toolchain_dir)
        task = load_task(make_task(root, "bench/busybox:1"))

        def ours(no_cache: bool = False) -> None:
            build_task(task, store, runner=runner, network="none", no_cache=no_cache)

        context = task.environment_dir
        if podman is not None:
            tarball = root / "busybox.tar"
            subprocess.run(["tar", "-C", str(rootfs), "-cf", str(tarball), "."], check=True)
            podman.run("import", str(tarball), "localhost/bench/busybox:1")
            podman_file = root / "Dockerfile.podman"
            podman_file.write_text(DOCKERFILE)

            def theirs(no_cache: bool) -> None:
                podman.run("build", "--network=none", "--build-arg", "BASE=localhost/bench/busybox:1",
                           *(["--no-cache"] if no_cache else []), "-t", "localhost/bench/built:1",
                           "-f", str(podman_file), str(context))

        cold, cold_ref, warm, warm_ref = [], [], [], []
        def empty_cache() -> None:  # the built images and the build cache gone: every step runs
            for record in store.records():
                if record.source.startswith("dockerfile:"):
                    store.remove(record.id)
            store.prune()

        for _ in range(args.runs):  # alternate, so both see the same machine load
            empty_cache()
            cold.append(timed(ours))
            if podman is not None:
                cold_ref.append(timed(lambda: theirs(True)))
        ours()
        if podman is not None:
            theirs(False)
        for _ in range(args.runs * 4):
            warm.append(timed(ours))
            if podman is not None and len(warm_ref) < args.runs:
                warm_ref.append(timed(lambda: theirs(False)))
        cold_s, warm_ms = statistics.median(cold), statistics.median(warm) * 1000
        rows = [("fully cached build (median)", f"{warm_ms:.1f} ms",
                 f"podman build, cached: {statistics.median(warm_ref) * 1000:.0f} ms" if warm_ref else "podman: not run",
                 "<= 50 ms", warm_ms <= 50)]
        if cold_ref:
            ratio = cold_s / statistics.median(cold_ref)
            rows.append(("cold build, 7 steps (median)", f"{cold_s * 1000:.0f} ms",
                         f"podman build --no-cache: {statistics.median(cold_ref) * 1000:.0f} ms (ratio {ratio:.2f})",
                         "ratio <= 1.0", ratio <= 1.0))
        else:
            rows.append(("cold build, 7 steps (median)", f"{cold_s * 1000:.0f} ms", "podman: not run (needs root)",
                         "ratio <= 1.0", True))
        return report(f"Dockerfile builds ({args.runs} runs each, alternating)", rows)
    finally:
        if podman is not None:
            podman.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
