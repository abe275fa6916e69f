"""Jobs (:mod:`sequester.jobs.job`) and ``sequester run``: real episodes on the example tasks, no mocks of sequester's parts."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from paths import EXAMPLES

from sequester import __version__ as SEQUESTER_VERSION
from sequester.jobs import JobPaths, TrialPaths, run_job

from conditions import requires_root, visible_tempdir

pytestmark = requires_root

TASK_NAMES = sorted(p.name for p in EXAMPLES.iterdir() if (p / "task.toml").is_file())


def sequester(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sequester.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def flat(text: str) -> str:
    """Console output with rich's line wrapping undone."""
    return " ".join(text.split())


def tree_hashes(root: Path) -> dict[str, str]:
    """Every file and symlink under ``root``, with its content hash and mode."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = "link:" + os.readlink(path)
        elif path.is_file():
            out[rel] = f"{hashlib.sha256(path.read_bytes()).hexdigest()} {path.stat().st_mode:o}"
        else:
            out[rel] = f"dir {path.stat().st_mode:o}"
    return out


def trial_results(job_dir: Path) -> dict[str, dict]:
    """task name -> the trial's result.json."""
    job = json.loads(JobPaths(job_dir).result_path.read_text())
    results = [json.loads(TrialPaths(job_dir / name).result_path.read_text()) for name in job["trials"]]
    return {r["task_name"]: r for r in results}


def broken_task(tmp_path: Path, test_sh: str, name: str = "no-reward") -> Path:
    """A copy of python-csv-stats whose tests/test.sh is ``test_sh``."""
    task = tmp_path / "tasks" / name
    shutil.copytree(EXAMPLES / "python-csv-stats", task)
    (task / "tests" / "test.sh").write_text(test_sh)
    return task


@pytest.fixture(scope="module")
def oracle_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, dict[str, str], dict[str, str]]:
    """The oracle on every example, one at a time; the examples' hashes before and after."""
    before = tree_hashes(EXAMPLES)
    seen = []
    jobs = tmp_path_factory.mktemp("jobs")
    result = run_job([EXAMPLES], "oracle", jobs_dir=jobs, job_name="oracle", concurrency=1, progress=seen.append)
    assert [r.trial_name for r in seen] == result.trials
    return jobs / "oracle", result, before, tree_hashes(EXAMPLES)


@pytest.mark.slow
def test_oracle_scores_one_on_every_example(oracle_job):
    job_dir, result, _, _ = oracle_job
    assert (result.n_total_trials, result.n_trials, result.n_errors) == (len(TASK_NAMES), len(TASK_NAMES), 0)
    assert result.mean_reward == 1.0 and result.reward_counts == {"1.0": len(TASK_NAMES)}
    on_disk = json.loads((job_dir / "result.json").read_text())
    assert on_disk == result.to_dict()
    assert on_disk["finished_at"] and on_disk["errors"] == []
    assert sorted(name.split("__")[0] for name in on_disk["trials"]) == TASK_NAMES
    config = json.loads((job_dir / "config.json").read_text())
    assert config["agents"] == [{"name": "oracle"}] and config["n_concurrent_trials"] == 1
    assert config["datasets"] == [{"path": str(EXAMPLES)}] and config["tasks"] == []  # one folder of tasks
    assert config["task_names"] == TASK_NAMES and config["agent_spec"] == "oracle"
    assert on_disk["id"] and on_disk["stats"]["n_completed_trials"] == len(TASK_NAMES)
    assert on_disk["stats"]["evals"]["oracle__tasks"]["metrics"] == [{"mean": 1.0}]


