"""An agent Harbor installs into the environment runs inside the episode against a model
API on the host's loopback, through Harbor's own CLI:

    harbor run -p TASK -a pip_mini_swe_agent:PipMiniSweAgent -m openai/mock --base-url http://localhost:PORT/v1
        -e sequester.harbor:SequesterEnvironment --verifier sequester.harbor:SequesterVerifier
        --ek allow_hosts='["localhost:PORT"]' --allow-agent-host pypi.org --allow-agent-host files.pythonhosted.org

The agent is Harbor's own mini-swe-agent adapter with only its installation replaced (pip
from PyPI into a venv of the episode's Python: tests/helpers/pip_mini_swe_agent.py; Harbor's
own fetches uv from astral.sh and a Python from GitHub). The model is a scripted
OpenAI-compatible server this test runs on 127.0.0.1 (tests/helpers/model_mock.py): the task
has no network of its own, so the agent reaches it only through the operator's
``localhost:PORT`` (relayed to the host's loopback), and PyPI only through Harbor's
``--allow-agent-host`` (the agent's phase: its installation and its run). The mock's
commands solve the task in one job (reward 1.0) and do not in another (0.0); a third,
without the ``localhost:PORT`` entry, never reaches the mock. The jobs run at once. The
only destinations off this machine are PyPI's.
"""

from __future__ import annotations

import json
import secrets
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import harbor_venv
import pytest
from model_mock import SUBMIT, ModelMock, model_mock
from paths import EXAMPLES, HELPERS

pytestmark = pytest.mark.slow

TASK = EXAMPLES / "python-csv-stats"  # no network of its own (allow_internet = false)
AGENT = "pip_mini_swe_agent:PipMiniSweAgent"
VERSION = "2.4.6"  # mini-swe-agent, the newest on PyPI on 2026-12-07 (Harbor's --ak version pins it)
KEY = f"sk-mock-{secrets.token_hex(8)}"  # Harbor hands it to the agent; the mock sees it come back
SOLVE = f"bash <<'SOLVE_EOF'\n{(TASK / 'solution' / 'solve.sh').read_text()}\nSOLVE_EOF"
WRONG = "echo '{\"rows\": 0, \"columns\": {}}' > /app/report.json && cat /app/report.json"


def harbor_run(python: str, out: Path, job: str, mock: ModelMock, listed: bool) -> subprocess.CompletedProcess[str]:
    env = harbor_venv.harbor_env(OPENAI_API_KEY=KEY)
    env["PYTHONPATH"] = f"{env['PYTHONPATH']}:{HELPERS}"
    args = [
        str(Path(python).parent / "harbor"), "run", "-p", str(TASK), "-a", AGENT, "--ak", f"version={VERSION}",
        "-m", "openai/mock", "--base-url", mock.base_url,
        "-e", "sequester.harbor:SequesterEnvironment", "--verifier", "sequester.harbor:SequesterVerifier",
        # PyPI by Harbor's own option for the agent's phase; unlisted: by sequester's, and no loopback entry
        *(["--ek", f'allow_hosts=["localhost:{mock.port}"]', "--allow-agent-host", "pypi.org",
           "--allow-agent-host", "files.pythonhosted.org"] if listed else
          ["--ek", 'allow_hosts=["pypi.org", "files.pythonhosted.org"]']),
        "--ae", "LITELLM_LOCAL_MODEL_COST_MAP=True",  # (litellm would fetch its price list from GitHub)
        "--ae", "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT=2",  # (a model it cannot reach: two tries, not ten)
        "-o", str(out), "--job-name", job, "-y",
    ]
    return subprocess.run(args, capture_output=True, text=True, timeout=1800, env=env, stdin=subprocess.DEVNULL)


def trial_of(out: Path, job: str) -> dict:
    [trial] = [p for p in (out / job).iterdir() if p.is_dir()]
    result = json.loads((trial / "result.json").read_text())
    return {"dir": trial, "result": result}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    python = harbor_venv.harbor_python()  # (skips without a Python >= 3.12)
    out = tmp_path_factory.mktemp("harbor-installed-agent")
    with model_mock([SOLVE, SUBMIT]) as solver, model_mock([WRONG, SUBMIT]) as wrong, \
            model_mock([SOLVE, SUBMIT]) as unlisted:
        mocks = {"solves": solver, "wrong": wrong, "unlisted": unlisted}
        with ThreadPoolExecutor(len(mocks)) as pool:
            runs = {job: pool.submit(harbor_run, python, out, job, mock, job != "unlisted")
                    for job, mock in mocks.items()}
            done = {job: run.result() for job, run in runs.items()}
        requests = {job: list(mock.requests) for job, mock in mocks.items()}
    for job, r in done.items():
        assert r.returncode == 0, f"{job}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return {job: {**trial_of(out, job), "requests": requests[job]} for job in done}


