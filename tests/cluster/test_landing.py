"""The driver's landing of a trial a node ran (:mod:`sequester.cluster.landing`), without a
cluster: its result and folder under the driver's own paths, and a trial the cluster
could not run recorded as an error."""

from __future__ import annotations

import json
from pathlib import Path

from paths import EXAMPLES

from sequester.cluster.bundles import pack_folder
from sequester.cluster.landing import land_error, land_trial
from sequester.cluster.node import TrialReturn, node_info
from sequester.environments.settings import EpisodeSettings
from sequester.jobs.results import TrialResult
from sequester.jobs.schedule import JobRun, PlannedTrial
from sequester.tasks import load_task


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