@pytest.mark.slow
def test_every_trial_folder_holds_its_record(oracle_job):
    job_dir, result, _, _ = oracle_job
    for name in result.trials:
        paths = TrialPaths(job_dir / name)
        trial = json.loads(paths.result_path.read_text())
        assert trial["trial_name"] == name and name.startswith(trial["task_name"] + "__")
        assert re.fullmatch(r"[a-z0-9]{6}", name.split("__")[1])
        assert trial["verifier_result"] == {"rewards": {"reward": 1.0}} and trial["exception_info"] is None
        assert trial["agent_info"] == {"name": "oracle", "version": SEQUESTER_VERSION, "model_info": None}
        assert trial["source"] == "tasks" and trial["task_id"] == {"path": str(EXAMPLES / trial["task_name"])}
        assert len(trial["task_checksum"]) == 64 and trial["id"] and trial["verifier_environment_mode"] == "shared"
        assert trial["config"] == json.loads(paths.config_path.read_text())
        assert trial["config"]["task"] == {"path": trial["task_id"]["path"], "source": "tasks"}
        assert trial["config"]["agent"] == {"name": "oracle"}
        assert trial["tampering"] == [] and isinstance(trial["notes"], list)
        for phase in ("environment_setup", "agent_execution", "verifier"):
            assert trial[phase]["started_at"] <= trial[phase]["finished_at"]
        assert trial["started_at"] <= trial["environment_setup"]["started_at"] <= trial["verifier"]["finished_at"]
        assert trial["trial_uri"] == paths.root.as_uri()
        assert paths.test_stdout_path.stat().st_size > 0
        assert paths.verifier_file("reward.txt").read_text().strip() == "1"
        commands = [json.loads(line) for line in paths.commands_path.read_text().splitlines()]
        assert [c["command"] for c in commands] == ["bash /solution/solve.sh"]
        assert commands[0]["exit_code"] == 0 and commands[0]["timed_out"] is False
        assert set(commands[0]) >= {"command", "timeout", "stdout", "stderr", "exit_code", "timed_out", "duration"}
        assert "$ bash /solution/solve.sh" in paths.agent_log_path.read_text()
        command_dir = paths.command_dir(0)  # Harbor's layout, which its viewer reads
        assert (command_dir / "command.txt").read_text() == "bash /solution/solve.sh"
        assert (command_dir / "stdout.txt").read_text() == commands[0]["stdout"]
        assert (command_dir / "stderr.txt").read_text() == commands[0]["stderr"]
        assert (command_dir / "return-code.txt").read_text() == "0\n" and not paths.command_dir(1).exists()
        assert "verifier: ended" in paths.trial_log_path.read_text()
    pinned = next(n for n in result.trials if n.startswith("pinned-pytest__"))
    assert json.loads(TrialPaths(job_dir / pinned).verifier_file("ctrf.json").read_text())


@pytest.mark.slow
def test_source_tasks_are_byte_identical_after_a_job(oracle_job):
    _, _, before, after = oracle_job
    assert before == after and len(before) > 20


@pytest.mark.slow
def test_concurrent_trials_give_the_same_rewards(oracle_job, tmp_path):
    _, serial, _, _ = oracle_job
    before = tree_hashes(EXAMPLES)
    result = run_job([EXAMPLES], "oracle", jobs_dir=tmp_path, job_name="parallel", concurrency=3)
    assert (result.n_trials, result.n_errors, result.reward_counts) == (serial.n_trials, 0, serial.reward_counts)
    serial_rewards = {t: r["verifier_result"]["rewards"] for t, r in trial_results(oracle_job[0]).items()}
    parallel_rewards = {t: r["verifier_result"]["rewards"] for t, r in trial_results(tmp_path / "parallel").items()}
    assert parallel_rewards == serial_rewards
    assert tree_hashes(EXAMPLES) == before


@pytest.mark.slow
def test_cli_nop_scores_zero_and_exits_0(tmp_path):
    r = sequester("run", str(EXAMPLES), "--agent", "nop", "-n", "3", "-o", str(tmp_path), "--job-name", "nop")
    assert r.returncode == 0, r.stderr
    job = json.loads((tmp_path / "nop" / "result.json").read_text())
    assert (job["n_trials"], job["n_errors"], job["mean_reward"]) == (len(TASK_NAMES), 0, 0.0)
    assert job["reward_counts"] == {"0.0": len(TASK_NAMES)}
    assert all(r["verifier_result"]["rewards"]["reward"] == 0.0 for r in trial_results(tmp_path / "nop").values())
    assert all(TrialPaths(tmp_path / "nop" / n).commands_path.read_text() == "" for n in job["trials"])
    assert "mean reward 0.000" in flat(r.stdout) and str(tmp_path / "nop") in r.stdout.replace("\n", "")
    for name in TASK_NAMES:
        assert name in r.stdout


