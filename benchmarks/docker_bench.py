"""The docker backend's overhead, side by side with bare Docker SDK calls on the same
engine and image, and with local mode, in one run.

    python benchmarks/docker_bench.py [--runs 3]

A podman API service of the benchmark's own (tests/helpers/engine.py: runc, overlay storage,
as CI runs it; root only) and a Debian trixie image (python3, bash) imported into it. The
task: a minimal one (its test.sh writes reward 1). Per run, alternating:

* ``DockerEnvironment`` start + evaluate + close, shared mode (the tests in the agent's
  container) against the bare SDK doing the same work a Docker-API harness does:
  ``containers.run`` + ``put_archive`` of the tests + ``exec_run("bash /tests/test.sh")``
  + reading the reward + ``remove``: within 1.2x;
* the same in separate mode (a second, pristine container runs the tests) against the bare
  SDK making that second container too: within 1.2x;
* local mode on the same image (imported into sequester's store from the engine), beside.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "helpers"))

from _report import report  # noqa: E402
from engine import import_rootfs, running_engine  # noqa: E402
from episode_bench import TEST_SH, minimal_task  # noqa: E402
from images import trixie_rootfs  # noqa: E402

from sequester.environments.docker import DockerEnvironment  # noqa: E402
from sequester.environments.local.episode import Episode  # noqa: E402
from sequester.environments.settings import EpisodeSettings  # noqa: E402
from sequester.images import ImageSettings, ImageStore  # noqa: E402

IMAGE = "localhost/bench/trixie:1"
KEEP_ALIVE = ["/bin/sh", "-c", "trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done"]


def docker_task(root: Path) -> Path:
    return minimal_task(root, base=IMAGE, environment=f'docker_image = "{IMAGE}"\nallow_internet = false\n')


def tests_tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in (("tests/test.sh", TEST_SH.encode()), ("logs/verifier/.keep", b"")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def bare(client, containers: int) -> float:
    """What a Docker-API harness does for one trial's environment and verdict."""
    started = time.perf_counter()
    made = []
    try:
        for _ in range(containers):
            c = client.containers.run(IMAGE, KEEP_ALIVE, detach=True, network_mode="none", working_dir="/app")
            made.append(c)
        verifier = made[-1]
        verifier.put_archive("/", tests_tar())
        code, _ = verifier.exec_run(["bash", "/tests/test.sh"], workdir="/app")
        stream, _ = verifier.get_archive("/logs/verifier/reward.txt")
        assert code == 0 and b"".join(stream)
    finally:
        for c in made:
            c.remove(force=True)
    return time.perf_counter() - started


def sequester_docker(settings: EpisodeSettings, task: Path, mode: str) -> float:
    started = time.perf_counter()
    with DockerEnvironment(settings, base_url=settings.docker_host) as env:
        env.start(task)
        assert env.evaluate(verifier_env=mode).reward == 1.0
    return time.perf_counter() - started


def local(task: Path, store_dir: Path) -> float:
    started = time.perf_counter()
    settings = EpisodeSettings(images=ImageSettings(store_dir=store_dir, source="prebuilt"))
    with Episode(settings) as ep:
        ep.reset(task)
        assert ep.evaluate().reward == 1.0
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("docker_bench runs a podman service of its own, as root")
    import docker

    with tempfile.TemporaryDirectory(prefix="seq-docker-bench-") as tmp:
        root = Path(tmp)
        (root / "engine").mkdir()
        with running_engine(root / "engine") as eng:
            import_rootfs(eng, trixie_rootfs(), IMAGE, changes=["WORKDIR /app"])
            task = docker_task(root)
            settings = EpisodeSettings(backend="docker", docker_host=eng.host)
            os.environ["DOCKER_HOST"] = eng.host
            store = ImageStore(ImageSettings(store_dir=root / "store"))
            store.import_source(f"docker-daemon:{IMAGE}", IMAGE)
            client = docker.DockerClient(base_url=eng.host)
            times: dict[str, list[float]] = {k: [] for k in ("shared", "separate", "bare1", "bare2", "local")}
            sequester_docker(settings, task, "shared")  # warm: the engine's first container, imports
            bare(client, 1)
            for _ in range(args.runs):
                times["shared"].append(sequester_docker(settings, task, "shared"))
                times["bare1"].append(bare(client, 1))
                times["separate"].append(sequester_docker(settings, task, "separate"))
                times["bare2"].append(bare(client, 2))
                times["local"].append(local(task, root / "store"))
            client.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    shared, separate = med["shared"] / med["bare1"], med["separate"] / med["bare2"]
    rows = [
        ("start + evaluate + close, shared mode (median)", f"{med['shared']:.2f} s",
         f"bare SDK, one container: {med['bare1']:.2f} s", "ratio ≤ 1.2", shared <= 1.2),
        ("  ratio", f"{shared:.2f}", "", "", shared <= 1.2),
        ("start + evaluate + close, separate mode (median)", f"{med['separate']:.2f} s",
         f"bare SDK, two containers: {med['bare2']:.2f} s", "ratio ≤ 1.2", separate <= 1.2),
        ("  ratio", f"{separate:.2f}", "", "", separate <= 1.2),
        ("local mode, same image (reset + evaluate + close)", f"{med['local'] * 1000:.0f} ms",
         f"docker shared / local: {med['shared'] / med['local']:.0f}x", "report", True),
    ]
    return report(f"docker backend benchmark ({args.runs} runs; podman's Docker API, runc, overlay storage)", rows)


if __name__ == "__main__":
    sys.exit(main())
