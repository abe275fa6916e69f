"""What Harbor's calls become in an episode (:mod:`sequester.harbor.plan`): the exec line
run by a real bash, as ``docker exec`` would run the command, and the network mapping."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from tasks import make_task

from sequester.harbor.plan import exec_command, harbor_operator_hosts, network_for
from sequester.tasks import load_task


def shell(*lines: str) -> subprocess.CompletedProcess[str]:
    """One bash running ``lines`` one after the other, as the agent's persistent shell does."""
    return subprocess.run(["bash", "-c", "\n".join(lines)], capture_output=True, text=True, timeout=30)


def test_each_exec_has_its_own_folder_and_variables_and_nothing_stays(tmp_path):
    first = exec_command("pwd; echo \"$GREETING\"; cd /; export LEFT=1", cwd=str(tmp_path),
                         env={"GREETING": "it's $HOME; `x`"}, user=None)
    second = exec_command('pwd; echo "left=${LEFT-unset} greeting=${GREETING-unset}"', cwd="/", env=None, user=None)
    r = shell(first, second, "pwd")
    assert r.stdout.splitlines() == [str(tmp_path), "it's $HOME; `x`", "/", "left=unset greeting=unset", os.getcwd()]


def test_the_exit_status_is_the_commands_and_a_missing_folder_is_127(tmp_path):
    r = shell(exec_command("exit 7", cwd=str(tmp_path), env=None, user=None) + "; echo $?")
    assert r.stdout.strip() == "7"
    r = shell(exec_command("echo ran", cwd=str(tmp_path / "missing"), env=None, user=None) + "; echo $?")
    assert "ran" not in r.stdout and r.stdout.strip().endswith("127")


@pytest.mark.parametrize("key", ["A B", "é", "1X", "X=Y", ""])
def test_a_bad_variable_name_is_refused(key):
    with pytest.raises(ValueError, match="not a variable name"):
        exec_command("true", cwd="/", env={key: "1"}, user=None)


def test_a_relative_folder_is_a_path_not_an_option(tmp_path):
    (tmp_path / "-").mkdir()
    r = shell(f"cd {tmp_path}", "cd /", exec_command("pwd", cwd="-", env=None, user=None))
    assert r.returncode == 127 or r.stdout.strip() != str(tmp_path)  # never the shell's OLDPWD


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
@pytest.mark.parametrize("user", ["nobody", 65534, "65534"])
def test_a_user_by_name_or_number_runs_the_command_as_that_user(user):
    r = shell(exec_command("id -u", cwd="/", env=None, user=user))
    assert r.stdout.strip() == "65534", r.stderr


@pytest.mark.parametrize("user", [None, "root", 0])
def test_root_runs_as_it_is(user):
    r = shell(exec_command("id -u", cwd="/", env=None, user=user))
    assert r.stdout.strip() == str(os.geteuid())


def test_harbors_network_policy_maps_to_sequesters(tmp_path: Path):
    public = load_task(make_task(tmp_path, "public"))
    listed = load_task(make_task(tmp_path, "listed", toml='[environment]\nnetwork_mode = "allowlist"\n'
                                 'allowed_hosts = ["pypi.org"]\n'))
    assert network_for("no-network", [], public, None) == ("none", [])
    assert network_for("public", [], public, None) == (None, [])
    assert network_for("public", [], public, "none") == ("none", [])
    # Harbor adds a model's API to the agent's phase: an operator host (withdrawn for the tests)
    assert network_for("allowlist", ["api.example.com"], public, None) == ("allowlist", ["api.example.com"])
    assert network_for("allowlist", ["pypi.org", "api.example.com"], listed, None) == ("task", ["api.example.com"])
    assert network_for("allowlist", ["pypi.org"], listed, "none") == ("none", [])


def test_the_agents_phase_hosts_are_operator_hosts_from_the_start(tmp_path: Path):
    """Harbor's policy of the agent's phase (--allow-agent-host, the model's API it infers
    for an installed agent) widens the environment's: the hosts beyond it are operator
    hosts, on a task without network too; the network option none keeps none of them."""
    quiet = load_task(make_task(tmp_path, "quiet", toml="[environment]\nallow_internet = false\n"))
    listed = load_task(make_task(tmp_path, "listed", toml='[environment]\nnetwork_mode = "allowlist"\n'
                                 'allowed_hosts = ["pypi.org"]\n'))
    public = load_task(make_task(tmp_path, "public"))
    agent = ["localhost", "pypi.org", "files.pythonhosted.org"]
    assert network_for("no-network", [], quiet, None, agent) == ("none", agent)
    assert network_for("no-network", [], quiet, "allowlist", agent) == ("none", agent)
    assert network_for("no-network", [], quiet, "none", agent) == ("none", [])
    # the task's own hosts stay the task's (the verifier keeps them); the environment's extra come first
    assert network_for("allowlist", ["pypi.org", "mirror.example"], listed, None, agent) == (
        "task", ["mirror.example", "localhost", "files.pythonhosted.org"])
    assert network_for("allowlist", ["pypi.org"], listed, "none", agent) == ("none", [])
    assert network_for("public", [], public, None, []) == (None, [])


def test_harbors_hosts_an_episode_cannot_open_as_they_are_are_left_out_with_a_note():
    # Harbor names the model's base URL http://localhost:PORT/v1 as "localhost": the loopback
    # is reachable only as HOST:PORT. allow_hosts naming it with its port opens it, unsaid.
    hosts = ["localhost", "127.0.0.1", "pypi.org", "api.example.com", "10.1.2.3", "*.example.org"]
    kept, notes = harbor_operator_hosts(hosts, ["localhost:8080"])
    assert kept == ["pypi.org", "api.example.com", "*.example.org"]
    assert len(notes) == 1 and "'10.1.2.3'" in notes[0] and "HOST:PORT in --ek allow_hosts" in notes[0], notes
    kept, notes = harbor_operator_hosts(["localhost", "10.1.2.3", "224.0.0.1"], ["10.1.2.3:3141"])
    assert kept == [] and len(notes) == 2, notes
    assert notes[0].startswith("Harbor's allowlist: 'localhost' is the host's loopback: reachable only as HOST:PORT; "
                               "left out of the agent's phase (to open one service of it, name that HOST:PORT")
    assert "'224.0.0.1' is multicast: never reachable; left out of the agent's phase" in notes[1]
    assert "allow_hosts" not in notes[1]  # (no port opens it)
    assert harbor_operator_hosts(["pypi.org"], []) == (["pypi.org"], [])
