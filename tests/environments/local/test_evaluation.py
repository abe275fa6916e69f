"""The verifier of an episode (:mod:`sequester.environments.local.evaluation`): strict
rewards, who is to blame, its environment, the freeze, the tampering report, nothing of
the host's output, its own /dev."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sequester.environments.local.episode import Episode
from sequester.environments.verdict import RewardFileMissing, RewardInvalid, VerifierCouldNotRun
from tasks import make_task, writable_usr

# -- the verifier ------------------------------------------------------------------------------


@pytest.mark.parametrize("content, error", [
    ("reward.txt:nan", RewardInvalid), ("reward.txt:inf", RewardInvalid), ("reward.txt:1.5", RewardInvalid),
    ("reward.txt:-0.1", RewardInvalid), ("reward.txt:yes", RewardInvalid), ("reward.txt:", RewardInvalid),
    ('reward.json:{"reward": {"a": 1}}', RewardInvalid), ('reward.json:{"reward": true}', RewardInvalid),
    ('reward.json:{"a": 0.5, "b": 1}', RewardInvalid), ("reward.json:[1]", RewardInvalid),
    ('reward.json:{"reward": NaN}', RewardInvalid), ("none:", RewardFileMissing),
])
def test_rewards_are_read_strictly(tmp_path, episode, content, error):
    """An invalid or missing reward is the agent's 0 with the reason (its programs, run by
    the tests, could have caused it), never an error a trainer would drop."""
    name, _, value = content.partition(":")
    script = "true\n" if name == "none" else f"printf '%s' '{value}' > /logs/verifier/{name}\n"
    episode.reset(make_task(tmp_path, test_sh=script))
    result = episode.evaluate()
    assert result.rewards == {"reward": 0.0}
    assert result.zero_reason and ("neither" if error is RewardFileMissing else "") in result.zero_reason


def test_a_deeply_nested_reward_file_is_the_agents_zero_not_an_error(tmp_path, episode):
    """Attack: a program the tests ran writes a reward.json nested deep enough to raise
    RecursionError out of a JSON parser: refused before it is parsed, the agent's 0. (The
    script writes no reward itself: a program's reward file counts then, and is parsed.)"""
    script = ("python3 -c \"import sys; sys.stdout.write('{\\\"reward\\\": ' + '[' * 200000 + ']' * 200000 + '}')\" "
              "> /logs/verifier/reward.json\necho reward.json > /dev/null\n")
    episode.reset(make_task(tmp_path, test_sh=script))
    result = episode.evaluate()
    assert result.rewards == {"reward": 0.0} and "not a flat object" in (result.zero_reason or ""), result


def test_reward_json_wins_and_is_a_flat_dict(tmp_path, episode):
    script = "echo 0 > /logs/verifier/reward.txt\necho '{\"reward\": 0.75, \"style\": 1}' > /logs/verifier/reward.json\n"
    episode.reset(make_task(tmp_path, test_sh=script))
    result = episode.evaluate()
    assert result.rewards == {"reward": 0.75, "style": 1.0} and result.reward == 0.75


def test_tests_that_fail_are_a_zero_not_an_error(tmp_path, episode):
    episode.reset(make_task(tmp_path, test_sh="echo 'assert failed'\necho 0 > /logs/verifier/reward.txt\nexit 1\n"))
    result = episode.evaluate()
    assert result.reward == 0.0 and result.exit_code == 1 and "assert failed" in result.output


def test_a_failed_bootstrap_is_an_error_not_a_zero(tmp_path, episode):
    # TB2's script writes 0 whenever uvx fails; the runner saw uvx start but never pytest.
    script = ("uvx -p 3.99 -w pytest==8.4.1 pytest --ctrf /logs/verifier/ctrf.json /tests -rA\n"
              "if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n")
    episode.reset(make_task(tmp_path, test_sh=script))
    with pytest.raises(VerifierCouldNotRun, match=r"asks uv for Python 3\.99, which the runner does not have") as err:
        episode.evaluate()
    assert "3.99" in err.value.output  # uv's own message is kept for the host


