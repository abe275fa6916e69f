"""Real job folders (:mod:`sequester.jobs.harbor`), read by Harbor 0.26 itself: its models and its viewer's API.

``sequester run`` makes three jobs (the oracle and nop on the examples, and an agent that
prints, runs commands, tampers, writes a trajectory and, on one task, misuses its
episode); a Python >= 3.12 venv with ``harbor==0.26.*`` from PyPI (cached in
``$SEQUESTER_HARBOR_VENV``, default ``/var/cache/sequester-ci/harbor-venv``) validates
every ``config.json`` and ``result.json`` with Harbor's ``JobConfig``, ``JobResult``,
``TrialConfig``, ``TrialResult``, then asks the app ``harbor view`` serves
(``harbor.viewer.server.create_app`` over the jobs folder, through FastAPI's test client)
for the jobs, tasks, trials, rewards and each command's output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import harbor_venv
import pytest
from conditions import requires_root
from paths import EXAMPLES

pytestmark = [requires_root, pytest.mark.slow]  # every test reads the jobs a module fixture runs

TASK_NAMES = sorted(p.name for p in EXAMPLES.iterdir() if (p / "task.toml").is_file())

AGENT = '''
import sys

class Mixed:
    name = "mixed"
    version = "2.5"
    model_name = "acme/model-x"

    def run(self, instruction, episode):
        print("printed-by-the-agent")
        print("agent-stderr-line", file=sys.stderr)
        episode.exec("echo hello-from-command-0")
        episode.exec("echo to-stderr >&2; (exit 3)")
        self.trajectory = {"schema_version": "ATIF-v1.6", "session_id": "s1",
                           "agent": {"name": "mixed", "version": "2.5"},
                           "steps": [{"step_id": 1, "source": "user", "message": "do it"}]}
        if episode.task.name == "c-word-count":
            episode.evaluate()  # refused: an EpisodeError, no verdict
        episode.exec("echo 'export X=1' > /etc/profile.d/zz-mixed.sh")
'''

# Runs in Harbor's venv: validates with Harbor's models, then queries its viewer's app.
CHECK = textwrap.dedent('''
    import json, sys
    from pathlib import Path
    from fastapi.testclient import TestClient
    from harbor.models.job.config import JobConfig
    from harbor.models.job.result import JobResult
    from harbor.models.trial.config import TrialConfig
    from harbor.models.trial.result import TrialResult
    from harbor.viewer.server import create_app

    jobs = Path(sys.argv[1])
    out = {"models": {}, "api": {}}
    for job in sorted(p for p in jobs.iterdir() if p.is_dir()):
        config = JobConfig.model_validate_json((job / "config.json").read_text())
        result = JobResult.model_validate_json((job / "result.json").read_text())
        trials = {}
        for trial in sorted(p for p in job.iterdir() if p.is_dir()):
            TrialConfig.model_validate_json((trial / "config.json").read_text())
            r = TrialResult.model_validate_json((trial / "result.json").read_text())
            trials[trial.name] = {
                "task_name": r.task_name, "source": r.source, "reward_valid": r.reward_valid,
                "rewards": r.verifier_result.rewards if r.verifier_result else None,
                "agent": r.agent_info.model_dump(mode="json"), "config_task": r.config.task.model_dump(mode="json"),
                "exception": r.exception_info.model_dump(mode="json") if r.exception_info else None}
        out["models"][job.name] = {"agents": [a.name for a in config.agents],
                                   "n_concurrent_trials": config.n_concurrent_trials,
                                   "stats": result.stats.model_dump(mode="json"), "trials": trials}
    with TestClient(create_app(jobs, mode="jobs")) as client:
        def get(url):
            response = client.get(url)
            assert response.status_code == 200, (url, response.status_code, response.text)
            return response.json()
        out["api"]["jobs"] = get("/api/jobs")["items"]
        for job in out["models"]:
            api = out["api"][job] = {"job": get(f"/api/jobs/{job}"), "tasks": get(f"/api/jobs/{job}/tasks")["items"],
                                     "trials": get(f"/api/jobs/{job}/trials")["items"], "detail": {}}
            for trial in out["models"][job]["trials"]:
                api["detail"][trial] = {
                    "result": get(f"/api/jobs/{job}/trials/{trial}"),
                    "logs": get(f"/api/jobs/{job}/trials/{trial}/agent-logs"),
                    "verifier": get(f"/api/jobs/{job}/trials/{trial}/verifier-output"),
                    "trajectory": get(f"/api/jobs/{job}/trials/{trial}/trajectory")}
    print(json.dumps(out))
''')


@pytest.fixture(scope="session")
def harbor_python() -> str:
    """The venv's Python, with Harbor 0.26 installed (made once, reused between runs)."""
    return harbor_venv.harbor_python()


def sequester(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sequester.cli", *args], capture_output=True, text=True, timeout=300,
                          env=env)


