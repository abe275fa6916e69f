"""Calibration in jobs (:mod:`sequester.jobs.calibrate`, ``sequester calibrate``,
``run --calibration``): real oracle and nop trials on example tasks and broken copies."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from paths import EXAMPLES

from sequester.calibration import CalibrationStore
from sequester.environments.settings import EpisodeSettings
from sequester.jobs.job import calibrate_tasks, run_job

from conditions import requires_root

pytestmark = [requires_root, pytest.mark.slow]


@pytest.fixture
def tasks(tmp_path):
    """A good task, one whose solution does nothing (its oracle scores 0), one without a solution."""
    root = tmp_path / "tasks"
    root.mkdir()
    shutil.copytree(EXAMPLES / "python-csv-stats", root / "good")
    shutil.copytree(EXAMPLES / "python-csv-stats", root / "broken")
    (root / "broken" / "solution" / "solve.sh").write_text("true\n")
    shutil.copytree(EXAMPLES / "python-csv-stats", root / "unsolved")
    shutil.rmtree(root / "unsolved" / "solution")
    return root


def _by_task(job_dir: Path) -> dict[str, dict]:
    out = {}
    for result in job_dir.glob("*/result.json"):
        data = json.loads(result.read_text())
        out[data["task_name"]] = data
    return out


def test_calibration_refuses_a_broken_task_and_scores_a_good_one(tasks, tmp_path):
    store = CalibrationStore(tmp_path / "store")
    settings = EpisodeSettings()
    found = {r.task: s for r, s in calibrate_tasks([tasks], jobs_dir=tmp_path / "jobs", settings=settings, store=store)}
    assert found["good"].state == "calibrated" and found["broken"].state == "not-calibrated"
    assert "oracle scored 0" in found["broken"].reason and found["unsolved"].state == "uncalibrated"
    job = run_job([tasks], "oracle", jobs_dir=tmp_path / "jobs", job_name="run", settings=settings,
                  calibration="auto", **_store(store))
    trials = _by_task(tmp_path / "jobs" / "run")
    assert trials["good"]["verifier_result"]["rewards"]["reward"] == 1.0
    assert trials["good"]["calibration"]["state"] == "calibrated"
    # never a 0: the broken task's trial is an environment error that retries do not repeat
    broken = trials["broken"]
    assert broken["verifier_result"] is None and broken["exception_info"]["sequester_exception_type"] == "TaskNotCalibrated"
    assert broken["exception_info"]["policy_override"]["should_retry"] is False
    assert trials["unsolved"]["calibration"]["state"] == "uncalibrated" and job.n_uncalibrated == 1


def test_required_calibrates_once_and_a_changed_task_is_calibrated_again(tasks, tmp_path):
    store = CalibrationStore(tmp_path / "store")
    good = tasks / "good"
    jobs = tmp_path / "jobs"
    run_job([good], "nop", jobs_dir=jobs, job_name="first", calibration="required", **_store(store))
    assert len(list(jobs.glob("first__calibration-*"))) == 2 and len(list(store.root.glob("*.json"))) == 1
    run_job([good], "nop", jobs_dir=jobs, job_name="second", calibration="required", **_store(store))
    assert not list(jobs.glob("second__calibration-*"))  # the record is reused
    (good / "instruction.md").write_text((good / "instruction.md").read_text() + "\nOne more line.\n")
    run_job([good], "nop", jobs_dir=jobs, job_name="third", calibration="required", **_store(store))
    assert len(list(jobs.glob("third__calibration-*"))) == 2 and len(list(store.root.glob("*.json"))) == 2


def test_required_refuses_a_task_without_a_solution(tasks, tmp_path):
    store = CalibrationStore(tmp_path / "store")
    run_job([tasks / "unsolved"], "nop", jobs_dir=tmp_path / "jobs", job_name="j", calibration="required",
            **_store(store))
    trial = _by_task(tmp_path / "jobs" / "j")["unsolved"]
    assert trial["exception_info"]["sequester_exception_type"] == "TaskNotCalibrated"
    assert "no solution" in trial["exception_info"]["exception_message"]


def test_the_cli_calibrates_and_says_so(tasks, tmp_path):
    env = {"SEQUESTER_CALIBRATION_DIR": str(tmp_path / "store"), "PATH": "/usr/bin:/bin",
           "PYTHONPATH": ":".join(sys.path)}
    done = subprocess.run([sys.executable, "-m", "sequester.cli", "calibrate", str(tasks / "good"), str(tasks / "broken"),
                           "--repeats", "2", "-o", str(tmp_path / "jobs")], capture_output=True, text=True, env=env,
                          timeout=600)
    text = " ".join(done.stdout.split())
    assert done.returncode == 1 and "good │ 1, 1 │ 0, 0 │ calibrated" in text and "not calibrated" in text, done
    bad = subprocess.run([sys.executable, "-m", "sequester.cli", "calibrate", str(tasks), "--repeats", "0"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "--repeats" in bad.stderr and "Traceback" not in bad.stderr


def _store(store: CalibrationStore) -> dict:
    return {"calibration_store": store}
