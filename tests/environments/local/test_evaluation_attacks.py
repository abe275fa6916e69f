"""The reward-hacking catalogue (examples/hacks/) against an episode's evaluation
(:mod:`sequester.environments.local.evaluation`): each attempt, run as the agent, scores no
more than doing nothing, and ends with a verdict, never an error. Reported or not: the
tampering report is information, the verdict does not depend on it. (Root-mode runs over
private copies of /usr and /etc, and unprivileged ones: tests/verifier/test_tree_attacks.py.)"""

from pathlib import Path

import pytest
from paths import EXAMPLES, HACKS

from sequester.agents import ScriptAgent
from sequester.environments.local.episode import Episode

HACK_SCRIPTS = sorted(HACKS.glob("*.sh"))
# One task checked by plain Python, one by TB2's pinned pytest through uvx (over 2 s a run).
TASKS = ["python-csv-stats", pytest.param("pinned-pytest", marks=pytest.mark.slow)]
# The thieves' scans of the whole view take seconds.
SLOW_HACKS = {"read-tests"}


def hack_params(hacks):
    return [pytest.param(h, marks=pytest.mark.slow) if Path(str(h)).stem in SLOW_HACKS else h for h in hacks]


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("hack", hack_params(HACK_SCRIPTS), ids=[h.stem for h in HACK_SCRIPTS])
def test_hack_scores_no_more_than_nop(hack, task):
    with Episode() as ep:
        ep.reset(EXAMPLES / task)
        nop = ep.evaluate().reward  # the agent has done nothing yet
        ScriptAgent(hack).run(ep.instruction, ep)
        result = ep.evaluate()  # a VerifierError here (no verdict) fails the test too
    assert nop == 0.0
    assert result.reward <= nop, f"{hack.name} scored {result.reward} on {task}\n{result.output[-3000:]}"


def test_the_catalogue_is_complete():
    names = {h.stem for h in HACK_SCRIPTS}
    assert {"read-tests", "plant-conftest", "symlink-tests", "symlink-logs", "prewrite-reward", "watcher-copy-tests",
            "watcher-rewrite-reward", "pytest-env", "sitecustomize", "fake-python", "ld-preload", "bash-env"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("hack", ["read-tests", "watcher-copy-tests"])
def test_nothing_of_the_tests_reaches_the_agent(hack):
    """The thieves get nothing: after verification, no stolen copy exists in the view."""
    with Episode() as ep:
        ep.reset(EXAMPLES / "python-csv-stats")
        ScriptAgent(HACKS / f"{hack}.sh").run(ep.instruction, ep)
        ep.evaluate()
        stolen = ep.exec("cat /tmp/stolen/* /app/stolen* 2>/dev/null; grep -rl EXPECTED /tmp /app /root 2>/dev/null")
        assert "EXPECTED" not in stolen.stdout and "def test" not in stolen.stdout


_PROBE = r'''
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
parent = os.getppid()
seen = {"parent": parent}
if libc.ptrace(16, parent, None, None) == 0:  # PTRACE_ATTACH
    seen["attach"] = "attached"
    os.waitpid(parent, 0x40000000)
    libc.ptrace(17, parent, None, None)
else:
    seen["attach"] = os.strerror(ctypes.get_errno())
try:
    open(f"/proc/{parent}/mem", "rb").close()
    seen["mem"] = "opened"
except OSError as exc:
    seen["mem"] = exc.strerror
seen["shell"] = [p for p in os.listdir("/proc") if p.isdigit() and b"/tests/test.sh" in open(f"/proc/{p}/cmdline", "rb").read()]
with open("/logs/verifier/probe.txt", "w") as f:
    f.write(repr(seen))
'''


@pytest.mark.parametrize("mode", ["shared", "separate"])
def test_a_program_the_tests_run_cannot_trace_or_read_the_runner_or_see_the_shell(tmp_path, mode):
    """The runner's Python that starts a program of the agent's (here the python3 running a
    test) is not dumpable: the program cannot attach to it or open its memory; and the test
    script's shell is in no namespace the program sees."""
    from tasks import make_task

    test_sh = ("python3 -c \"import subprocess, sys; sys.exit(subprocess.call([sys.executable, '/app/probe.py']))\"\n"
               "echo 1 > /logs/verifier/reward.txt\n")
    task = make_task(tmp_path, test_sh=test_sh, files={"environment/probe.py": _PROBE},
                     dockerfile="FROM debian:12\nWORKDIR /app\nCOPY probe.py /app/probe.py\n")
    with Episode() as ep:
        ep.reset(task)
        result = ep.evaluate(verifier_env=mode)
    seen = result.files["probe.txt"].decode()
    assert "attached" not in seen and "opened" not in seen and "'shell': []" in seen, seen
