"""Checkpoint, rollback and fork of an episode on an image, side by side in one run.

    python benchmarks/checkpoint_bench.py [--runs N] [--sizes 10,500]

For each size (MB the agent changed since the episode started: files of 1 MB written in
``/app``): ``Episode.checkpoint()``, ``rollback()`` to it, ``fork(cp, 1)`` and
``fork(cp, 4)`` (per fork), on the busybox image (tests/helpers/images.py), with, in the
same run: a fresh ``reset`` of the same task, a bare bwrap start, and a bwrap start that
mounts an overlay of the same layers (the image's and the sealed one: what a remount
costs alone). DeltaBox (arXiv 2605.22781) publishes 10.8 ms per checkpoint and 1.9 ms per
rollback with its processes kept; sequester restarts them instead (the shell), so its
checkpoint and rollback each cost about a sandbox start.

Needs skopeo and apt-get (the busybox image is made as the tests make it).
"""

from __future__ import annotations

import argparse
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

from sequester.environments.local.episode import Episode  # noqa: E402
from sequester.environments.settings import EpisodeSettings  # noqa: E402
from sequester.images import ImageSettings, ImageStore  # noqa: E402
from sequester.sandbox.probe import bwrap_path  # noqa: E402

TEST_SH = "test -f /app/f1 && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n"


def _task(root: Path, image: str) -> Path:
    task = root / "task"
    for sub in ("tests", "environment", "solution"):
        (task / sub).mkdir(parents=True)
    (task / "instruction.md").write_text("Nothing to do.\n")
    (task / "task.toml").write_text(
        f'version = "1.0"\n[verifier]\ntimeout_sec = 60\n[environment]\ndocker_image = "{image}"\nworkdir = "/app"\n'
    )
    (task / "environment" / "Dockerfile").write_text("FROM scratch\n")
    (task / "tests" / "test.sh").write_text(TEST_SH)
    (task / "solution" / "solve.sh").write_text("true\n")
    return task


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.1f} ms" + (
        f" (p90 {sorted(values)[int(0.9 * (len(values) - 1))] * 1000:.0f})" if len(values) >= 5 else ""
    )


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--sizes", default="10,500", help="MB changed before each checkpoint, comma-separated")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="seq-ckpt-bench-", dir="/var/tmp") as tmp:
        root = Path(tmp)
        images = ImageSettings(store_dir=root / "store", source="prebuilt")
        record = ImageStore(images).import_source(str(busybox_rootfs()), "bench/busybox:ckpt")
        settings = EpisodeSettings(images=images, state_dir=root / "state")
        task = _task(root, "bench/busybox:ckpt")
        with Episode(settings) as warm:  # the runner tree, the store's lease, caches
            warm.reset(task)
            warm.checkpoint().release()
        layers = ImageStore(images).lease(record)
        bare = [bwrap_path(), "--unshare-user", "--unshare-pid", "--unshare-net", "--ro-bind", "/", "/",
                "--tmpfs", "/tmp", "--proc", "/proc", "--dev", "/dev", "/bin/true"]
        for size in sizes:
            resets, checkpoints, rollbacks, forks, forks4, bares, overlays, disk = [], [], [], [], [], [], [], []
            runs = args.runs if size <= 50 else max(2, args.runs // 2)
            for _ in range(runs):
                fresh = Episode(settings)
                resets.append(_timed(lambda: fresh.reset(task)))
                fresh.close()
                bares.append(_timed(lambda: subprocess.run(bare, check=True)))
                with Episode(settings) as ep:
                    ep.reset(task)
                    r = ep.exec(f"i=1; while [ $i -le {size} ]; do dd if=/dev/zero of=/app/f$i bs=1M count=1 "
                                "2>/dev/null; i=$((i+1)); done; sync", timeout=600)
                    assert r.exit_code == 0, r
                    got = []
                    checkpoints.append(_timed(lambda: got.append(ep.checkpoint())))
                    cp = got[0]
                    disk.append(cp.layer_bytes)
                    remount = [bwrap_path(), "--unshare-user", "--unshare-pid", "--unshare-net", "--ro-bind", "/", "/",
                               *[a for layer in (*layers.layers, *cp.layers) for a in ("--overlay-src", str(layer))],
                               "--tmp-overlay", "/mnt", "--proc", "/proc", "--dev", "/dev", "/bin/true"]
                    overlays.append(_timed(lambda: subprocess.run(remount, check=True)))
                    ep.exec("rm -f /app/f1; echo changed > /app/new")
                    rollbacks.append(_timed(lambda: ep.rollback(cp)))
                    assert ep.exec("test -f /app/f1 && test ! -e /app/new && echo ok").stdout == "ok\n"
                    one: list[Episode] = []
                    forks.append(_timed(lambda: one.extend(ep.fork(cp, 1))))
                    four: list[Episode] = []
                    forks4.append(_timed(lambda: four.extend(ep.fork(cp, 4))) / 4)
                    for f in one + four:
                        f.close()
                    cp.release()
            reference = (f"fresh reset {_ms(resets)}; bare bwrap {_ms(bares)}; bwrap + overlay of the same layers "
                         f"{_ms(overlays)}")
            rows.append((f"checkpoint, {size} MB changed", _ms(checkpoints), reference, "report (DeltaBox: 10.8 ms)",
                         True))
            rows.append((f"rollback, {size} MB changed", _ms(rollbacks), f"fresh reset {_ms(resets)}",
                         "report (DeltaBox: 1.9 ms)", True))
            rows.append((f"fork (one), {size} MB changed", _ms(forks), f"fresh reset {_ms(resets)}", "report", True))
            rows.append((f"fork of 4, per fork, {size} MB changed", _ms(forks4), f"fresh reset {_ms(resets)}",
                         "report", True))
            rows.append((f"disk of the sealed layer, {size} MB changed",
                         f"{statistics.median(disk) / 1e6:.1f} MB", f"{size * 1.048576:.1f} MB written",
                         "about what was written", statistics.median(disk) <= size * 1.048576e6 * 1.1 + 1e6))
        layers.release()
    return report("checkpoint, rollback and fork (episodes on an image)", rows)


if __name__ == "__main__":
    sys.exit(main())
