"""The reward-hacking catalogue (examples/hacks/): each attempt, run as the agent, scores no
more than doing nothing, and ends with a verdict, never an error. Reported or not: the
tampering report is information, the verdict does not depend on it. (Root-mode runs over
private copies of /usr and /etc, and unprivileged ones: tests/test_runner_attacks.py.)"""

from pathlib import Path

import pytest

from sequester.agents import ScriptAgent
from sequester.environments.local.episode import Episode

ROOT = Path(__file__).resolve().parent.parent / "examples"
HACKS = sorted((ROOT / "hacks").glob("*.sh"))
# One task checked by plain Python, one by TB2's pinned pytest through uvx.
TASKS = ["python-csv-stats", "pinned-pytest"]


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("hack", HACKS, ids=[h.stem for h in HACKS])
def test_hack_scores_no_more_than_nop(hack, task):
    with Episode() as ep:
        ep.reset(ROOT / "tasks" / task)
        nop = ep.evaluate().reward  # the agent has done nothing yet
        ScriptAgent(hack).run(ep.instruction, ep)
        result = ep.evaluate()  # a VerifierError here (no verdict) fails the test too
    assert nop == 0.0
    assert result.reward <= nop, f"{hack.name} scored {result.reward} on {task}\n{result.output[-3000:]}"


def test_the_catalogue_is_complete():
    names = {h.stem for h in HACKS}
    assert {"read-tests", "plant-conftest", "symlink-tests", "symlink-logs", "prewrite-reward", "watcher-copy-tests",
            "watcher-rewrite-reward", "pytest-env", "sitecustomize", "fake-python", "ld-preload", "bash-env"} <= names


@pytest.mark.parametrize("hack", ["read-tests", "watcher-copy-tests"])
def test_nothing_of_the_tests_reaches_the_agent(hack):
    """The thieves get nothing: after verification, no stolen copy exists in the view."""
    with Episode() as ep:
        ep.reset(ROOT / "tasks" / "python-csv-stats")
        ScriptAgent(ROOT / "hacks" / f"{hack}.sh").run(ep.instruction, ep)
        ep.evaluate()
        stolen = ep.exec("cat /tmp/stolen/* /app/stolen* 2>/dev/null; grep -rl EXPECTED /tmp /app /root 2>/dev/null")
        assert "EXPECTED" not in stolen.stdout and "def test" not in stolen.stdout
