"""sequester inside Harbor 0.26, through Harbor's own CLI (``harbor run -e
sequester.harbor:SequesterEnvironment --verifier sequester.harbor:SequesterVerifier``).

A Python >= 3.12 venv with Harbor from PyPI (:mod:`harbor_venv`) runs the real ``harbor``
command on the example tasks: the oracle scores 1.0 and nop 0.0 on every one, the oracle's
``solve.sh`` output lands in ``/logs/agent/oracle.txt`` (the agent's to write) and comes back
to the trial folder, Harbor's viewer serves the jobs, and an agent of Harbor's that forges
a reward in ``/logs/verifier`` and rewrites the tests (what Harbor's own verifier would
read in the agent's container) still scores 0.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import harbor_venv
import pytest
from paths import EXAMPLES

pytestmark = pytest.mark.slow

TASK_NAMES = sorted(p.name for p in EXAMPLES.iterdir() if (p / "task.toml").is_file())
PLUGIN = ["-e", "sequester.harbor:SequesterEnvironment", "--verifier", "sequester.harbor:SequesterVerifier"]

# A Harbor agent that cheats where Harbor's own verifier would look: a reward in
# /logs/verifier, a test script of its own in /tests, a pytest that always passes.
FORGER = textwrap.dedent('''
    from harbor.agents.base import BaseAgent

    class Forger(BaseAgent):
        @staticmethod
        def name():
            return "forger"

        def version(self):
            return "1"

        async def setup(self, environment):
            pass

        async def run(self, instruction, environment, context):
            for command in (
                "mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt",
                "echo '{\\"reward\\": 1}' > /logs/verifier/reward.json",
                "mkdir -p /tests && printf '#!/bin/sh\\\\necho 1 > /logs/verifier/reward.txt\\\\n' > /tests/test.sh",
                "printf 'import sys\\\\nsys.exit(0)\\\\n' > pytest.py",
                "echo forged > /logs/agent/forger.txt",
            ):
                await environment.exec(command)
''')

# Runs in Harbor's venv: its models read each job, its viewer's app serves them.
CHECK = textwrap.dedent('''
    import json, sys
    from pathlib import Path
    from fastapi.testclient import TestClient
    from harbor.models.trial.result import TrialResult
    from harbor.viewer.server import create_app

    jobs = Path(sys.argv[1])
    out = {"trials": {}, "api": {}}
    for job in sorted(p for p in jobs.iterdir() if p.is_dir()):
        for trial in sorted(p for p in job.iterdir() if p.is_dir()):
            r = TrialResult.model_validate_json((trial / "result.json").read_text())
            out["trials"].setdefault(job.name, {})[r.task_name] = {
                "dir": str(trial),
                "rewards": r.verifier_result.rewards if r.verifier_result else None,
                "exception": r.exception_info.exception_type if r.exception_info else None,
                "message": r.exception_info.exception_message if r.exception_info else None}
    with TestClient(create_app(jobs, mode="jobs")) as client:
        for job in out["trials"]:
            response = client.get(f"/api/jobs/{job}/trials")
            assert response.status_code == 200, response.text
            out["api"][job] = sorted(t["task_name"] for t in response.json()["items"])
    print(json.dumps(out))
''')


def harbor(python: str, *args: str, extra_path: str = "") -> subprocess.CompletedProcess[str]:
    env = harbor_venv.harbor_env()
    if extra_path:
        env["PYTHONPATH"] = f"{env['PYTHONPATH']}:{extra_path}"
    return subprocess.run([str(Path(python).parent / "harbor"), *args], capture_output=True, text=True,
                          timeout=1800, env=env, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    python = harbor_venv.harbor_python()
    out = tmp_path_factory.mktemp("harbor-jobs")
    for agent in ("oracle", "nop"):
        r = harbor(python, "run", "-p", str(EXAMPLES), "-a", agent, *PLUGIN, "-o", str(out), "--job-name", agent,
                   "-n", "2", "-y")
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    agents = tmp_path_factory.mktemp("harbor-agent")
    (agents / "forger_agent.py").write_text(FORGER)
    r = harbor(python, "run", "-p", str(EXAMPLES / "c-word-count"), "-a", "forger_agent:Forger", *PLUGIN,
               "-o", str(out), "--job-name", "forger", "-y", extra_path=str(agents))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    check = subprocess.run([python, "-c", CHECK, str(out)], capture_output=True, text=True, timeout=300,
                           env=harbor_venv.harbor_env())
    assert check.returncode == 0, check.stderr[-5000:]
    return json.loads(check.stdout)


def test_the_oracle_scores_full_marks_and_nop_zero_on_every_example(jobs):
    for agent, reward in (("oracle", 1.0), ("nop", 0.0)):
        trials = jobs["trials"][agent]
        assert sorted(trials) == TASK_NAMES
        for name, trial in trials.items():
            assert trial["exception"] is None, (agent, name, trial["message"])
            assert trial["rewards"] == {"reward": reward}, (agent, name)
        assert jobs["api"][agent] == TASK_NAMES  # what `harbor view` lists


def test_the_oracles_log_is_written_in_the_episode_and_kept(jobs):
    for name, trial in jobs["trials"]["oracle"].items():
        log = Path(trial["dir"]) / "agent" / "oracle.txt"
        assert log.is_file(), name  # Harbor's oracle redirects solve.sh into /logs/agent/oracle.txt


def test_sequesters_verdict_is_kept_beside_harbors(jobs):
    trial = Path(jobs["trials"]["oracle"]["c-word-count"]["dir"])
    record = json.loads((trial / "verifier" / "sequester.json").read_text())
    assert record["rewards"] == {"reward": 1.0} and record["calibration"]["state"] in ("uncalibrated", "calibrated")
    assert (trial / "verifier" / "reward.txt").read_text().strip() == "1"
    assert (trial / "verifier" / "test-stdout.txt").is_file()


def test_a_forged_reward_and_rewritten_tests_score_zero(jobs):
    trial = jobs["trials"]["forger"]["c-word-count"]
    assert trial["exception"] is None, trial["message"]
    assert trial["rewards"] == {"reward": 0.0}  # Harbor's own verifier would read the forged 1
    assert (Path(trial["dir"]) / "agent" / "forger.txt").read_text().strip() == "forged"


def test_the_retry_policys_default_exclusions_are_harbors():
    from sequester.jobs.retry import HARBOR_DEFAULT_EXCLUSIONS

    python = harbor_venv.harbor_python()
    r = subprocess.run([python, "-c", "import json; from harbor.models.trial.error_policy import "
                        "default_retry_exclusions as d; print(json.dumps(sorted(d())))"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert set(json.loads(r.stdout)) == HARBOR_DEFAULT_EXCLUSIONS