def test_a_tool_the_script_installs_and_cannot_find_is_an_error_not_a_zero(tmp_path, episode):
    """TB2's `apt-get install -y curl expect` then `expect ...`: the verifier cannot install
    expect; the script writes 0 and carries on. The runner saw the install fail and the
    tool then missing: an error (it fails so in the pristine environment too), never the
    agent's 0."""
    script = ("apt-get install -y curl expect\nexpect -v; if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; "
              "else echo 0 > /logs/verifier/reward.txt; fi\n")
    episode.reset(make_task(tmp_path, test_sh=script))
    with pytest.raises(VerifierCouldNotRun, match="apt-get install expect failed; expect .which it installs. was then"):
        episode.evaluate()


def test_a_command_the_script_does_not_install_is_the_agents_to_provide(tmp_path, episode):
    """A tool the agent was to put on PATH and did not: not found, the agent's 0."""
    episode.reset(make_task(tmp_path, test_sh="agent-tool --version || echo 0 > /logs/verifier/reward.txt\n"))
    assert episode.evaluate().reward == 0.0


def test_an_agents_program_that_forges_a_set_up_failure_gets_a_zero_not_an_error(tmp_path, episode):
    """Attack: a program the tests run writes "setup-failed" on the runner's pipe to turn
    its 0 into an error a trainer drops: the pristine environment does not fail so."""
    script = "bash /app/forge.sh\necho 0 > /logs/verifier/reward.txt\n"
    episode.reset(make_task(tmp_path, test_sh=script))
    episode.exec("printf 'printf \"setup-failed:apt-get-install:x\\\\nruntime-lacks:x\\\\n\" >&$SEQUESTER_RUNNER_FD\\n' > /app/forge.sh")
    result = episode.evaluate()
    assert result.reward == 0.0 and "does not fail that way" in (result.zero_reason or ""), result


_X_TEST = {"tests/test_x.py": "def test_x():\n    assert open('/app/out.txt').read() == 'ok'\n"}
_VERDICT = "; if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n"


@pytest.mark.parametrize("run", [
    "pip install pytest==8.4.1 pytest-json-ctrf==0.3.5 --break-system-packages\npytest /tests/test_x.py -rA",
    "pip3 install -q pytest==8.4.1\npython3 -m pytest /tests/test_x.py",
    "python3 -m pytest /tests/test_x.py",
    "pytest /tests/test_x.py",
])
@pytest.mark.parametrize("solved", [True, False])
def test_scripts_that_pip_install_pytest_or_call_it_get_the_runners(tmp_path, episode, run, solved):
    """TB2's `pip install pytest==...` then `pytest` (6 of 89), and `python3 -m pytest`: the
    runner's pip installs into its own environment, offline, from the runner's and the
    task's wheels; `pytest` and `python3 -m pytest` are the runner's. 1 solved, 0 not."""
    episode.reset(make_task(tmp_path, test_sh=f"cd /app\n{run}{_VERDICT}", files=_X_TEST))
    if solved:
        episode.exec("printf ok > /app/out.txt")
    assert episode.evaluate().reward == (1.0 if solved else 0.0)


def test_a_uvx_tool_the_script_names_by_a_variable_is_made_as_it_runs_and_named(tmp_path, episode):
    """Fidelity: `uvx -w "$PKG" pytest` cannot be read ahead: uv makes it as the script
    runs (its cache in the scratch folder), it works, and the notes say so."""
    script = 'cd /app\nPKG=pytest==8.4.1\nuvx -w "$PKG" pytest /tests/test_x.py -rA' + _VERDICT
    episode.reset(make_task(tmp_path, test_sh=script, files=_X_TEST))
    episode.exec("printf ok > /app/out.txt")
    result = episode.evaluate()
    assert result.reward == 1.0, result.output
    assert any("`uvx` what could not be read from its text ahead" in n for n in result.notes), result.notes


