"""Checkpoints through the episode pool's local backend: checkpoint, fork (a slot like a
reset, never a warm episode, waiting or refused at capacity), rollback, release, the
checkpoint going with the episode that made it while its forks keep their files; sync and
async; nothing left after shutdown. Real episodes on the busybox image."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from images import busybox_task_folder

from sequester.environments.local.checkpoint import CheckpointError
from sequester.environments.pool import EpisodePool, PoolFull
from sequester.environments.pool.core import CheckpointInfo
from sequester.environments.settings import EpisodeSettings
from sequester.errors import EpisodeError, PolicyError
from sequester.images import ImageSettings

pytestmark = pytest.mark.slow
TASK = "ck"


@pytest.fixture(scope="module")
def image_tasks(tmp_path_factory) -> tuple[Path, ImageSettings]:
    return busybox_task_folder(tmp_path_factory.mktemp("pool-ck"), "pool-ck")


def _checkpoint_folders(state: Path) -> list[Path]:
    return sorted(state.glob(f"{os.getpid()}-ckpt-*")) if state.is_dir() else []


def test_checkpoint_fork_rollback_release_through_the_pool(image_tasks, tmp_path):
    tasks, images = image_tasks
    state = tmp_path / "state"
    settings = EpisodeSettings(images=images, state_dir=state)
    with EpisodePool(tasks, settings=settings, capacity=3, calibration="off", wait_timeout=0) as pool:
        ep = pool.acquire(TASK)
        ep.exec("echo one > /app/x; sleep 600 &")
        cp = ep.checkpoint()
        assert isinstance(cp, CheckpointInfo) and cp.episode_id == ep.episode_id and cp.depth == 1
        assert any("sleep 600" in p for p in cp.not_restored) and cp.bytes > 0
        fork = pool.fork(cp)
        assert fork.episode_id != ep.episode_id and fork.task == TASK
        assert fork.exec("cat /app/x").stdout == "one\n"
        fork.exec("echo fork > /app/x")
        assert ep.exec("cat /app/x").stdout == "one\n"  # the fork's write is its own
        ep.exec("echo two > /app/x")
        pool.rollback(ep, cp.id)  # by its id too
        assert ep.exec("cat /app/x").stdout == "one\n"
        # Capacity: the third slot, then PoolFull (wait_timeout=0), never a warm episode.
        third = pool.fork(cp)
        with pytest.raises(PoolFull):
            pool.fork(cp)
        third.close()
        # A forked episode scores like any other.
        assert pool.evaluate(fork).reward == 0.0
        fork.close()
        # Release: the checkpoint cannot be forked any more; the episodes on it go on.
        pool.release(cp)
        pool.release(cp)  # idempotent
        with pytest.raises(CheckpointError, match="not held"):
            pool.fork(cp)
        assert ep.exec("cat /app/x").stdout == "one\n" and pool.evaluate(ep).reward == 1.0
        # The checkpoint goes with the episode that made it; its forks keep their files.
        other = pool.acquire(TASK)
        other.exec("echo one > /app/x")
        cp2 = pool.checkpoint(other)
        child = pool.fork(cp2)
        other.close()
        with pytest.raises(EpisodeError, match="closed"):
            pool.fork(cp2)
        assert child.exec("cat /app/x").stdout == "one\n"
        assert _checkpoint_folders(state)  # held by the child
        child.close()
        ep.close()
        assert _checkpoint_folders(state) == []
    assert _checkpoint_folders(state) == []


def test_async_checkpoint_and_fork(image_tasks, tmp_path):
    tasks, images = image_tasks
    settings = EpisodeSettings(images=images, state_dir=tmp_path / "state")

    async def go() -> list[str]:
        async with EpisodePool(tasks, settings=settings, capacity=4, calibration="off") as pool:
            ep = await pool.aacquire(TASK)
            await ep.aexec("echo one > /app/x")
            cp = await ep.acheckpoint()
            forks = await asyncio.gather(*(pool.afork(cp) for _ in range(3)))
            outs = [(await f.aexec("cat /app/x; echo $$")).stdout.split()[0] for f in forks]
            await forks[0].aexec("echo changed > /app/x")
            await ep.arollback(cp)
            outs.append((await ep.aexec("cat /app/x")).stdout.strip())
            await pool.arelease(cp)
            for f in forks:
                await f.aclose()
            await ep.aclose()
            return outs

    assert asyncio.run(go()) == ["one"] * 4
    assert _checkpoint_folders(tmp_path / "state") == []


def test_bad_checkpoint_ids_are_refused_naming_them(image_tasks, tmp_path):
    tasks, images = image_tasks
    with EpisodePool(tasks, settings=EpisodeSettings(images=images, state_dir=tmp_path / "s"), calibration="off") as pool:
        for bad in ("nohyphen", "-x", "../../etc-x", "a" * 200 + "-b"):
            with pytest.raises(EpisodeError, match="not a checkpoint id"):
                pool.fork(bad)
        with pytest.raises(PolicyError, match="checkpoint"):
            pool.release(42)  # type: ignore[arg-type]
        with pytest.raises(EpisodeError):
            pool.fork("0123abcd-0123")  # well-formed, of no episode


def test_a_host_mode_episode_says_it_cannot(tmp_path):
    from paths import EXAMPLES

    settings = EpisodeSettings(images=ImageSettings(source="host"), state_dir=tmp_path / "state")
    with EpisodePool(EXAMPLES, settings=settings, calibration="off") as pool:
        ep = pool.acquire("python-csv-stats")
        with pytest.raises(Exception, match="needs an episode on an image"):
            pool.checkpoint(ep)
        assert ep.exec("echo ok").stdout == "ok\n"  # and it goes on
