"""``--backend ray`` (:mod:`sequester.cluster.scheduler`) on a task's own image: the nodes pull it from a registry themselves.

A real two-node Ray cluster (tests/helpers/ray_cluster.py) and a real registry on loopback
(tests/helpers/registry.py) standing in for Docker Hub. The task is a copy of the example
``python-csv-stats`` naming a prebuilt image, which is what its Dockerfile builds: the
debootstrapped trixie image (tests/helpers/images.py; python3, as the task's
``FROM python:3.11-slim-bookworm`` has) with the Dockerfile's ``COPY data.csv /app/`` as a
layer of its own and ``WORKDIR /app``. The driver fetches nothing (a cluster's nodes have
their own stores): each trial's node pulls the image into the store its settings name,
the first trial on an empty store, the next from the store.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import tarfile
from pathlib import Path

import pytest
from paths import EXAMPLES

ray = pytest.importorskip("ray")

import ray_cluster  # noqa: E402 - tests/helpers, after the skip
from images import trixie_image  # noqa: E402
from registry import run, running_registry, skip_unless_tools, skopeo  # noqa: E402

from sequester.cluster import RayScheduler  # noqa: E402
from sequester.config import load_config  # noqa: E402
from sequester.images import ImageStore  # noqa: E402
from sequester.jobs import run_job  # noqa: E402

EXAMPLE = EXAMPLES / "python-csv-stats"
IMAGE = "sequester-examples/python-csv-stats:1"  # docker.io/..., through the config's mirror
pytestmark = pytest.mark.slow
TOOLS = ("skopeo", "umoci", "docker-registry")


@pytest.fixture(scope="module")
def base_image() -> str:
    """The trixie image (``oci:CACHED:trixie``), or skip: before the cluster starts."""
    skip_unless_tools(*TOOLS)
    return trixie_image()  # skips when the rootfs cannot be had (debootstrap needs root)


@pytest.fixture(scope="module")
def cluster(base_image):
    with ray_cluster.running() as started:
        yield started


def task_image(base: str, folder: Path) -> str:
    """What the example's Dockerfile builds, as an OCI layout: ``oci:FOLDER:csv``."""
    ref = f"oci:{folder}:csv"
    skopeo("copy", base, ref)  # a copy: the cached layout is never changed
    layer = folder.parent / "copy-data.tar"  # the Dockerfile's COPY, a layer of its own
    data = (EXAMPLE / "environment" / "data.csv").read_bytes()
    with tarfile.open(layer, "w", format=tarfile.PAX_FORMAT) as tar:
        app = tarfile.TarInfo("app")
        app.type, app.mode, app.mtime = tarfile.DIRTYPE, 0o755, 1_700_000_000
        tar.addfile(app)
        csv = tarfile.TarInfo("app/data.csv")
        csv.size, csv.mode, csv.mtime = len(data), 0o644, 1_700_000_000
        tar.addfile(csv, io.BytesIO(data))
    run(["umoci", "raw", "add-layer", "--image", f"{folder}:csv", str(layer)])
    run(["umoci", "config", "--image", f"{folder}:csv", "--config.workingdir", "/app"])
    return ref


def image_task(root: Path, name: str) -> Path:
    """A copy of the example whose task.toml names :data:`IMAGE`."""
    task = root / name
    shutil.copytree(EXAMPLE, task)
    toml = task / "task.toml"
    text, count = re.subn(r"(?m)^\[environment\]$", f'[environment]\ndocker_image = "{IMAGE}"', toml.read_text())
    assert count == 1
    # Each copy its own bytes: a node's task cache is keyed by the archive's digest, which
    # the folder's name is not part of (identical copies under two names collide there).
    toml.write_text(f"{text}# this copy: {name}\n")
    return task


def trial_results(job_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(job_dir.glob("*/result.json"))]


def test_the_nodes_pull_the_tasks_image_and_score_it_oracle_1_nop_0(base_image, cluster, tmp_path: Path) -> None:
    ref = task_image(base_image, tmp_path / "layout")
    tasks = [image_task(tmp_path / "tasks", "csv-stats-a"), image_task(tmp_path / "tasks", "csv-stats-b")]
    with running_registry(tmp_path / "registry") as registry:
        digest = registry.push(ref, IMAGE)
        config = tmp_path / "config.toml"
        config.write_text(f'[images]\nsource = "prebuilt"\nstore_dir = "store"\n'
                          f'mirrors = {{ "docker.io" = "{registry.host}" }}\ninsecure = ["{registry.host}"]\n')
        settings = load_config(config).episodes
        store = ImageStore(settings.images)
        assert store.root == tmp_path / "store" and store.find(IMAGE) is None

        # Cold: both trials at once, one on each node (one CPU each), on an empty store.
        oracle = run_job(tasks, "oracle", jobs_dir=tmp_path / "jobs", job_name="oracle", settings=settings,
                         scheduler=RayScheduler(concurrency=2))
        assert oracle.n_trials == 2 and oracle.n_errors == 0, oracle.errors
        record = store.find(IMAGE)
        assert record is not None, "the image is in the store the nodes were given"
        assert record.source_digest == digest and registry.host in record.source
        assert (tmp_path / "store" / "images" / f"{record.id.removeprefix('sha256:')}.json").is_file()
        results = trial_results(tmp_path / "jobs" / "oracle")
        assert {r["node"]["node_id"] for r in results} == set(cluster.node_ids), "each node ran a trial"
        for result in results:
            assert result["verifier_result"]["rewards"]["reward"] == 1.0, result
            assert result["system"]["mode"] == "image" and result["system"]["digest"] == digest, result["system"]
            assert result["system"]["id"] == record.id and result["retries"] == []

        # Warm: the image is in the store; the node takes it from there (no second record).
        nop = run_job(tasks[:1], "nop", jobs_dir=tmp_path / "jobs", job_name="nop", settings=settings,
                      scheduler=RayScheduler(concurrency=2))
        assert nop.n_trials == 1 and nop.n_errors == 0, nop.errors
        (result,) = trial_results(tmp_path / "jobs" / "nop")
        assert result["verifier_result"]["rewards"]["reward"] == 0.0, result
        assert result["system"]["mode"] == "image" and result["system"]["digest"] == digest
        assert result["node"]["node_id"] in cluster.node_ids
        assert [r.id for r in store.records()] == [record.id]
