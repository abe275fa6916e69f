"""Checkpoints through the Ray backend of ``EpisodePool`` on a real Ray cluster (loopback,
:mod:`ray_cluster`): checkpoint, a fork started on the checkpoint's own actor (whose node
has the layers), rollback, release, and a fork refused clearly when that actor is full.
Episodes on the busybox image."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

import ray_cluster  # noqa: E402 - after the skip: it is only of use with Ray
from images import busybox_task_folder  # noqa: E402

from sequester.cluster import ClusterError, EpisodePool  # noqa: E402
from sequester.environments.settings import EpisodeSettings  # noqa: E402
from sequester.images import ImageSettings  # noqa: E402

pytestmark = pytest.mark.slow
TASK = "ck"


@pytest.fixture(scope="module")
def cluster() -> Iterator[ray_cluster.RayCluster]:
    with ray_cluster.running() as started:
        yield started


@pytest.fixture(scope="module")
def image_tasks(tmp_path_factory) -> tuple[Path, ImageSettings]:
    return busybox_task_folder(tmp_path_factory.mktemp("ray-ck"), "ray-ck")


def test_checkpoint_fork_rollback_on_ray(cluster, image_tasks):
    tasks, images = image_tasks
    settings = EpisodeSettings(images=images)
    with EpisodePool(1, tasks, settings=settings, actor_cpus=0.5, episodes_per_actor=2, calibration="off",
                     wait_timeout=0) as pool:
        ep = pool.acquire(TASK)
        ep.exec("echo one > /app/x")
        cp = ep.checkpoint()
        fork = pool.fork(cp)
        assert (fork.node_id, fork.actor) == (ep.node_id, ep.actor)
        assert fork.exec("cat /app/x").stdout == "one\n"
        fork.exec("echo fork > /app/x")
        ep.exec("echo two > /app/x")
        pool.rollback(ep, cp)
        assert ep.exec("cat /app/x").stdout == "one\n"
        assert pool.evaluate(ep).reward == 1.0 and pool.evaluate(fork).reward == 0.0
        with pytest.raises(Exception, match="full|no room|PoolFull|slots"):
            pool.fork(cp)  # the actor's two episodes are held
        fork.close()
        pool.release(cp)
        with pytest.raises(Exception, match="not held"):
            pool.fork(cp)
        ep.close()
        with pytest.raises((ClusterError, Exception)):
            pool.fork(cp)