def completions(job: dict) -> list[dict]:
    return [r for r in job["requests"] if r["path"] == "/v1/chat/completions"]


def header(request: dict, name: str) -> str | None:
    return next((v for k, v in request["headers"].items() if k.lower() == name.lower()), None)


@pytest.mark.parametrize(("job", "reward"), [("solves", 1.0), ("wrong", 0.0)])
def test_the_installed_agent_scores_what_the_models_commands_earn(jobs, job, reward):
    result = jobs[job]["result"]
    assert result["exception_info"] is None, result["exception_info"]
    assert result["verifier_result"]["rewards"] == {"reward": reward}
    assert result["agent_info"]["name"] == "mini-swe-agent"
    assert result["agent_info"]["version"] == VERSION  # what pip installed in the episode's venv says


@pytest.mark.parametrize("job", ["solves", "wrong"])
def test_the_agent_inside_reached_the_loopback_mock_through_the_allowlist(jobs, job):
    asked = completions(jobs[job])
    assert len(asked) >= 2, jobs[job]["requests"]  # the command, then the submission
    first, second = asked[0], asked[1]
    assert first["body"]["model"] == "mock"  # Harbor's openai/mock, through litellm's openai provider
    assert [t["function"]["name"] for t in first["body"]["tools"]] == ["bash"]
    assert header(first, "Authorization") == f"Bearer {KEY}"  # Harbor's key handling, inside
    assert header(first, "X-Session-ID") is not None  # Harbor's run command's session header
    assert "Per-column statistics for a CSV file" in json.dumps(first["body"]["messages"])  # the task's instruction
    # the second turn carries what the first command printed in the episode (mini's observation: JSON)
    [observed] = [m for m in second["body"]["messages"] if m.get("role") == "tool"]
    observation = json.loads(observed["content"])
    printed = '{"rows": 24, "columns": {"temp_c": ' if job == "solves" else '{"rows": 0, "columns": {}}'
    assert observation["returncode"] == 0 and observation["output"].startswith(printed), observation


def test_the_agent_submitted_and_harbor_converted_its_trajectory(jobs):
    agent = jobs["solves"]["dir"] / "agent"
    native = json.loads((agent / "mini-swe-agent.trajectory.json").read_text())
    assert native["info"]["exit_status"] == "Submitted"
    assert native["info"]["mini_version"] == VERSION
    atif = json.loads((agent / "trajectory.json").read_text())  # Harbor's own conversion (ATIF)
    assert any(step.get("tool_calls") for step in atif["steps"])
    record = json.loads((jobs["solves"]["dir"] / "verifier" / "sequester.json").read_text())
    assert record["rewards"] == {"reward": 1.0}


def test_without_the_loopback_entry_the_mock_is_out_of_reach(jobs):
    """The same run without the ``localhost:PORT`` entry (PyPI named in ``--ek allow_hosts``
    instead of ``--allow-agent-host``, so Harbor adds the model's host to the agent's
    allowlist itself): Harbor names it without its port (``localhost``), which the episode
    leaves out, saying so; the agent's requests never leave the episode, and the commands
    that would solve the task never come."""
    job = jobs["unlisted"]
    assert job["requests"] == []
    result = job["result"]
    assert result["agent_info"]["version"] == VERSION  # (installed: PyPI was reachable, by sequester's option)
    assert result["exception_info"]["exception_type"] == "NetworkConnectionError"  # (Harbor's name for the agent's end)
    assert result["verifier_result"]["rewards"] == {"reward": 0.0}
    log = (job["dir"] / "trial.log").read_text()
    assert ("Harbor's allowlist: 'localhost' is the host's loopback: reachable only as HOST:PORT; left out of the "
            "agent's phase (to open one service of it, name that HOST:PORT in --ek allow_hosts)") in log
    said = (job["dir"] / "agent" / "mini-swe-agent.txt").read_text()
    assert "Connection" in said or "connect" in said, said[-3000:]
