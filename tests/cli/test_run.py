"""``sequester run``'s input checks (:mod:`sequester.cli.run`), run as a real process: its
output folder, agent modules (``module:Class``) that cannot be used or are found in the
current folder, and the Ray backend's options without it."""

from pathlib import Path

import pytest
from command import sequester
from paths import EXAMPLES

TASK = EXAMPLES / "python-csv-stats"


def test_run_output_that_is_a_file_is_bad_input(tmp_path):
    (tmp_path / "afile").write_text("")
    for output, said in ((tmp_path / "afile", "is not a folder"), (tmp_path / "afile" / "sub", "cannot be made")):
        r = sequester("run", str(TASK), "--agent", "nop", "-o", str(output))
        assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, r.stderr


AGENTS = {
    "needs_args": ("class Agent:\n    def __init__(self, model):\n        pass\n    def run(self, i, e):\n        pass\n",
                   "constructed without arguments"),
    "broken": ("class Agent:\n    def run(self,:\n", "broken.py:2: syntax error"),
    "raises": ("raise RuntimeError('no API key')\n", "RuntimeError: no API key"),
    "fails_in_init": ("class Agent:\n    def __init__(self):\n        raise KeyError('model')\n", "KeyError"),
    "no_run": ("class Agent:\n    pass\n", "has no run(instruction, episode)"),
}


@pytest.mark.parametrize("module", sorted(AGENTS))
def test_a_bad_agent_module_is_bad_input(tmp_path, module):
    source, said = AGENTS[module]
    (tmp_path / f"{module}.py").write_text(source)
    r = sequester("run", str(TASK), "--agent", f"{module}:Agent", "-o", str(tmp_path / "jobs"), cwd=tmp_path)
    assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "jobs").exists()


def test_agent_modules_are_found_in_the_current_folder(tmp_path):
    """With -P nothing puts the current folder on sys.path: sequester does, for module:Class."""
    (tmp_path / "my_agent.py").write_text("class Agent:\n    def run(self, instruction, episode):\n        pass\n")
    r = sequester("run", str(TASK), "--agent", "my_agent:Missing", "-o", str(tmp_path / "jobs"), cwd=tmp_path)
    assert r.returncode == 2 and "module 'my_agent' has no 'Missing'" in r.stderr, r.stderr  # found, imported
    r = sequester("run", str(TASK), "--agent", "no_such_agent:Agent", "-o", str(tmp_path / "jobs"), cwd=tmp_path)
    assert r.returncode == 2 and "No module named 'no_such_agent'" in r.stderr  # control


# -- the Ray backend's options --------------------------------------------------------------


def test_ray_address_without_the_ray_backend_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from sequester.cli import main

    assert main(["run", str(TASK), "--agent", "oracle", "-o", str(tmp_path),
                 "--ray-address", "127.0.0.1:1"]) == 2
    assert "--ray-address is for --backend ray" in capsys.readouterr().err
    assert not list(tmp_path.iterdir()), "nothing ran"


# -- what a task asks for that no backend here can give: an error for its trial, never a 0 ----------


@pytest.mark.parametrize("backend", ["local", "docker"])
def test_a_task_this_host_cannot_run_is_an_error_of_its_trial(tmp_path, backend):
    """A task with GPUs (this machine has none) and one with Compose services: each trial
    is an error (UnsupportedByBackend, naming the gpus or the file), the command fails,
    and no reward is written. (The docker backend refuses Compose before asking any
    engine; its GPUs are the engine's to give, asked of it when the container starts.)"""
    import json
    import shutil

    from tasks import make_task

    gpu = make_task(tmp_path / "tasks", "gpu", toml="[environment]\ngpus = 1\n")
    compose = make_task(tmp_path / "tasks", "compose")
    (compose / "environment" / "docker-compose.yml").write_text("services:\n  db:\n    image: postgres\n")
    tasks = [compose] if backend == "docker" else [gpu, compose]
    if backend == "docker":
        shutil.rmtree(gpu)
    r = sequester("run", *map(str, tasks), "--agent", "oracle", "-o", str(tmp_path / "jobs"), "--job-name", "j",
                  "--backend", backend)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "UnsupportedByBackend" in r.stdout + r.stderr
    results = {json.loads(p.read_text())["task_name"]: json.loads(p.read_text())
               for p in (tmp_path / "jobs" / "j").glob("*/result.json")}
    assert sorted(results) == sorted(t.name for t in tasks)
    for name, result in results.items():
        assert result["verifier_result"] is None and result["exception_info"]["exception_type"] == "UnsupportedByBackend"
        said = result["exception_info"]["exception_message"]
        assert ("gpus = 1" in said) if name == "gpu" else ("docker-compose.yml" in said), said


@pytest.mark.parametrize("how", ["flag", "config"])
def test_a_nan_exec_timeout_is_exit_2_naming_it_and_nothing_runs(tmp_path, how):
    """`--exec-timeout nan` and `[episodes] exec_timeout = nan` were accepted: every command
    then failed, and commands.jsonl held a bare NaN (not JSON)."""
    args = ["--exec-timeout", "nan"]
    if how == "config":
        config = tmp_path / "c.toml"
        config.write_text("[episodes]\nexec_timeout = nan\n")
        args = ["--config", str(config)]
    r = sequester("run", str(EXAMPLES), "--agent", "oracle", "-o", str(tmp_path / "jobs"), *args)
    assert r.returncode == 2, r.stderr
    assert ("'nan' is not a positive number" if how == "flag" else "episodes.exec_timeout: nan") in r.stderr
    assert not (tmp_path / "jobs").exists() or not any((tmp_path / "jobs").iterdir())
