"""A node's side of the cluster, without a cluster (:mod:`sequester.cluster.node`): its
settings, the staging of dead workers swept, and its cache of shipped tasks kept out of
every episode's view."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from paths import EXAMPLES

from sequester.cluster.bundles import pack_task, unpack_task
from sequester.cluster.node import machine_defaults, settings_for_node, sweep_staging
from sequester.environments.settings import EpisodeSettings, default_state_dir
from sequester.images.image_settings import default_store_dir


def test_paths_left_at_the_drivers_default_follow_the_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = EpisodeSettings(toolchain_dir=tmp_path / "tc")
    defaulted = machine_defaults(settings)
    assert defaulted == {"state_dir", "images.store_dir"}, "the toolchain was set explicitly"
    if os.getuid() != 0:  # an ordinary user's defaults follow $XDG_*: another machine's home
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "node-cache"))
        monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "node-data"))
    on_node = settings_for_node(settings, defaulted)
    assert on_node.state_dir == default_state_dir() and on_node.images.store_dir == default_store_dir()
    assert on_node.toolchain_dir == tmp_path / "tc" and on_node.images.source == settings.images.source
    assert settings_for_node(settings, frozenset()) == settings


def test_staging_of_a_worker_that_died_is_swept(tmp_path: Path) -> None:
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / f"{dead.pid}-abc").mkdir()
    (tmp_path / f"{os.getppid()}-live").mkdir()
    (tmp_path / f"{os.getpid()}-mine").mkdir()
    assert sweep_staging(tmp_path) == [f"{dead.pid}-abc"]
    assert sorted(os.listdir(tmp_path)) == sorted([f"{os.getppid()}-live", f"{os.getpid()}-mine"])


def test_a_plain_local_episode_does_not_see_the_nodes_cache() -> None:
    """Any episode on a machine that is also a Ray node, not only those the cluster starts:
    the cache holds shipped tasks' solutions (found so by the reward-hack catalogue)."""
    from sequester.cluster.node import cluster_cache
    from sequester.environments.local.episode import Episode

    folder = unpack_task(pack_task(EXAMPLES / "c-word-count"), cluster_cache() / "tasks")
    solution = folder / "solution" / "solve.sh"
    assert solution.is_file(), "control: the host has it"
    with Episode() as ep:
        ep.reset(EXAMPLES / "python-csv-stats")
        seen = ep.exec(f"cat {solution}; ls -a {cluster_cache()}/tasks; echo END")
    assert "END" in seen.stdout and solution.read_text().strip().splitlines()[-1] not in seen.stdout
    assert folder.parent.name not in seen.stdout, seen.stdout