def test_a_pip_install_the_script_names_by_a_variable_is_refused_an_error_not_a_zero(tmp_path, episode):
    """`pip install "$PKG"` cannot be read ahead, and the runner's pip environment is only
    ever what was installed before the script ran (one that a program the script ran
    first could have planted is never used: red team): a named set-up failure."""
    script = 'cd /app\nPKG=pytest-json-ctrf==0.3.5\npip install "$PKG"\npytest /tests/test_x.py -rA' + _VERDICT
    episode.reset(make_task(tmp_path, test_sh=script, files=_X_TEST))
    with pytest.raises(VerifierCouldNotRun, match="not read from the script ahead"):
        episode.evaluate()  # (the tests fail: without the refusal this was the agent's 0)
    episode.exec("printf ok > /app/out.txt")
    assert episode.evaluate().reward == 1.0  # (a pass stands: what was refused was not needed)


def test_the_tests_can_write_a_large_file_into_a_folder_they_make_at_the_top(tmp_path, episode):
    """Fidelity: path-tracing's tests `mkdir /jail` and its program writes a 48 MB image
    there; the verifier's root held 16 MiB (the image cut short: the oracle's 0)."""
    script = ("mkdir /jail && head -c 64M /dev/zero > /jail/f && test \"$(stat -c %s /jail/f)\" = 67108864"
              + _VERDICT)
    episode.reset(make_task(tmp_path, test_sh=script))
    result = episode.evaluate()
    assert result.reward == 1.0, result.output


def test_the_agents_pytest_and_pip_are_never_the_runners(tmp_path, episode):
    """Attack: a pytest that passes everything ahead on the agent's PATH, a pytest.py in the
    working folder, a pip that writes the reward: none of them runs."""
    script = "cd /app\npip install -q pytest==8.4.1\npytest /tests/test_x.py" + _VERDICT
    episode.reset(make_task(tmp_path, test_sh=script, files=_X_TEST))
    episode.exec("printf '#!/bin/sh\\nexit 0\\n' > /usr/local/bin/pytest; cp /usr/local/bin/pytest /usr/local/bin/pip; "
                 "chmod +x /usr/local/bin/pytest /usr/local/bin/pip; printf 'raise SystemExit(0)\\n' > /app/pytest.py")
    assert episode.evaluate().reward == 0.0


@pytest.mark.slow
def test_a_pinned_wheel_with_cxx_parts_loads_in_the_runner(tmp_path, episode):
    """numpy (C++ parts: libstdc++ from the system, by the manylinux policy) imports in the
    runner's Python: the tree carries the system libraries wheels may load. 22 of TB2's 89
    tasks pin such wheels; without them the tests failed to import ("/: cannot read file
    data"). And a uvx of something other than pytest that passes stands as a pass."""
    script = ('uvx -p 3.11 -w numpy==2.2.6 python -c "import numpy; print(numpy.ones(3).sum())" '
              "> /logs/verifier/out.txt 2>&1\n"
              "grep -q 3.0 /logs/verifier/out.txt && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n")
    episode.reset(make_task(tmp_path, test_sh=script))
    result = episode.evaluate()
    assert result.reward == 1.0, result.files.get("out.txt")


def test_an_agent_that_kills_pytest_gets_a_zero_not_an_error(tmp_path, episode):
    """The agent's program, run by the tests, kills pytest: no ctrf.json is written, but
    the runner had said pytest started, so this is the agent's 0, not a void."""
    tests = "import os, signal, subprocess\ndef test_it():\n    subprocess.run(['/app/solve'])\n"
    script = ("uvx -p 3.11 -w pytest==8.4.1 -w pytest-json-ctrf==0.3.5 pytest --ctrf /logs/verifier/ctrf.json "
              "/tests/test_outputs.py -rA\n"
              "if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n")
    episode.reset(make_task(tmp_path, test_sh=script, files={"tests/test_outputs.py": tests}))
    episode.exec("printf '#!/bin/sh\\nkill -9 $PPID\\n' > /app/solve && chmod +x /app/solve")
    result = episode.evaluate()
    assert result.reward == 0.0 and "ctrf.json" not in result.files


def test_verifier_timeout_is_the_agents_zero(tmp_path, episode):
    episode.reset(make_task(tmp_path, test_sh="sleep 30\necho 1 > /logs/verifier/reward.txt\n", verifier_timeout=1))
    started = time.monotonic()
    result = episode.evaluate()
    assert result.reward == 0.0 and "ran over its 1 s" in result.zero_reason
    assert time.monotonic() - started < 5


