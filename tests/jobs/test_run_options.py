"""``sequester run``'s options spelled as ``harbor run`` spells them: attempts, task filters,
retries under Harbor's policy, timeout multipliers, an env file, the renamed
``--verifier-mode``, and a Harbor dataset name as input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from paths import EXAMPLES, SRC
from tasks import make_task

from sequester.jobs.retry import HARBOR_DEFAULT_EXCLUSIONS, RetryPolicy

# Fails its first attempt on each task (a marker file on the host says it ran before), then
# reports what it was given.
FLAKY = '''
import os, pathlib

class Flaky:
    name = "flaky"

    def run(self, instruction, episode):
        marker = pathlib.Path(os.environ["FLAKY_DIR"]) / episode.task.name
        if not marker.exists():
            marker.write_text("1")
            raise RuntimeError("the model API went away")
        episode.write_file("/logs/agent/seen.txt", os.environ.get("SECRET_FROM_ENV_FILE", "unset") + "\\n")

class Configured:
    name = "configured"

    def __init__(self, temperature, model="default", tools=()):
        self.seen = {"temperature": temperature, "model": model, "tools": list(tools)}

    def run(self, instruction, episode):
        import json
        episode.write_file("/logs/agent/seen.json", json.dumps(self.seen))

class Refuses:
    name = "refuses"

    def run(self, instruction, episode):
        raise TimeoutError("AgentTimeoutError stands in")
'''


def run(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sequester.cli", "run", *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(SRC), **(env or {})}, cwd=cwd)


def trials(job: Path) -> list[dict]:
    return [json.loads((p / "result.json").read_text()) for p in sorted(job.iterdir()) if p.is_dir()]


def test_attempts_and_task_filters(tmp_path):
    r = run(str(EXAMPLES), "--agent", "nop", "-k", "2", "-i", "c-*", "-i", "python-*", "-x", "python-csv-stats",
            "-o", str(tmp_path), "--job-name", "j")
    assert r.returncode == 0, r.stderr
    assert sorted(t["task_name"] for t in trials(tmp_path / "j")) == ["c-word-count", "c-word-count"]
    config = json.loads((tmp_path / "j" / "config.json").read_text())
    assert config["n_attempts"] == 2 and config["retry"]["max_retries"] == 0
    r = run(str(EXAMPLES), "--agent", "nop", "-x", "*", "-o", str(tmp_path))
    assert r.returncode == 2 and "no task of the 5 given is left" in r.stderr


def test_a_retryable_error_runs_again_and_a_job_keeps_only_the_last_attempt(tmp_path):
    (tmp_path / "flaky_agent.py").write_text(FLAKY)
    (tmp_path / "keys.env").write_text("# the agent's keys\nexport SECRET_FROM_ENV_FILE='from the file'\n")
    markers = tmp_path / "markers"
    markers.mkdir()
    env = {"FLAKY_DIR": str(markers), "PYTHONPATH": f"{SRC}:{tmp_path}"}
    r = run(str(EXAMPLES / "c-word-count"), "--agent", "flaky_agent:Flaky", "-r", "1", "--env-file",
            str(tmp_path / "keys.env"), "-o", str(tmp_path / "jobs"), "--job-name", "retried", env=env)
    assert r.returncode == 0, r.stderr
    (trial,) = trials(tmp_path / "jobs" / "retried")
    assert trial["exception_info"] is None and trial["verifier_result"]["rewards"] == {"reward": 0.0}
    seen = next((tmp_path / "jobs" / "retried").glob("c-word-count__*/agent/seen.txt"))
    assert seen.read_text() == "from the file\n"  # --env-file's variable reached the agent (its process)
    # Without retries the same error is the trial's; a type Harbor never retries is not retried.
    for marker in markers.iterdir():
        marker.unlink()
    r = run(str(EXAMPLES / "c-word-count"), "--agent", "flaky_agent:Flaky", "-o", str(tmp_path / "jobs"),
            "--job-name", "once", env=env)
    assert r.returncode == 1 and trials(tmp_path / "jobs" / "once")[0]["exception_info"]["exception_type"] == \
        "RuntimeError"
    r = run(str(EXAMPLES / "c-word-count"), "--agent", "flaky_agent:Refuses", "-r", "2", "--retry-exclude",
            "TimeoutError", "-o", str(tmp_path / "jobs"), "--job-name", "excluded", env=env)
    assert r.returncode == 1 and len(trials(tmp_path / "jobs" / "excluded")) == 1


def test_the_retry_policy_is_harbors():
    policy = RetryPolicy.of(3)
    assert policy.retryable("RuntimeError") and policy.retryable("RateLimitError")
    assert not policy.retryable("AgentTimeoutError")  # Harbor's own list
    assert not policy.retryable("VerifierTimeout")  # sequester's name of Harbor's VerifierTimeoutError
    assert not policy.retryable("TaskNotCalibrated")  # a retry changes nothing (sequester's policy)
    assert policy.retryable("VerifierCouldNotRun")  # Harbor's AddTestsDirError is retried
    assert not RetryPolicy.of(3, include=["ClusterError"]).retryable("RuntimeError")
    assert RetryPolicy.of(3, exclude=[]).retryable("AgentTimeoutError")
    assert "AgentTimeoutError" in HARBOR_DEFAULT_EXCLUSIONS and policy.wait(1) == 1 and policy.wait(10) == 60


def test_timeout_multipliers_scale_the_tasks_timeouts(tmp_path):
    task = make_task(tmp_path, "slow", test_sh="sleep 3; echo 1 > /logs/verifier/reward.txt\n", verifier_timeout=2)
    r = run(str(task), "--agent", "nop", "-o", str(tmp_path / "jobs"), "--job-name", "plain")
    (trial,) = trials(tmp_path / "jobs" / "plain")
    assert trial["verifier_result"]["rewards"] == {"reward": 0.0}  # ran over its 2 s
    r = run(str(task), "--agent", "nop", "--timeout-multiplier", "3", "-o", str(tmp_path / "jobs"),
            "--job-name", "scaled")
    assert r.returncode == 0, r.stderr
    (trial,) = trials(tmp_path / "jobs" / "scaled")
    assert trial["verifier_result"]["rewards"] == {"reward": 1.0}
    settings = json.loads((tmp_path / "jobs" / "scaled" / "config.json").read_text())["settings"]
    assert settings["agent_timeout_multiplier"] == 3 and settings["verifier_timeout_multiplier"] == 3


@pytest.mark.parametrize("flag", ["--verifier-mode", "--verifier-env"])
def test_the_verifier_mode_and_its_old_spelling(tmp_path, flag):
    r = run(str(EXAMPLES / "c-word-count"), "--agent", "oracle", flag, "separate", "-o", str(tmp_path),
            "--job-name", "j")
    assert r.returncode == 0, r.stderr
    assert ("deprecated" in r.stderr) == (flag == "--verifier-env")
    assert trials(tmp_path / "j")[0]["verifier_environment_mode"] == "separate"


@pytest.mark.parametrize("bad", [["-k", "0"], ["-r", "-1"], ["--timeout-multiplier", "nan"], ["--env-file", "/nope"]])
def test_bad_values_are_exit_2_naming_them(tmp_path, bad):
    r = run(str(EXAMPLES / "c-word-count"), "--agent", "nop", *bad, "-o", str(tmp_path))
    assert r.returncode == 2 and bad[1] in r.stderr and "Traceback" not in r.stderr


def test_a_harbor_dataset_name_says_how_to_get_the_tasks(tmp_path):
    r = run("terminal-bench@2.0", "--agent", "nop", "-o", str(tmp_path), cwd=tmp_path)
    assert r.returncode == 2 and "harbor datasets download terminal-bench@2.0" in r.stderr


def test_agent_kwargs_reach_the_agents_constructor_and_the_jobs_config(tmp_path):
    (tmp_path / "flaky_agent.py").write_text(FLAKY)
    env = {"PYTHONPATH": f"{SRC}:{tmp_path}"}
    r = run(str(EXAMPLES / "c-word-count"), "--agent", "flaky_agent:Configured", "--ak", "temperature=0.5",
            "--agent-kwarg", "model=acme/x", "--ak", 'tools=["bash", "edit"]', "-o", str(tmp_path / "jobs"),
            "--job-name", "kw", env=env)
    assert r.returncode == 0, r.stderr
    seen = json.loads(next((tmp_path / "jobs" / "kw").glob("c-word-count__*/agent/seen.json")).read_text())
    assert seen == {"temperature": 0.5, "model": "acme/x", "tools": ["bash", "edit"]}
    config = json.loads((tmp_path / "jobs" / "kw" / "config.json").read_text())
    assert config["agents"][0]["kwargs"] == seen
    for bad, said in ((["--ak", "nonsense=1"], "nonsense"), (["--ak", "no-equals"], "KEY=VALUE")):
        r = run(str(EXAMPLES / "c-word-count"), "--agent", "flaky_agent:Configured", *bad, "-o", str(tmp_path),
                env=env)
        assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr
    r = run(str(EXAMPLES / "c-word-count"), "--agent", "oracle", "--ak", "x=1", "-o", str(tmp_path))
    assert r.returncode == 2 and "takes no --agent-kwarg" in r.stderr


def test_dry_run_prints_the_plan_and_makes_nothing(tmp_path):
    out = tmp_path / "jobs"
    r = run(str(EXAMPLES), "--agent", "oracle", "--dry-run", "-k", "3", "-x", "python-*", "--image-source", "host",
            "-o", str(out))
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    for name in ("c-word-count", "http-kv-server", "pinned-pytest", "workspace-git-free"):
        assert name in text
    assert "python-csv-stats" not in text and "4 task(s), 12 trial(s)" in text
    assert "the host's system" in text and "uncalibrated" in text and "nothing fetched, built, run or written" in text
    assert not out.exists()
    r = run(str(EXAMPLES), "--agent", "oracle", "--dry-run", "--image-source", "dockerfile", "-o", str(out))
    assert r.returncode == 0 and "its Dockerfile" in r.stdout and not out.exists()
    r = run(str(EXAMPLES), "--agent", "no_such_module:Agent", "--dry-run", "-o", str(out))
    assert r.returncode == 2 and not out.exists()


def test_resume_keeps_the_finished_trials_and_runs_the_rest(tmp_path):
    jobs = tmp_path / "jobs"
    r = run(str(EXAMPLES), "--agent", "oracle", "-i", "c-word-count", "-i", "python-csv-stats",
            "-i", "workspace-git-free", "-k", "2", "--image-source", "host", "-o", str(jobs), "--job-name", "j")
    assert r.returncode == 0, r.stderr
    job = jobs / "j"
    before = {t["trial_name"]: t for t in trials(job)}
    assert len(before) == 6
    by_task: dict[str, list[str]] = {}
    for name, t in sorted(before.items()):
        by_task.setdefault(t["task_name"], []).append(name)
    cut = by_task["c-word-count"][0]
    (job / cut / "result.json").unlink()  # cut off mid-run: its folder is run again
    never = by_task["python-csv-stats"]
    import shutil
    for name in never:  # never started
        shutil.rmtree(job / name)
    kept = by_task["workspace-git-free"] + by_task["c-word-count"][1:]
    r = run("--resume", str(job))
    assert r.returncode == 0, r.stderr
    assert "3 finished trial(s) kept, 1 cut off and run again, 3 to run" in " ".join(r.stderr.split())
    after = {t["trial_name"]: t for t in trials(job)}
    assert len(after) == 6 and not (job / cut).exists()
    assert sorted(t["task_name"] for t in after.values()) == sorted(t["task_name"] for t in before.values())
    for name in kept:
        assert after[name]["id"] == before[name]["id"]  # kept as they were, not run again
    assert all(t["verifier_result"]["rewards"] == {"reward": 1.0} for t in after.values())
    result = json.loads((job / "result.json").read_text())
    assert result["n_total_trials"] == 6 and result["stats"]["n_completed_trials"] == 6
    # A flag that says otherwise than the stored configuration, or a folder that is no job, is exit 2.
    for flags, said in ((["--agent", "nop"], "--agent 'nop'"), (["-k", "3"], "--n-attempts 3"),
                        (["--timeout-multiplier", "2"], "--agent-timeout-multiplier 2.0"),
                        ([str(EXAMPLES)], "takes no TASK_DIR")):
        r = run("--resume", str(job), *flags)
        assert r.returncode == 2 and said in r.stderr, (flags, r.stderr)
    assert run("--resume", str(job), "--agent", "oracle").returncode == 0  # the same value is no contradiction
    r = run("--resume", str(tmp_path))
    assert r.returncode == 2 and "no config.json" in r.stderr
    r = run("--agent", "oracle")
    assert r.returncode == 2 and "needs TASK_DIR|TASKS_DIR" in r.stderr
