"""Episodes on images, side by side with their references, in one run.

    python benchmarks/image_bench.py [--runs N]

* ``reset`` on an image (a ~30 MB busybox image from the store): at most 1.2x ``reset`` in
  host mode, measured alternately in the same run;
* extra disk per additional episode on the same image (its writable layer and state), in
  bytes, next to the image's own size;
* pulling and unpacking that image from a registry on loopback (Debian's docker-registry)
  into an empty store, next to ``skopeo copy`` of the same image to a local OCI layout
  (the ratio is reported).

Needs skopeo, umoci and docker-registry (the test images are made by the test helpers,
with the same real tools: tests/helpers/images.py).
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
from episode_bench import minimal_task  # noqa: E402
from images import tiny_image_30mb  # noqa: E402
from registry import running_registry  # noqa: E402

from sequester.environments.local.episode import Episode  # noqa: E402
from sequester.environments.settings import EpisodeSettings  # noqa: E402
from sequester.images import ImageSettings, ImageStore  # noqa: E402


def disk_bytes(path: Path) -> int:
    total = 0
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def image_task(root: Path, image: str) -> Path:
    task = minimal_task(root)
    toml = task / "task.toml"
    toml.write_text(toml.read_text() + f'[environment]\ndocker_image = "{image}"\nworkdir = "/app"\n')
    return task


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="seq-img-bench-") as tmp:
        tmp_path = Path(tmp)
        layout = tiny_image_30mb()
        with running_registry(tmp_path / "registry") as registry:
            registry.push(layout, "bench/tiny:1")
            remote = f"{registry.host}/bench/tiny:1"
            pulls, copies = [], []
            for i in range(3):
                settings = ImageSettings(store_dir=tmp_path / f"store-{i}", insecure=[registry.host])
                start = time.perf_counter()
                record = ImageStore(settings).pull(remote)
                pulls.append(time.perf_counter() - start)
                start = time.perf_counter()
                subprocess.run(["skopeo", "--insecure-policy", "copy", "--quiet", "--src-tls-verify=false",
                                f"docker://{remote}", f"oci:{tmp_path / f'layout-{i}'}:tiny"], check=True)
                copies.append(time.perf_counter() - start)
        pull, copy = statistics.median(pulls), statistics.median(copies)
        rows.append(("pull + unpack a 30 MB image (loopback registry)", f"{pull * 1000:.0f} ms",
                     f"skopeo copy to a layout {copy * 1000:.0f} ms", "report the ratio",
                     True))
        rows[-1] = (*rows[-1][:3], f"ratio {pull / copy:.2f}", True)

        images = ImageSettings(store_dir=tmp_path / "store-0", source="prebuilt")
        image_settings = EpisodeSettings(images=images, state_dir=tmp_path / "state-image")
        host_settings = EpisodeSettings(images=ImageSettings(source="host"), state_dir=tmp_path / "state-host")
        host_task = minimal_task(tmp_path / "host")
        on_image = image_task(tmp_path / "image", remote)
        for settings, task in ((host_settings, host_task), (image_settings, on_image)):
            with Episode(settings) as warm:
                warm.reset(task)
        host_resets, image_resets = [], []
        for _ in range(args.runs):
            for settings, task, times in ((host_settings, host_task, host_resets),
                                          (image_settings, on_image, image_resets)):
                ep = Episode(settings)
                start = time.perf_counter()
                ep.reset(task)
                times.append(time.perf_counter() - start)
                ep.close()
        host, image = statistics.median(host_resets), statistics.median(image_resets)
        rows.append(("reset on an image (median)", f"{image * 1000:.1f} ms", f"reset in host mode {host * 1000:.1f} ms",
                     "<= 1.2x host", image <= 1.2 * host))

        episodes = [Episode(image_settings) for _ in range(4)]
        try:
            for ep in episodes:
                ep.reset(on_image)
                ep.exec("echo work > /app/out.txt")
            per_episode = disk_bytes(tmp_path / "state-image") / len(episodes)
        finally:
            for ep in episodes:
                ep.close()
        rows.append(("extra disk per additional episode on one image", f"{per_episode / 1024:.0f} KiB",
                     f"the image's layers {record.size / 1e6:.0f} MB (one copy, shared)", "report bytes", True))
        shutil.rmtree(tmp_path / "state-image", ignore_errors=True)
    return report("episodes on images", rows)


if __name__ == "__main__":
    sys.exit(main())
