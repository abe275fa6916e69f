"""The one environment interface (``sequester.environments``): the job runner and the
server drive every backend through it. With the fake backend: a backend that lacks what
a trial needs is refused before anything starts; a start, scoring or cleanup that fails
ends the trial the way each must (an error, or the verdict kept with a note); and the
agent gets only its own calls of the environment."""

from __future__ import annotations

import dataclasses
import json

import pytest
from fake_agents import Overreaches
from tasks import make_task

from sequester.environments import Capabilities, missing_capabilities, open_environment
from sequester.environments.fake import FAKE_CAPABILITIES, FakeEnvironment
from sequester.environments.local.episode import Episode
from sequester.environments.settings import EpisodeSettings
from sequester.environments.verdict import VerifierCouldNotRun
from sequester.errors import PolicyError, SandboxError
from sequester.jobs.trial import run_trial
from sequester.tasks import load_task

MEMBERS = ("capabilities", "start", "task", "instruction", "workdir", "notes", "system", "exec", "write_file",
           "read_file", "upload_dir", "evaluate", "abort", "close")


def _trial(tmp_path, env: FakeEnvironment, agent="fake_agents:WritesDone", settings=None, toml=""):
    task = load_task(make_task(tmp_path, toml=toml))
    made = []

    def factory(settings, hide=()):
        made.append(env)
        return env

    (tmp_path / "trials").mkdir(exist_ok=True)
    result = run_trial(task, agent, tmp_path / "trials" / "t__1", settings=settings or EpisodeSettings(), hide=[],
                       open_env=factory)
    record = json.loads((tmp_path / "trials" / "t__1" / "result.json").read_text())
    return result, record


def test_every_backend_has_every_member_of_the_interface():
    for env in (Episode(), FakeEnvironment()):
        missing = [m for m in MEMBERS if not hasattr(type(env), m)]
        assert not missing, (type(env).__name__, missing)
    assert isinstance(open_environment(EpisodeSettings()), Episode)


def test_a_trial_runs_through_the_interface(tmp_path):
    env = FakeEnvironment()
    result, record = _trial(tmp_path, env)
    assert record["verifier_result"]["rewards"] == {"reward": 1.0} and record["exception_info"] is None
    # (read_dir: what the agent left in /logs/agent and /logs/artifacts, kept with the trial)
    assert env.calls == ["start", "write_file", "read_dir", "read_dir", "evaluate", "close"]


def test_a_backend_without_a_separate_verifier_is_refused_before_it_starts(tmp_path):
    caps = dataclasses.replace(FAKE_CAPABILITIES, separate_verifier=False)
    env = FakeEnvironment(capabilities=caps)
    _, record = _trial(tmp_path, env, settings=EpisodeSettings(verifier_env="separate"))
    assert record["exception_info"]["exception_type"] == "UnsupportedByBackend"
    assert "separate environment" in record["exception_info"]["exception_message"]
    assert "start" not in env.calls and record["verifier_result"] is None


def test_a_backend_that_cannot_freeze_is_refused_when_the_task_wants_it(tmp_path):
    env = FakeEnvironment(capabilities=dataclasses.replace(FAKE_CAPABILITIES, freeze=False))
    _, record = _trial(tmp_path, env, toml="freeze_agent = true\n")
    assert record["exception_info"]["exception_type"] == "UnsupportedByBackend" and "start" not in env.calls
    # control: the same backend runs the task that does not ask for it
    env = FakeEnvironment(capabilities=dataclasses.replace(FAKE_CAPABILITIES, freeze=False))
    _, record = _trial(tmp_path / "b", env)
    assert record["exception_info"] is None


def test_missing_capabilities_names_each_need(tmp_path):
    task_caps = Capabilities(backend="x", separate_verifier=False, shared_verifier=False, freeze=False,
                             trusted_runner=False)
    settings = EpisodeSettings(verifier_env="separate", freeze_agent=True)
    task = load_task(make_task(tmp_path))
    said = missing_capabilities(task_caps, task, settings)
    assert len(said) == 2 and any("separate" in s for s in said) and any("freeze" in s for s in said)


def test_scoring_that_cannot_run_is_an_error_and_the_environment_is_still_closed(tmp_path):
    env = FakeEnvironment(fail={"evaluate": VerifierCouldNotRun("the engine went away")})
    _, record = _trial(tmp_path, env)
    assert "the engine went away" in record["exception_info"]["exception_message"]
    assert record["verifier_result"] is None and env.calls[-1] == "close" and env.closed


def test_scoring_that_raises_anything_else_is_an_error_too(tmp_path):
    env = FakeEnvironment(fail={"evaluate": RuntimeError("a bug")})
    _, record = _trial(tmp_path, env)
    assert record["exception_info"]["exception_type"] == "RuntimeError" and env.calls[-1] == "close"


