"""The suite's throw-away users (tests/helpers/users.py) leave nothing behind: the user,
its home, its processes (``seqtest`` and its home once stayed after every run)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from users import temporary_user, user_exists


NAME = "seqtmpuser"
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="creating a user needs root (CI runs as root)")


@root_only
def test_a_temporary_user_goes_with_its_home_and_processes():
    assert not user_exists(NAME)
    with temporary_user(NAME) as entry:
        home = Path(entry.pw_dir)
        assert user_exists(NAME) and home.is_dir()
        (home / "secret.txt").write_text("x")
        sleeper = subprocess.Popen(["sleep", "300"], user=entry.pw_uid, group=entry.pw_gid, extra_groups=[])
    assert sleeper.wait(timeout=10) != 0  # stopped, so that userdel could go on
    assert not user_exists(NAME) and not home.exists()
    assert subprocess.run(["getent", "group", NAME], capture_output=True).returncode != 0


@root_only
def test_a_leftover_of_the_tests_is_removed_and_anyone_elses_kept():
    subprocess.run(["useradd", "--create-home", "--user-group", NAME], check=True)
    try:
        with temporary_user(NAME):  # not recognised: used, kept
            pass
        assert user_exists(NAME)
        with temporary_user(NAME, leftover=lambda entry: True):
            pass
        assert not user_exists(NAME) and not Path(f"/home/{NAME}").exists()
    finally:
        subprocess.run(["userdel", "--remove", NAME], capture_output=True)


@root_only
def test_the_seqtest_user_is_the_sessions(seqtest_user):
    """Made by conftest's session fixture (removed at the session's end)."""
    assert seqtest_user.pw_name == "seqtest" and Path(seqtest_user.pw_dir).is_dir()