def test_cli_default_job_dir_and_name(tmp_path):
    task = EXAMPLES / "python-csv-stats"
    r = sequester("run", str(task), "--agent", "oracle", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    (job_dir,) = (tmp_path / "jobs").iterdir()
    assert len(job_dir.name) == len("YYYY-MM-DD__HH-MM-SS") and job_dir.name[4] == "-" and "__" in job_dir.name
    assert json.loads((job_dir / "result.json").read_text())["mean_reward"] == 1.0


def test_no_reward_file_is_the_agents_zero_and_keeps_the_output(tmp_path):
    """Trainers drop errors: a run the agent could have cut short is its 0, with the reason."""
    task = broken_task(tmp_path, "#!/bin/bash\necho 'ran the tests, wrote nothing'\nexit 0\n")
    r = sequester("run", str(task), "--agent", "oracle", "-o", str(tmp_path / "jobs"), "--job-name", "j")
    assert r.returncode == 0, r.stderr
    job = json.loads((tmp_path / "jobs" / "j" / "result.json").read_text())
    assert (job["n_trials"], job["n_errors"], job["mean_reward"]) == (1, 0, 0.0)
    trial = json.loads(TrialPaths(tmp_path / "jobs" / "j" / job["trials"][0]).result_path.read_text())
    assert trial["verifier_result"]["rewards"] == {"reward": 0.0} and trial["exception_info"] is None
    assert any("reward 0 for the agent" in n and "neither" in n for n in trial["notes"]), trial["notes"]
    assert trial["verifier"]["started_at"] and trial["verifier"]["finished_at"]
    out = TrialPaths(tmp_path / "jobs" / "j" / job["trials"][0]).test_stdout_path.read_text()
    assert "ran the tests, wrote nothing" in out


def test_existing_job_name_exits_2(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    r = sequester("run", str(EXAMPLES / "python-csv-stats"), "--agent", "nop", "-o", str(tmp_path),
                  "--job-name", "taken")
    assert r.returncode == 2
    assert "'taken'" in flat(r.stderr) and "already exists" in flat(r.stderr)
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["keep.txt"]


def test_bad_agent_spec_exits_2_naming_it(tmp_path):
    for spec in ("no_such_module_xyz:Agent", "gpt", "script:/nonexistent/agent.sh"):
        r = sequester("run", str(EXAMPLES / "python-csv-stats"), "--agent", spec, "-o", str(tmp_path))
        assert r.returncode == 2 and repr(spec) in flat(r.stderr), (spec, r.stderr)
    assert not any(tmp_path.iterdir())  # nothing was made


def test_bad_task_exits_2_naming_the_file(tmp_path):
    task = broken_task(tmp_path, "")
    (task / "instruction.md").write_text("   \n")
    r = sequester("run", str(task), "--agent", "nop", "-o", str(tmp_path / "jobs"))
    assert r.returncode == 2 and "instruction.md: empty" in flat(r.stderr)
    r = sequester("run", str(tmp_path / "nowhere"), "--agent", "nop", "-o", str(tmp_path / "jobs"))
    assert r.returncode == 2 and "does not exist" in flat(r.stderr)
    (task / "instruction.md").write_text("Do it.\n")
    toml = task / "task.toml"
    toml.write_text(toml.read_text().replace("timeout_sec = 60.0", 'timeout_sec = "abc"'))
    r = sequester("run", str(task), "--agent", "nop", "-o", str(tmp_path / "jobs"))
    assert r.returncode == 2 and "[verifier] timeout_sec: 'abc'" in flat(r.stderr)
    assert not (tmp_path / "jobs").exists()


@pytest.mark.slow
def test_config_file_and_flags_set_the_episode_settings(tmp_path):
    config = tmp_path / "episodes.toml"
    config.write_text('[episodes]\nexec_timeout = 45\nverifier_env = "separate"\n')
    r = sequester("run", str(EXAMPLES / "python-csv-stats"), "--agent", "oracle", "--config", str(config),
                  "--freeze-agent", "-o", str(tmp_path), "--job-name", "c")
    assert r.returncode == 0, r.stderr
    (trial,) = trial_results(tmp_path / "c").values()
    settings = json.loads(TrialPaths(tmp_path / "c" / trial["trial_name"]).config_path.read_text())["settings"]
    assert (settings["exec_timeout"], settings["verifier_env"], settings["freeze_agent"]) == (45, "separate", True)
    assert json.loads((tmp_path / "c" / "config.json").read_text())["settings"] == settings
    assert trial["verifier_result"]["rewards"] == {"reward": 1.0}  # separate: its working directory was copied
    assert any("its working directory /app was copied" in n for n in trial["notes"]), trial["notes"]
    assert any("separate environment" in n for n in trial["notes"]), trial["notes"]
    for bad, said in (('verifier_env = "sometimes"', "episodes.verifier_env: 'sometimes'"),
                      ('on_tamper = "zero"', "episodes.on_tamper was removed")):
        config.write_text(f'[episodes]\n{bad}\n')
        r = sequester("run", str(EXAMPLES / "python-csv-stats"), "--agent", "oracle", "--config", str(config),
                      "-o", str(tmp_path))
        assert r.returncode == 2 and said in flat(r.stderr), r.stderr


def test_script_agent_is_recorded(tmp_path):
    script = tmp_path / "agent.sh"
    solve = (EXAMPLES / "python-csv-stats" / "solution" / "solve.sh").read_text()
    script.write_text(solve + "\necho marker-from-the-agent > /app/agent-was-here.txt\n")
    r = sequester("run", str(EXAMPLES / "python-csv-stats"), "--agent", f"script:{script}", "-o", str(tmp_path),
                  "--job-name", "s")
    assert r.returncode == 0, r.stderr
    (trial,) = trial_results(tmp_path / "s").values()
    assert trial["verifier_result"]["rewards"] == {"reward": 1.0}
    assert trial["agent_info"]["name"] == f"script:{script}" and trial["source"] is None  # a task by itself
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    assert config["datasets"] == [] and config["tasks"] == [{"path": str(EXAMPLES / "python-csv-stats"), "source": None}]
    paths = TrialPaths(tmp_path / "s" / trial["trial_name"])
    (command,) = [json.loads(line) for line in paths.commands_path.read_text().splitlines()]
    assert command["command"] == script.read_text() and command["exit_code"] == 0
    assert '"rows": 24' in command["stdout"] and command["timeout"] == 600


def test_tampering_is_reported_and_the_verdict_is_the_tests(tmp_path):
    script = tmp_path / "agent.sh"
    solve = (EXAMPLES / "python-csv-stats" / "solution" / "solve.sh").read_text()
    script.write_text(solve + "\necho 'export X=1' > /etc/profile.d/zz-agent.sh\n")
    r = sequester("run", str(EXAMPLES / "python-csv-stats"), "--agent", f"script:{script}", "-o", str(tmp_path),
                  "--job-name", "t", "--exec-timeout", "30")
    assert r.returncode == 0, r.stderr
    (trial,) = trial_results(tmp_path / "t").values()
    assert trial["verifier_result"]["rewards"]["reward"] == 1.0
    assert any("profile.d/zz-agent.sh" in t for t in trial["tampering"]), trial["tampering"]
    assert f"! {len(trial['tampering'])}" in r.stdout
    # a hack that scores 1.0 is counted in the summary line and in the job's result.json
    assert "mean reward 1.000" in flat(r.stdout) and "1 with tampering" in flat(r.stdout)
    job = json.loads((tmp_path / "t" / "result.json").read_text())
    assert (job["n_tampered"], job["tampered"]) == (1, [trial["trial_name"]])


def test_agent_cannot_run_the_verifier(tmp_path):
    (tmp_path / "peek_agent.py").write_text(
        "class Peek:\n"
        "    name = 'peek'\n"
        "    def run(self, instruction, episode):\n"
        "        episode.exec('true')\n"
        "        episode.evaluate()\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "sequester.cli", "run", str(EXAMPLES / "python-csv-stats"),
                        "--agent", "peek_agent:Peek", "-o", str(tmp_path / "jobs"), "--job-name", "p"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1, r.stderr
    (trial,) = trial_results(tmp_path / "jobs" / "p").values()
    assert trial["exception_info"]["exception_type"] == "EpisodeError"  # no Harbor name: its own, and a policy
    assert trial["exception_info"]["sequester_exception_type"] == "EpisodeError"
    assert trial["exception_info"]["policy_override"] == {"should_retry": False, "should_grade": False,
                                                          "has_valid_reward": False}
    assert "verifier" in trial["exception_info"]["exception_message"]
    assert trial["verifier"] == {"started_at": None, "finished_at": None}


def test_interrupt_stops_trials_and_writes_the_results(tmp_path):
    script = tmp_path / "agent.sh"
    script.write_text("sleep 100\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sequester.cli", "run", str(EXAMPLES), "--agent", f"script:{script}", "-n", "2",
         "-o", str(tmp_path), "--job-name", "i"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 30
    while sum("sleep 100" in p.read_text() for p in tmp_path.glob("i/*/agent/agent.log")) < 2:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    started = time.monotonic()
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and time.monotonic() - started < 10, err
    assert "interrupted" in err
    job = json.loads((tmp_path / "i" / "result.json").read_text())
    assert job["finished_at"] and job["n_total_trials"] == len(TASK_NAMES) and job["n_trials"] == 2
    assert [e["exception_type"] for e in job["errors"]] == ["CancelledError"] * 2  # Harbor's name
    assert [e["sequester_exception_type"] for e in job["errors"]] == ["TrialCancelled"] * 2
    assert (job["stats"]["n_cancelled_trials"], job["stats"]["n_errored_trials"]) == (2, 2)
    assert job["stats"]["n_completed_trials"] + job["stats"]["n_pending_trials"] == len(TASK_NAMES)
    for name in job["trials"]:
        assert json.loads(TrialPaths(tmp_path / "i" / name).result_path.read_text())["exception_info"]


def test_agents_see_no_other_task_and_no_job_output(tmp_path):
    """Where episodes would show them, with a visible control file next to them."""
    base = visible_tempdir("jobs")
    try:
        base.chmod(0o755)
        for name in ("c-word-count", "python-csv-stats"):
            shutil.copytree(EXAMPLES / name, base / "tasks" / name)
        (base / "control.txt").write_text("control-visible\n")
        (base / "jobs" / "earlier").mkdir(parents=True)
        (base / "jobs" / "earlier" / "result.json").write_text("{}")
        script = tmp_path / "agent.sh"
        script.write_text(f"cat {base}/control.txt; ls -AR {base}/jobs {base}/tasks; "
                          f"cat {base}/tasks/*/tests/test.sh {base}/tasks/*/solution/solve.sh; true\n")
        result = run_job([base / "tasks"], f"script:{script}", jobs_dir=base / "jobs", job_name="j", concurrency=2)
        assert result.n_errors == 0
        for name in result.trials:
            (command,) = [json.loads(line) for line in
                          TrialPaths(base / "jobs" / "j" / name).commands_path.read_text().splitlines()]
            assert "control-visible" in command["stdout"], command
            for secret in ("test.sh", "test_outputs.py", "solve.sh", "result.json", "earlier", "__", "reward"):
                assert secret not in command["stdout"], (secret, command["stdout"])
    finally:
        shutil.rmtree(base)


def test_agent_print_goes_to_trial_log_not_the_terminal(tmp_path):
    (tmp_path / "chatty_agent.py").write_text(
        "import sys\n"
        "class Chatty:\n"
        "    name = 'chatty'\n"
        "    def run(self, instruction, episode):\n"
        "        print('chatty-stdout-marker')\n"
        "        sys.stderr.write('chatty-stderr-marker\\n')\n"
        "        episode.exec('true')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "sequester.cli", "run", str(EXAMPLES / "python-csv-stats"),
                        str(EXAMPLES / "c-word-count"), "--agent", "chatty_agent:Chatty", "-n", "2",
                        "-o", str(tmp_path / "jobs"), "--job-name", "c"], capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 0, r.stderr
    assert "chatty" not in r.stdout.replace("chatty_agent", "") and "marker" not in r.stderr
    for trial in trial_results(tmp_path / "jobs" / "c").values():
        log = TrialPaths(tmp_path / "jobs" / "c" / trial["trial_name"]).trial_log_path.read_text()
        assert log.count("agent stdout: chatty-stdout-marker") == 1, log  # each trial its own, not the other's
        assert log.count("agent stderr: chatty-stderr-marker") == 1, log


def _result(task: str, reward: float | None, *, error: str | None = None, tampering: int = 0):
    from sequester.jobs import ExceptionInfo, TrialResult, VerifierOutcome

    return TrialResult(
        task_name=task, trial_name=f"{task}__abc123", trial_uri="file:///x", agent_info={"name": "a"},
        verifier_result=None if reward is None else VerifierOutcome({"reward": reward}),
        exception_info=None if error is None else ExceptionInfo(error, "it broke", "", "2026-01-01T00:00:00+00:00"),
        started_at="2026-01-01T00:00:00+00:00", finished_at="2026-01-01T00:00:12.5+00:00",
        tampering=[f"/etc/x{i}" for i in range(tampering)])


def test_summary_is_readable_at_80_columns():
    import io

    from rich.console import Console

    from sequester.jobs import JobResult
    from sequester.jobs.render import print_summary

    trials = [_result("build-a-very-long-named-cython-extension", 1.0, tampering=3),
              _result("python-csv-stats", None, error="VerifierCouldNotRun"), _result("c-word-count", 0.25)]
    job = JobResult.from_trials("j", "2026-01-01T00:00:00+00:00", "2026-01-01T00:01:00+00:00", 3, trials)
    for width in (80, 120):
        out = io.StringIO()
        print_summary(Console(file=out, width=width, color_system=None), job, trials, Path("/jobs/j"))
        text = out.getvalue()
        table = text[:text.index("┘") + 1]
        assert all(len(line) <= width for line in table.splitlines()), text
        assert "…" not in text  # nothing cut
        rows = [line.split("│")[1:-1] for line in table.splitlines() if line.startswith("│")]
        # a long cell folds onto more lines of its row, whole: each column read top to bottom
        columns = ["".join(cell.strip() for cell in column) for column in zip(*rows)]
        for cell in ("build-a-very-long-named-cython-extension", "VerifierCouldNotRun", "1.0", "0.25", "12.5s",
                     "!3", "python-csv-stats", "c-word-count"):
            assert any(cell in column.replace(" ", "") for column in columns), (width, cell, text)
        assert ("abc123" in "".join(columns)) == (width >= 100)  # the trial suffix only where there is room
        assert "1 with tampering" in flat(text) and "mean reward 0.625" in flat(text)


def test_every_sequester_error_has_a_harbor_name_or_policy():
    """Harbor retries what it does not know; none of sequester's own errors may be unknown."""
    import importlib
    import pkgutil

    import sequester as package

    from sequester.errors import SequesterError
    from sequester.jobs.harbor import harbor_exception

    for module in pkgutil.walk_packages(package.__path__, "sequester."):
        if module.name.split(".")[1] in ("harbor", "inspect") and module.ispkg is False:
            continue  # (plug-ins needing Harbor or Inspect: they define no errors of their own)
        if not module.name.split(".")[-1].startswith("_"):
            importlib.import_module(module.name)
    harbor_names = {"RewardFileNotFoundError", "RewardFileEmptyError", "VerifierOutputParseError",
                    "VerifierTimeoutError", "CancelledError", "AddTestsDirError", "SandboxBuildFailedError"}
    seen, todo = set(), [SequesterError]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        name, override = harbor_exception(cls.__name__, "message")
        assert name in harbor_names or override is not None, cls
        seen.add(cls.__name__)
    assert {"VerifierCouldNotRun", "RewardFileMissing", "RewardInvalid", "VerifierTimeout", "TrialCancelled",
            "EpisodeError"} <= seen
    assert harbor_exception("RewardInvalid", "reward.txt: '' is not a number")[0] == "RewardFileEmptyError"
    assert harbor_exception("RateLimitError", "x") == ("RateLimitError", None)  # an agent's own: kept


@pytest.mark.slow
@pytest.mark.skipif("reward_range" not in {f.name for f in __import__("dataclasses").fields(
    __import__("sequester.environments.settings", fromlist=["EpisodeSettings"]).EpisodeSettings)},
    reason="needs [episodes] reward_range in sequester.environments.local (the lead's change)")
def test_reward_range_is_a_run_option(tmp_path):
    task = broken_task(tmp_path, "#!/bin/bash\necho 2.5 > /logs/verifier/reward.txt\n", name="big-reward")
    config = tmp_path / "episodes.toml"
    for table, expected in (("", 0.0), ('reward_range = "any"', 2.5), ("reward_range = [0, 10]", 2.5)):
        config.write_text(f"[episodes]\n{table}\n")
        name = f"r{len(table)}"
        r = sequester("run", str(task), "--agent", "nop", "--config", str(config), "-o", str(tmp_path / "jobs"),
                      "--job-name", name)
        assert r.returncode == 0, r.stderr
        (trial,) = trial_results(tmp_path / "jobs" / name).values()
        assert trial["verifier_result"]["rewards"] == {"reward": expected}, (table, trial["notes"])
    config.write_text("[episodes]\nreward_range = [0, 1]\n")
    (task / "tests" / "test.sh").write_text("#!/bin/bash\necho nan > /logs/verifier/reward.txt\n")
    r = sequester("run", str(task), "--agent", "nop", "--config", str(config), "-o", str(tmp_path / "jobs"),
                  "--job-name", "nan")
    (trial,) = trial_results(tmp_path / "jobs" / "nan").values()
    assert trial["verifier_result"]["rewards"] == {"reward": 0.0}  # NaN is never a reward