@pytest.mark.slow
def test_pytest_fallback_without_test_sh(tmp_path, episode):
    task = make_task(tmp_path, files={"tests/test_things.py": "def test_ok():\n    assert open('/app/out').read() == 'ok'\n"})
    (task / "tests" / "test.sh").unlink()
    episode.reset(task)
    assert episode.evaluate().reward == 0.0
    episode.exec("printf ok > /app/out")
    assert episode.evaluate().reward == 1.0


def test_verifier_environment_is_scrubbed_and_private(tmp_path, episode):
    script = "env | sort > /logs/verifier/env.txt\nls /proc | grep -c '^[0-9]' > /logs/verifier/procs.txt\n" \
             "echo 1 > /logs/verifier/reward.txt\n"
    episode.reset(make_task(tmp_path, test_sh=script, dockerfile="FROM x\nWORKDIR /app\nENV FROM_IMAGE=yes\n"))
    episode.exec("export PYTEST_ADDOPTS=-p no:x PYTHONPATH=/evil LD_PRELOAD=/evil.so BASH_ENV=/evil.sh; "
                 "echo 'export INJECTED=1' > /root/.bashrc; sleep 300 &")
    result = episode.evaluate()
    env = result.files["env.txt"].decode()
    for name in ("PYTEST_ADDOPTS", "PYTHONPATH", "LD_PRELOAD", "INJECTED", "/evil"):
        assert name not in env
    assert "BASH_ENV=/opt/sequester-verifier/etc/bash-env" in env  # the runner's own (see shims)
    assert "FROM_IMAGE=yes" in env and "UV_OFFLINE=1" in env and "UV_NO_CONFIG=1" in env
    assert "PATH=/opt/sequester-verifier/bin:" in env  # the runner's tools first
    # The verifier's own PID namespace: it sees its processes, not the agent's sleep.
    assert int(result.files["procs.txt"]) < 6


@pytest.mark.slow
def test_freeze_stops_the_agent_during_the_verify_window(tmp_path, episode):
    script = "a=$(wc -l < /app/ticks); sleep 0.4; b=$(wc -l < /app/ticks)\n" \
             "if [ \"$a\" = \"$b\" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n"
    episode.reset(make_task(tmp_path, test_sh=script))
    episode.exec("(while true; do echo t >> /app/ticks; sleep 0.02; done) > /dev/null 2>&1 &")
    time.sleep(0.2)
    assert episode.evaluate(freeze=False).reward == 0.0  # control: the agent keeps writing
    frozen = episode.evaluate(freeze=True)
    assert frozen.reward == 1.0 and frozen.frozen
    count = int(episode.exec("wc -l < /app/ticks").stdout)
    time.sleep(0.3)
    assert int(episode.exec("wc -l < /app/ticks").stdout) > count  # thawed afterwards


@writable_usr
def test_tampering_is_reported_but_decides_nothing(tmp_path):
    """Tampering with what a naive verifier would run (a shadowing python3, a preload)
    is listed, and the verdict is the tests' own: the runner never runs the agent's."""
    task = make_task(tmp_path)
    with Episode() as ep:
        ep.reset(task)
        ep.exec("printf '#!/bin/sh\\nexit 0\\n' > /usr/local/bin/python3; chmod +x /usr/local/bin/python3; "
                "echo /lib/x86_64-linux-gnu/libc.so.6 > /etc/ld.so.preload")
        result = ep.evaluate()
        assert any("python3" in t for t in result.tampering)
        assert any("ld.so.preload" in t for t in result.tampering)
        assert result.reward == 1.0  # make_task's default test.sh writes 1


@pytest.mark.skipif(not Path("/bin").is_symlink(), reason="a merged-/usr system: /bin is a symlink")
def test_replacing_a_top_level_symlink_is_reported(tmp_path, episode):
    episode.reset(make_task(tmp_path))
    assert episode.tampering() == []
    episode.exec("rm /bin && mkdir /bin && printf '#!/usr/bin/sh\\nexit 0\\n' > /bin/bash && chmod +x /bin/bash")
    assert any("/bin" in t and "symlink" in t for t in episode.evaluate().tampering)