def test_a_failed_cleanup_keeps_the_verdict_and_says_so(tmp_path):
    env = FakeEnvironment(fail={"close": SandboxError("the container could not be removed")})
    _, record = _trial(tmp_path, env)
    assert record["verifier_result"]["rewards"] == {"reward": 1.0}
    assert any("closing the episode failed" in n and "could not be removed" in n for n in record["notes"])


def test_a_start_that_fails_is_an_error_and_is_closed(tmp_path):
    env = FakeEnvironment(fail={"start": SandboxError("no engine")})
    _, record = _trial(tmp_path, env)
    assert "no engine" in record["exception_info"]["exception_message"] and env.calls == ["start", "close"]


def test_the_agent_gets_only_its_own_calls_of_the_environment(tmp_path):
    Overreaches.seen.clear()
    env = FakeEnvironment()
    _, record = _trial(tmp_path, env, agent="fake_agents:Overreaches")
    assert all(v != "allowed" for v in Overreaches.seen.values()), Overreaches.seen
    assert set(Overreaches.seen) == {"start", "reset", "evaluate", "close", "abort", "init_pid", "calls"}
    # none of the agent's tries reached it (read_dir: the trial keeping the agent's /logs folders)
    assert env.calls == ["start", "write_file", "read_dir", "read_dir", "evaluate", "close"]
    assert record["verifier_result"]["rewards"] == {"reward": 1.0}


def test_the_backend_setting_is_checked():
    with pytest.raises(PolicyError, match="episodes.backend: 'kubernetes'"):
        EpisodeSettings(backend="kubernetes")
    with pytest.raises(PolicyError, match="episodes.docker_build"):
        EpisodeSettings(docker_build="yes")


def test_a_task_with_compose_services_is_refused_before_anything_starts(tmp_path):
    """Its services would never start and the trial would run anyway (a silent 0)."""
    env = FakeEnvironment()
    task = make_task(tmp_path, "t")
    (task / "environment" / "docker-compose.yaml").write_text("services:\n  db:\n    image: postgres\n")
    result = run_trial(load_task(task), "fake_agents:WritesDone", tmp_path / "t__1", settings=EpisodeSettings(),
                       hide=[], open_env=lambda settings, hide=(): env)
    assert result.exception_info is not None and result.exception_info.exception_type == "UnsupportedByBackend"
    assert str(task / "environment" / "docker-compose.yaml") in result.exception_info.exception_message
    assert "start" not in env.calls and result.verifier_result is None


def test_a_task_that_asks_for_more_gpus_than_the_backend_has_is_refused(tmp_path):
    caps = dataclasses.replace(FAKE_CAPABILITIES, gpus=1, gpu_source="two words")
    env = FakeEnvironment(capabilities=caps)
    _, record = _trial(tmp_path, env, toml="[environment]\ngpus = 2\n")
    said = record["exception_info"]["exception_message"]
    assert record["exception_info"]["exception_type"] == "UnsupportedByBackend" and "start" not in env.calls
    assert "gpus = 2" in said and "has 1 on this host: two words" in said
    # control: what it has is enough for a task that asks for one; a backend whose engine decides (None) is asked
    for given, toml in ((caps, "[environment]\ngpus = 1\n"), (dataclasses.replace(caps, gpus=None), "gpus = 8\n")):
        env = FakeEnvironment(capabilities=given)
        _, record = _trial(tmp_path / toml[-2], env, toml=toml if toml.startswith("[") else f"[environment]\n{toml}")
        assert record["exception_info"] is None, record["exception_info"]



def test_the_default_verifier_mode_is_the_one_the_tests_can_pass_in(tmp_path):
    """In every backend: shared for a task that declares no artifacts (every TB2 task),
    separate for one that does; the run's and the task's own choice first."""
    from tasks import make_task

    from sequester.environments.base import wanted_verifier_env
    from sequester.environments.settings import EpisodeSettings
    from sequester.tasks import load_task

    plain = load_task(make_task(tmp_path / "a"))
    (tmp_path / "b").mkdir()
    declared = make_task(tmp_path / "b")
    toml = declared / "task.toml"
    toml.write_text('version = "1.0"\nartifacts = ["/app/out.txt"]\n' + toml.read_text().split("\n", 1)[1])
    declared_task = load_task(declared)
    settings = EpisodeSettings()
    assert wanted_verifier_env(plain, settings, default="separate") == "shared"
    assert wanted_verifier_env(declared_task, settings) == "separate"
    assert wanted_verifier_env(declared_task, EpisodeSettings(verifier_env="shared")) == "shared"
    assert wanted_verifier_env(plain, settings, "separate") == "separate"
