"""The verdict (:mod:`sequester.environments.verdict`, pure): the note a frozen evaluation
gets."""

from __future__ import annotations

from sequester.environments.verdict import FROZEN_TIMEOUT_NOTE, FROZEN_ZERO_NOTE, frozen_evaluation_note


def test_frozen_evaluation_note():
    """A frozen agent's service cannot answer; a timeout or a 0 then says why."""
    assert frozen_evaluation_note("cgroup", timed_out=True) == FROZEN_TIMEOUT_NOTE
    assert frozen_evaluation_note("SIGSTOP", timed_out=False, reward=0.0) == FROZEN_ZERO_NOTE
    assert "freeze_agent = false" in FROZEN_TIMEOUT_NOTE and "live service" in FROZEN_TIMEOUT_NOTE
    assert frozen_evaluation_note("cgroup", timed_out=False, reward=1.0) is None
    assert frozen_evaluation_note(None, timed_out=True) is None  # not frozen: the usual timeout


import pytest  # noqa: E402

from sequester.environments.verdict import RewardInvalid, parse_rewards  # noqa: E402


@pytest.mark.parametrize("raw, rewards", [
    (b'{"reward": 1}', {"reward": 1.0}),
    (b'{"a{[": 1, "reward": 0.5}', {"a{[": 1.0, "reward": 0.5}),  # brackets inside strings
    (b'{"a\\\\": 1, "reward": 0.5}', {"a\\": 1.0, "reward": 0.5}),  # an escaped backslash ends no string
    (b'{"a\\"{": 1, "reward": 0.25}', {'a"{': 1.0, "reward": 0.25}),  # an escaped quote ends no string
])
def test_a_flat_reward_file_is_read_whatever_its_strings_hold(raw, rewards):
    assert parse_rewards({"reward.json": raw}) == rewards


@pytest.mark.parametrize("raw", [
    b"[" * 200_000 + b"]" * 200_000,
    b'{"reward": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"reward": 1, "x": {}}',
    b"{" * 1_000_000,
    b'{"reward": 1, "x": "' + b'\\"' * 100_000,  # never closed: one pass, not one per quote
])
def test_a_nested_or_broken_reward_file_is_invalid_never_an_exception_of_the_parser(raw):
    with pytest.raises(RewardInvalid):
        parse_rewards({"reward.json": raw})


def _judged(tmp_path, reward: bytes, said: tuple[str, ...]):
    import base64

    from tasks import make_task

    from sequester.environments.verdict import Evaluation, judge
    from sequester.tasks import load_task

    task = load_task(make_task(tmp_path))
    report = {"exit_code": 0, "files": {"reward.txt": base64.b64encode(reward).decode()}}
    return judge(task, Evaluation(report, b"", said, 0.1), tampering=(), frozen=None)


def test_a_module_the_runner_lacks_makes_a_zero_a_bootstrap_failure_and_a_pass_stays_a_pass(tmp_path):
    """An optional import that failed (the tests passed all the same) changes nothing; with
    a 0, the runner falling short is not the agent's verdict until the pristine run says so."""
    from sequester.environments.verdict import BootstrapFailed

    assert _judged(tmp_path / "a", b"1", ("runner-lacks:readline",)).reward == 1.0
    with pytest.raises(BootstrapFailed, match="readline"):
        _judged(tmp_path / "b", b"0", ("runner-lacks:readline",))


def test_imports_from_the_agents_folders_are_noted(tmp_path):
    result = _judged(tmp_path, b"1", ("agent-import:/app/solution.py", "pytest"))
    assert any("/app/solution.py" in n for n in result.notes), result.notes


def test_a_uvx_that_never_ran_pytest_is_a_bootstrap_failure_only_without_a_pass(tmp_path):
    from sequester.environments.verdict import BootstrapFailed

    assert _judged(tmp_path / "a", b"1", ("uvx",)).reward == 1.0  # a uvx of another tool, that passed
    with pytest.raises(BootstrapFailed, match="never started pytest"):
        _judged(tmp_path / "b", b"0", ("uvx",))


def test_a_reward_too_large_for_a_float_is_invalid_not_an_exception():
    with pytest.raises(RewardInvalid, match="not a finite number"):
        parse_rewards({"reward.json": b'{"reward": 1' + b"0" * 400 + b"}"})


def test_the_shells_own_dev_fd_falling_short_is_a_bootstrap_failure(tmp_path):
    """The test shell is below no /proc of its own: its /dev/stderr fails; with a 0, that
    is the runner's shortfall, settled by the pristine run, never a silent 0."""
    import base64

    from tasks import make_task

    from sequester.environments.verdict import BootstrapFailed, Evaluation, judge
    from sequester.tasks import load_task

    report = {"exit_code": 0, "files": {"reward.txt": base64.b64encode(b"0").decode()}}
    out = b"/tests/test.sh: line 3: /dev/stderr: No such file or directory\n"
    with pytest.raises(BootstrapFailed, match="/dev/stderr"):
        judge(load_task(make_task(tmp_path)), Evaluation(report, out, (), 0.1), tampering=(), frozen=None)