@pytest.fixture(scope="module")
def harbor_view(harbor_python: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Three real jobs, and what Harbor's models and viewer say about them."""
    jobs = tmp_path_factory.mktemp("jobs")
    for agent in ("oracle", "nop"):
        r = sequester("run", str(EXAMPLES), "--agent", agent, "-o", str(jobs), "--job-name", agent)
        assert r.returncode == 0, r.stderr
    agent_dir = tmp_path_factory.mktemp("agent")
    (agent_dir / "mixed_agent.py").write_text(AGENT)
    r = sequester("run", str(EXAMPLES / "python-csv-stats"), str(EXAMPLES / "c-word-count"), "--agent",
                  "mixed_agent:Mixed", "-o", str(jobs), "--job-name", "mixed",
                  env={**os.environ, "PYTHONPATH": str(agent_dir)})
    assert r.returncode == 1, r.stderr  # c-word-count's trial has an error
    assert "printed-by-the-agent" not in r.stdout + r.stderr
    check = subprocess.run([harbor_python, "-c", CHECK, str(jobs)], capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr[-5000:]
    return {"jobs": jobs, **json.loads(check.stdout)}


def test_harbor_models_accept_every_document(harbor_view):
    models = harbor_view["models"]
    assert sorted(models) == ["mixed", "nop", "oracle"]
    for agent, reward in (("oracle", 1.0), ("nop", 0.0)):
        job = models[agent]
        assert job["agents"] == [agent] and job["n_concurrent_trials"] == 4
        assert sorted(t["task_name"] for t in job["trials"].values()) == TASK_NAMES
        for trial in job["trials"].values():
            assert trial["rewards"] == {"reward": reward} and trial["reward_valid"] and trial["exception"] is None
            assert trial["source"] == "tasks"  # the dataset (folder of tasks), not the task's path
            assert trial["config_task"]["name"] is None and trial["config_task"]["path"].endswith(trial["task_name"])
            assert trial["agent"] == {"name": agent, "version": trial["agent"]["version"], "model_info": None}
        stats = job["stats"]
        assert (stats["n_completed_trials"], stats["n_errored_trials"], stats["n_pending_trials"]) == (5, 0, 0)
        (group,) = stats["evals"].values()
        assert group["metrics"] == [{"mean": reward}] and group["n_trials"] == len(TASK_NAMES)


def test_exception_names_are_harbors_and_keep_sequesters(harbor_view):
    trials = {t["task_name"]: t for t in harbor_view["models"]["mixed"]["trials"].values()}
    assert trials["python-csv-stats"]["rewards"] == {"reward": 0.0} and trials["python-csv-stats"]["source"] is None
    assert trials["python-csv-stats"]["agent"] == {"name": "mixed", "version": "2.5",
                                                   "model_info": {"name": "model-x", "provider": "acme"}}
    error = trials["c-word-count"]["exception"]
    # EpisodeError has no Harbor name: it keeps its own, with the policy Harbor must apply
    assert error["exception_type"] == "EpisodeError" and not trials["c-word-count"]["reward_valid"]
    assert error["policy"] == {"should_retry": False, "should_grade": False, "has_valid_reward": False}
    stats = harbor_view["models"]["mixed"]["stats"]
    assert (stats["n_completed_trials"], stats["n_errored_trials"]) == (2, 1)
    result = json.loads(next((harbor_view["jobs"] / "mixed").glob("c-word-count__*/result.json")).read_text())
    assert result["exception_info"]["sequester_exception_type"] == "EpisodeError"


def test_harbor_view_lists_jobs_tasks_trials_and_rewards(harbor_view):
    api = harbor_view["api"]
    listed = {j["name"]: j for j in api["jobs"]}
    assert sorted(listed) == ["mixed", "nop", "oracle"]
    assert (listed["oracle"]["n_completed_trials"], listed["oracle"]["n_total_trials"]) == (5, 5)
    assert listed["oracle"]["evals"] and listed["oracle"]["datasets"] == ["tasks"]
    for agent, reward in (("oracle", 1.0), ("nop", 0.0)):
        assert api[agent]["job"]["stats"]["n_completed_trials"] == 5 and api[agent]["job"]["finished_at"]
        assert sorted((t["task_name"], t["avg_reward"], t["source"]) for t in api[agent]["tasks"]) == \
            [(name, reward, "tasks") for name in TASK_NAMES]
        assert sorted((t["task_name"], t["reward"]) for t in api[agent]["trials"]) == \
            [(name, reward) for name in TASK_NAMES]
    trials = {t["task_name"]: t for t in api["mixed"]["trials"]}
    assert trials["c-word-count"]["error_type"] == "EpisodeError" and trials["python-csv-stats"]["reward"] == 0.0


def test_harbor_view_shows_each_command_and_the_verifier_output(harbor_view):
    for trial, detail in harbor_view["api"]["oracle"]["detail"].items():
        (command,) = detail["logs"]["commands"]
        assert command["index"] == 0 and command["content"]  # solve.sh's own output
        assert detail["verifier"]["stdout"] if "stdout" in detail["verifier"] else any(detail["verifier"].values())
        assert detail["result"]["verifier_result"]["rewards"] == {"reward": 1.0}
    for trial, detail in harbor_view["api"]["mixed"]["detail"].items():
        commands = detail["logs"]["commands"]
        assert commands[0] == {"index": 0, "content": "hello-from-command-0\n"} and commands[1]["index"] == 1
        assert detail["trajectory"]["agent"]["name"] == "mixed" and detail["trajectory"]["steps"]
        folder = harbor_view["jobs"] / "mixed" / trial
        assert (folder / "agent" / "command-1" / "stderr.txt").read_text() == "to-stderr\n"
        assert (folder / "agent" / "command-1" / "return-code.txt").read_text() == "3\n"
        log = (folder / "trial.log").read_text()
        assert "agent stdout: printed-by-the-agent" in log and "agent stderr: agent-stderr-line" in log
