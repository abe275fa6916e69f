"""``sequester run --backend ray`` (:mod:`sequester.cluster.scheduler`): a job's trials on a real two-node Ray cluster.

The cluster (tests/helpers/ray_cluster.py) is two raylets on loopback with one CPU each,
token authentication on; the agents the tests need run on its workers
(tests/helpers/ray_agents.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from paths import EXAMPLES, HELPERS

ray = pytest.importorskip("ray")

import ray_cluster  # noqa: E402 - tests/helpers, after the skip
from procs import pids_mentioning  # noqa: E402

from sequester.cluster import RayScheduler  # noqa: E402
from sequester.jobs import run_job  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    with ray_cluster.running() as started:
        yield started


def marked(marker: str) -> list[int]:
    """Pids of processes on this machine (every node of the test cluster) whose command line has ``marker``."""
    return pids_mentioning(marker)


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def rewards(job_dir: Path) -> dict[str, float | None]:
    out = {}
    for result in job_dir.glob("*/result.json"):
        data = json.loads(result.read_text())
        out[data["task_name"]] = (data["verifier_result"] or {}).get("rewards", {}).get("reward")
    return out


@pytest.mark.parametrize("agent", ["oracle", "nop"])
def test_the_examples_on_the_cluster_score_as_on_the_local_runner(cluster, tmp_path: Path, agent: str) -> None:
    local = run_job([EXAMPLES], agent, jobs_dir=tmp_path, job_name="local", concurrency=2)
    remote = run_job([EXAMPLES], agent, jobs_dir=tmp_path, job_name="ray", scheduler=RayScheduler(concurrency=4))
    assert remote.n_trials == local.n_trials == 5 and remote.n_errors == 0
    assert rewards(tmp_path / "ray") == rewards(tmp_path / "local")
    assert set(rewards(tmp_path / "ray").values()) == ({1.0} if agent == "oracle" else {0.0})
    # The job folder is the local runner's: every trial folder with its files, the driver's paths in its result.
    nodes = set()
    for trial in (tmp_path / "ray").iterdir():
        if not trial.is_dir():
            continue
        result = json.loads((trial / "result.json").read_text())
        assert result["trial_uri"] == trial.resolve().as_uri()
        assert Path(result["task_id"]["path"]).parent == EXAMPLES
        assert json.loads((trial / "config.json").read_text())["trials_dir"] == str(trial.parent)
        assert (trial / "verifier" / "test-stdout.txt").is_file() and (trial / "trial.log").is_file()
        assert (trial / "agent" / "commands.jsonl").is_file() and result["retries"] == []
        nodes.add(result["node"]["node_id"])
    assert nodes == set(cluster.node_ids), "the trials ran on both nodes"
    config = json.loads((tmp_path / "ray" / "config.json").read_text())
    assert config["scheduler"]["type"] == "ray"
    assert json.loads((tmp_path / "ray" / "result.json").read_text())["n_trials"] == 5


def test_a_trial_whose_worker_is_killed_is_retried_and_recorded(cluster, tmp_path: Path) -> None:
    control = cluster.root / "control"
    shutil.rmtree(control, ignore_errors=True)
    control.mkdir()
    pid_file = control / "python-csv-stats.pid"
    job: dict = {}
    thread = threading.Thread(target=lambda: job.update(result=run_job(
        [EXAMPLES / "python-csv-stats"], "ray_agents:DiesOnce", jobs_dir=tmp_path, job_name="j",
        scheduler=RayScheduler())))
    thread.start()
    pid = int(wait_for(lambda: pid_file.exists() and pid_file.read_text(), 120, "the first attempt's worker"))
    assert marked("sleep 4321.3"), "the first attempt's episode runs"
    os.kill(pid, signal.SIGKILL)
    # Its episode's processes die with the worker (bwrap --die-with-parent), before any retry ends.
    wait_for(lambda: not marked("sleep 4321.3"), 20, "the killed worker's episode processes gone")
    thread.join(300)
    result = job["result"]
    assert result.n_trials == 1 and result.n_errors == 0 and result.mean_reward == 1.0
    trial = json.loads(next((tmp_path / "j").glob("*/result.json")).read_text())
    (lost,) = trial["retries"]
    assert lost["attempt"] == 1 and lost["pid"] == pid and lost["error_type"] in ("WorkerCrashedError", "NodeDiedError")
    assert lost["node_id"] in cluster.node_ids and trial["node"]["pid"] != pid
    assert trial["verifier_result"]["rewards"]["reward"] == 1.0


def test_ctrl_c_cancels_the_remote_trials_and_leaves_nothing_running(cluster, tmp_path: Path) -> None:
    env = {**os.environ, **cluster.env, "PYTHONPATH": str(HELPERS)}
    # Ctrl-C as a terminal delivers it: to a CLI whose SIGINT is not ignored. (A test run
    # started in the background by a non-interactive shell, as `./.ci/run &` is, ignores
    # SIGINT, every child inherits that, and Python then installs no handler: the CLI never
    # sees the signal. That, not the CLI, was this test's hang in such runs.)
    proc = subprocess.Popen([sys.executable, "-m", "sequester.cli", "run", str(EXAMPLES / "python-csv-stats"),
                             str(EXAMPLES / "c-word-count"), "--agent", "ray_agents:Sleeper", "--backend", "ray",
                             "--ray-address", cluster.address, "-o", str(tmp_path), "--job-name", "cancelled"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_for(lambda: len(marked("sleep 4321.7")) >= 4, 120, "both trials' commands on the nodes")
        proc.send_signal(signal.SIGINT)
        # The scheduler's own bound: cancel_grace (30 s) for the trials to give way, 30 s for
        # the forced cancels, where each trial ran (10 s each), then Ray's shutdown. On a
        # loaded machine (CI beside a task sweep) 90 s was not always enough.
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err.decode()[-2000:]
    wait_for(lambda: not marked("sleep 4321.7"), 20, "no episode process left on any node")
    job = json.loads((tmp_path / "cancelled" / "result.json").read_text())
    assert job["finished_at"] and job["n_trials"] == 2
    assert {e["sequester_exception_type"] for e in job["errors"]} == {"TrialCancelled"}


def test_a_trial_that_ignores_the_cancel_has_its_worker_killed(cluster, tmp_path: Path) -> None:
    control = cluster.root / "control"
    shutil.rmtree(control, ignore_errors=True)
    control.mkdir()
    scheduler = RayScheduler(cancel_grace=2)

    def interrupt(*_):
        raise KeyboardInterrupt

    def arm() -> None:
        wait_for(lambda: list(control.glob("*.stubborn")), 120, "the stubborn agent")
        wait_for(lambda: marked("sleep 4321.9"), 30, "its background command")
        os.kill(os.getpid(), signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, interrupt)
    threading.Thread(target=arm, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_job([EXAMPLES / "python-csv-stats"], "ray_agents:Stubborn", jobs_dir=tmp_path, job_name="s",
                    scheduler=scheduler)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    wait_for(lambda: not marked("sleep 4321.9"), 20, "the episode's processes gone with the worker")
    (error,) = json.loads((tmp_path / "s" / "result.json").read_text())["errors"]
    assert error["sequester_exception_type"] == "TrialCancelled" and "worker was killed" in error["exception_message"]


def test_a_task_no_node_can_hold_is_an_error_at_once(cluster, tmp_path: Path) -> None:
    task = tmp_path / "tasks" / "big"
    shutil.copytree(EXAMPLES / "python-csv-stats", task)
    toml = task / "task.toml"
    text, count = re.subn(r"(?m)^cpus\s*=.*$", "cpus = 64", toml.read_text())
    assert count == 1
    toml.write_text(text)
    started = time.monotonic()
    job = run_job([task], "oracle", jobs_dir=tmp_path, job_name="big", scheduler=RayScheduler())
    assert time.monotonic() - started < 30
    (error,) = job.errors
    assert error["sequester_exception_type"] == "UnsupportedByBackend" and "64 CPUs" in error["exception_message"]


def test_without_ray_the_local_runner_works_and_the_ray_backend_says_how_to_install(tmp_path: Path) -> None:
    script = ("import sys; sys.modules['ray'] = None\n"  # import ray: ImportError
              "from sequester.cli import main\n"
              f"print('local', main(['run', {str(EXAMPLES / 'python-csv-stats')!r}, '--agent', 'oracle', '-o', "
              f"{str(tmp_path)!r}]))\n"
              f"print('ray', main(['run', {str(EXAMPLES / 'python-csv-stats')!r}, '--agent', 'oracle', '-o', "
              f"{str(tmp_path)!r}, '--backend', 'ray', '--job-name', 'r']))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert "local 0" in done.stdout and "ray 3" in done.stdout, done.stdout + done.stderr
    assert "pip install 'sequester[ray]'" in " ".join(done.stderr.split())
    assert not (tmp_path / "r").exists()


def test_an_agent_on_a_node_sees_no_shipped_task_nor_another_trial(cluster, tmp_path: Path) -> None:
    """The node's cache holds every shipped task's tests and solution, and its staging the
    running trials' folders: an agent looks for both (root's view shows /var; a user's
    cache is in its home, which every episode hides)."""
    from sequester.cluster.node import cluster_cache

    run_job([EXAMPLES / "c-word-count"], "oracle", jobs_dir=tmp_path, job_name="warm", scheduler=RayScheduler())
    cache = cluster_cache()
    shipped = list((cache / "tasks").glob("*/c-word-count/solution/solve.sh"))
    assert shipped, "control: the node's cache holds a shipped task's solution"
    script = tmp_path / "look.sh"
    script.write_text(f"ls -a {cache}/tasks {cache}/trials; cat {shipped[0]}; ls -a {EXAMPLES}; echo END\n")
    run_job([EXAMPLES / "python-csv-stats"], f"script:{script}", jobs_dir=tmp_path, job_name="look",
            scheduler=RayScheduler())
    (trial,) = [p for p in (tmp_path / "look").iterdir() if p.is_dir()]
    (command,) = [json.loads(line) for line in (trial / "agent" / "commands.jsonl").read_text().splitlines()]
    seen = command["stdout"] + command["stderr"]
    assert "END" in seen and shipped[0].read_text().strip().splitlines()[-1] not in seen
    assert "c-word-count" not in command["stdout"] and "solve.sh" not in command["stdout"], seen


def test_a_task_that_cannot_travel_is_its_own_error_not_the_jobs(cluster, tmp_path: Path) -> None:
    good, bad = tmp_path / "tasks" / "a-good", tmp_path / "tasks" / "b-fifo"
    shutil.copytree(EXAMPLES / "python-csv-stats", good)
    shutil.copytree(EXAMPLES / "python-csv-stats", bad)
    os.mkfifo(bad / "environment" / "pipe")
    job = run_job([good, bad], "oracle", jobs_dir=tmp_path, job_name="j", scheduler=RayScheduler())
    assert job.n_trials == 2 and job.mean_reward == 1.0, "the shippable task ran and scored"
    (error,) = job.errors
    assert error["sequester_exception_type"] == "PolicyError" and "environment/pipe" in error["exception_message"]


def test_a_trial_whose_folder_cannot_be_written_is_its_own_error(cluster, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from sequester.cluster import scheduler as scheduler_module

    real = scheduler_module.land_trial

    def full_disk(returned, trial, retries):
        if trial.task.name == "c-word-count":
            trial.trial_dir.mkdir()
            (trial.trial_dir / "half").write_text("x")
            raise OSError(28, "No space left on device")
        return real(returned, trial, retries)

    monkeypatch.setattr(scheduler_module, "land_trial", full_disk)
    job = run_job([EXAMPLES / "c-word-count", EXAMPLES / "python-csv-stats"], "oracle", jobs_dir=tmp_path,
                  job_name="j", scheduler=RayScheduler())
    assert job.n_trials == 2 and job.mean_reward == 1.0
    (error,) = job.errors
    assert "No space left on device" in error["exception_message"]
    (lost,) = [p for p in (tmp_path / "j").iterdir() if p.name.startswith("c-word-count")]
    assert not (lost / "half").exists() and json.loads((lost / "result.json").read_text())["node"]["node_id"]