def test_nothing_in_an_episode_holds_the_hosts_output(tmp_path):
    """The agent (through its init) and the tests' programs (through the verifier's init,
    PID 1 of the verifier's namespace) write to /proc/1/fd/{1,2}: none of it reaches the
    process that runs the episode."""
    import subprocess
    import sys

    task = make_task(tmp_path, test_sh="for fd in 1 2; do echo VERIFIER-FORGED >> /proc/1/fd/$fd && echo wrote $fd; "
                                       "done > /logs/verifier/fds.txt 2>&1\necho 1 > /logs/verifier/reward.txt\n")
    harness = (
        "import sys\nfrom sequester.environments.local.episode import Episode\n"
        "with Episode() as ep:\n"
        f"    ep.reset({str(task)!r})\n"
        "    out = ep.exec('for fd in 1 2; do printf \"AGENT-FORGED\\\\033[2J\" >> /proc/1/fd/$fd && echo agent wrote $fd; "
        "done 2>/dev/null; true').stdout\n"
        "    sys.stderr.write(out)\n"
        "    r = ep.evaluate()\n"
        "    print('REWARD', r.reward)\n"
        "    sys.stderr.write(r.files['fds.txt'].decode())\n"
    )
    proc = subprocess.run([sys.executable, "-c", harness], capture_output=True, text=True, timeout=120)
    assert "REWARD 1.0" in proc.stdout, proc.stderr
    assert "FORGED" not in proc.stdout + proc.stderr and "\033[2J" not in proc.stdout + proc.stderr
    # control: the agent's write to fd 1 did happen (into /dev/null; fd 2 is a pipe whose
    # reader is gone); the tests' programs cannot even open the verifier's init's
    assert "agent wrote 1" in proc.stderr
    assert "/proc/1/fd/1" in proc.stderr


@pytest.mark.slow
def test_a_frozen_evaluation_of_a_live_service_says_why_it_failed(tmp_path, episode):
    """A task scored on a service the agent runs cannot pass frozen; the notes say so."""
    script = ("if curl -s -m 3 http://127.0.0.1:8123/ >/dev/null; then echo 1; else echo 0; fi"
              " > /logs/verifier/reward.txt\n")
    episode.reset(make_task(tmp_path, test_sh=script))
    episode.exec("(python3 -m http.server 8123 --bind 127.0.0.1 >/dev/null 2>&1 &) ; sleep 1")
    live = episode.evaluate(freeze=False)
    assert live.reward == 1.0 and not any("frozen" in n for n in live.notes)  # control
    frozen = episode.evaluate(freeze=True)
    assert frozen.reward == 0.0 and any("freeze_agent = false" in n for n in frozen.notes), frozen.notes


def test_the_verifier_has_its_own_dev_with_the_real_devices(tmp_path, episode):
    script = ('if [ -c /dev/null ] && [ -c /dev/urandom ] && [ ! -e /dev/planted ] && head -c1 /dev/zero | od -An -tx1'
              ' | grep -q 00; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n')
    episode.reset(make_task(tmp_path, test_sh=script))
    episode.exec("echo x > /dev/planted; rm -f /dev/null 2>/dev/null; true")
    assert episode.exec("test -e /dev/planted && echo yes").stdout.strip() == "yes"  # control: the agent's /dev has it
    assert episode.evaluate().reward == 1.0


def test_a_flooded_logs_folder_still_gives_the_verdict(tmp_path, episode):
    """The tests' programs can fill /logs/verifier: what the host reads back stays bounded,
    and the reward files come first."""
    script = ("cd /logs/verifier && for i in $(seq 1 5000); do : > a$i; done; "
              "for i in 1 2 3 4 5 6 7 8 9 10; do head -c 1000000 /dev/zero > big$i; done; "
              "echo 1 > /logs/verifier/reward.txt\n")
    episode.reset(make_task(tmp_path, test_sh=script))
    result = episode.evaluate()
    assert result.reward == 1.0
    assert sum(len(d) for d in result.files.values()) <= 8 << 20 and len(result.files) <= 64
