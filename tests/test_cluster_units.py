"""The cluster's plain parts, without a cluster: task and trial archives, the node's
settings and cache, the driver's landing of a trial, and the feasibility check."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import tarfile
import time
from pathlib import Path

import pytest

from sequester.cluster import bundles
from sequester.cluster.bundles import (evict_unused, pack_folder, pack_task, task_on_node, unpack_folder,
                                       unpack_task)
from sequester.cluster.landing import land_error, land_trial
from sequester.cluster.node import (TrialReturn, machine_defaults, node_info, settings_for_node, sweep_staging)
from sequester.cluster.scheduler import infeasible, trial_resources
from sequester.environments.settings import EpisodeSettings, default_state_dir
from sequester.errors import PolicyError
from sequester.images.image_settings import default_store_dir
from sequester.jobs.results import TrialResult
from sequester.jobs.schedule import JobRun, PlannedTrial
from sequester.tasks import load_task

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "tasks"


def tree(root: Path) -> dict[str, bytes | str]:
    out: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        out[rel] = f"-> {os.readlink(path)}" if path.is_symlink() else (path.read_bytes() if path.is_file() else "/")
    return out


def test_a_task_travels_whole_and_unpacks_once(tmp_path: Path) -> None:
    task = EXAMPLES / "python-csv-stats"
    bundle = pack_task(task)
    assert bundle.name == task.name and pack_task(task).digest == bundle.digest, "the archive is reproducible"
    first = unpack_task(bundle, tmp_path / "cache")
    assert tree(first) == tree(task)
    assert (first / "solution" / "solve.sh").stat().st_mode & 0o111, "modes travel"
    marker = first / "marker"
    marker.write_text("x")
    assert unpack_task(bundle, tmp_path / "cache") == first and marker.exists(), "unpacked once"
    assert not [n for n in os.listdir(tmp_path / "cache") if n.startswith(".unpack-")]


def test_two_tasks_of_one_content_under_two_names_are_two_entries(tmp_path: Path) -> None:
    import shutil

    shutil.copytree(EXAMPLES / "python-csv-stats", tmp_path / "copy")
    original, copy = pack_task(EXAMPLES / "python-csv-stats"), pack_task(tmp_path / "copy")
    assert original.data == copy.data and original.digest != copy.digest
    assert unpack_task(original, tmp_path / "c").name == "python-csv-stats"
    assert unpack_task(copy, tmp_path / "c").name == "copy"


def test_a_task_archive_cannot_carry_what_it_must_not(tmp_path: Path) -> None:
    task = tmp_path / "t"
    task.mkdir()
    (task / "inside").write_text("x")
    (task / "ok").symlink_to("inside")
    assert tree(unpack_task(pack_task(task), tmp_path / "c"))["ok"] == "-> inside"
    (task / "out").symlink_to("/etc/passwd")
    with pytest.raises(PolicyError, match="links out of the task"):
        pack_task(task)
    (task / "out").unlink()
    (task / "up").symlink_to("../../x")
    with pytest.raises(PolicyError, match="links out"):
        pack_task(task)
    (task / "up").unlink()
    os.mkfifo(task / "fifo")
    with pytest.raises(PolicyError, match="not a file, folder or link"):
        pack_task(task)


def test_a_task_too_large_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    task = tmp_path / "t"
    task.mkdir()
    (task / "big").write_bytes(b"x" * 2000)
    monkeypatch.setattr(bundles, "MAX_TASK_BYTES", 1000)
    with pytest.raises(PolicyError, match="too large"):
        pack_task(task)


def test_a_tampered_archive_is_refused(tmp_path: Path) -> None:
    bundle = pack_task(EXAMPLES / "python-csv-stats")
    middle = len(bundle.data) // 2
    forged = dataclasses.replace(bundle, data=bundle.data[:middle] + bytes([bundle.data[middle] ^ 1])
                                 + bundle.data[middle + 1:])
    with pytest.raises(PolicyError, match="does not match its digest"):
        unpack_task(forged, tmp_path)
    assert os.listdir(tmp_path) == [f".{bundle.digest}.lock"]


def _archive(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.type, info.linkname = kind, link
        tar.addfile(info, io.BytesIO(b""))
    return buffer.getvalue()


@pytest.mark.parametrize("filtered", [True, False], ids=["data-filter", "python-without-it"])
@pytest.mark.parametrize("name,kind,link", [("../escape", tarfile.REGTYPE, ""), ("/abs", tarfile.REGTYPE, ""),
                                            ("a/../../b", tarfile.REGTYPE, ""), ("l", tarfile.SYMTYPE, "/etc"),
                                            ("l", tarfile.SYMTYPE, "../../x"), ("h", tarfile.LNKTYPE, "/etc/passwd"),
                                            ("dev", tarfile.CHRTYPE, ""), ("fifo", tarfile.FIFOTYPE, "")])
def test_a_trial_archive_cannot_write_outside_its_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         filtered: bool, name: str, kind: bytes, link: str) -> None:
    if not filtered:  # Python before 3.11.4 (Debian 12's 3.11.2): our own checks alone
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    with pytest.raises(PolicyError):
        unpack_folder(_archive(name, kind, link), tmp_path / "trial")
    assert not (tmp_path / "trial").exists() and os.listdir(tmp_path) == []


def test_a_trial_folder_ships_its_result_first_and_at_most_the_limit(tmp_path: Path) -> None:
    trial = tmp_path / "trial"
    (trial / "agent").mkdir(parents=True)
    (trial / "result.json").write_text("{}")
    (trial / "config.json").write_text("{}")
    (trial / "agent" / "a.log").write_bytes(b"a" * 600)
    (trial / "agent" / "b.log").write_bytes(b"b" * 600)
    (trial / "link").symlink_to("/etc/passwd")
    data, left_out = pack_folder(trial, limit=1000)
    assert left_out == ["agent/b.log", "link"], "over the limit, and never a link"
    unpack_folder(data, tmp_path / "back")
    assert set(tree(tmp_path / "back")) == {"agent", "agent/a.log", "config.json", "result.json"}


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


def test_a_used_task_is_kept_and_an_unused_one_evicted(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    old, used = pack_task(EXAMPLES / "python-csv-stats"), pack_task(EXAMPLES / "c-word-count")
    unpack_task(old, cache)
    long_ago = time.time() - 30 * 86400
    with task_on_node(used, cache) as folder:
        os.utime(cache / old.digest, (long_ago, long_ago))
        os.utime(cache / used.digest, (long_ago, long_ago))
        assert evict_unused(cache) == [old.digest], "held by a trial: kept"
        assert folder.is_dir()
    assert not (cache / old.digest).exists()
    with task_on_node(old, cache) as folder:  # evicted: unpacked again
        assert (folder / "task.toml").is_file()
    assert evict_unused(cache) == [used.digest], "old: just used; used: backdated, no longer held"


def test_eviction_leaves_no_lock_and_sweeps_a_killed_unpack(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    bundle = pack_task(EXAMPLES / "python-csv-stats")
    unpack_task(bundle, cache)
    stale, fresh = cache / ".unpack-old", cache / ".unpack-new"
    stale.mkdir()
    fresh.mkdir()
    long_ago = time.time() - 30 * 86400
    for path in (cache / bundle.digest, stale):
        os.utime(path, (long_ago, long_ago))
    assert evict_unused(cache) == [bundle.digest]
    assert sorted(os.listdir(cache)) == [".unpack-new"], "no lock file left, the killed unpack swept"


def test_staging_of_a_worker_that_died_is_swept(tmp_path: Path) -> None:
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / f"{dead.pid}-abc").mkdir()
    (tmp_path / f"{os.getppid()}-live").mkdir()
    (tmp_path / f"{os.getpid()}-mine").mkdir()
    assert sweep_staging(tmp_path) == [f"{dead.pid}-abc"]
    assert sorted(os.listdir(tmp_path)) == sorted([f"{os.getppid()}-live", f"{os.getpid()}-mine"])


def test_resources_and_feasibility_come_from_the_task(tmp_path: Path) -> None:
    task = load_task(EXAMPLES / "python-csv-stats")
    need = trial_resources(task)
    assert need["num_cpus"] == task.config.environment.cpus
    big = {"num_cpus": 4.0, "memory": 8192.0 * (1 << 20)}
    nodes = [{"CPU": 2.0, "memory": 16e9}, {"CPU": 8.0, "memory": 4e9}]
    assert "4 CPUs and 8192 MB" in infeasible(big, nodes) and "largest: 8 CPUs" in infeasible(big, nodes)
    assert infeasible(big, [*nodes, {"CPU": 4.0, "memory": 9e9}]) is None
    assert infeasible({"num_cpus": 1.0}, []) is not None, "no node at all"


def _planned(tmp_path: Path) -> tuple[PlannedTrial, JobRun]:
    task = load_task(EXAMPLES / "python-csv-stats")
    return (PlannedTrial("python-csv-stats__x", task, tmp_path / "job" / "python-csv-stats__x", None),
            JobRun("oracle", EpisodeSettings(), (EXAMPLES,), "job-1"))


def test_a_landed_trial_names_the_drivers_folders(tmp_path: Path) -> None:
    trial, job = _planned(tmp_path)
    node_dir = tmp_path / "node" / trial.name
    (node_dir / "verifier").mkdir(parents=True)
    (node_dir / "verifier" / "test-stdout.txt").write_text("ok")
    result = TrialResult(task_name="python-csv-stats", trial_name=trial.name, trial_uri=node_dir.as_uri(),
                         agent_info={}, verifier_result=None, exception_info=None, started_at="s", finished_at="f",
                         task_path="/node/cache/python-csv-stats",
                         config={"trials_dir": str(node_dir.parent), "task": {"path": "/node/cache/x"}})
    (tmp_path / "job").mkdir()
    data, _ = pack_folder(node_dir)
    landed = land_trial(TrialReturn(result, data, ("agent/huge.log",), node_info("n1")), trial,
                        [{"attempt": 1, "error_type": "WorkerCrashedError"}])
    on_disk = json.loads((trial.trial_dir / "result.json").read_text())
    assert on_disk["trial_uri"] == trial.trial_dir.resolve().as_uri() == landed.trial_uri
    assert on_disk["task_id"]["path"] == str(trial.task.path)
    assert on_disk["config"]["trials_dir"] == str(trial.trial_dir.parent)
    assert on_disk["config"]["task"]["path"] == str(trial.task.path)
    assert on_disk["node"]["node_id"] == "n1" and on_disk["retries"][0]["attempt"] == 1
    assert any("agent/huge.log" in n for n in on_disk["notes"])
    assert (trial.trial_dir / "verifier" / "test-stdout.txt").read_text() == "ok"


def test_a_trial_the_cluster_could_not_run_is_an_error_not_a_zero(tmp_path: Path) -> None:
    trial, job = _planned(tmp_path)
    (tmp_path / "job").mkdir()
    result = land_error(trial, job, RuntimeError("lost twice"), [{"attempt": 1}, {"attempt": 2}])
    on_disk = json.loads((trial.trial_dir / "result.json").read_text())
    assert result.reward is None and on_disk["verifier_result"] is None
    assert on_disk["exception_info"]["exception_message"] == "lost twice" and len(on_disk["retries"]) == 2
    assert (trial.trial_dir / "config.json").is_file()


def test_ray_address_without_the_ray_backend_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from sequester.cli import main

    assert main(["run", str(EXAMPLES / "python-csv-stats"), "--agent", "oracle", "-o", str(tmp_path),
                 "--ray-address", "127.0.0.1:1"]) == 2
    assert "--ray-address is for --backend ray" in capsys.readouterr().err
    assert not list(tmp_path.iterdir()), "nothing ran"


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
