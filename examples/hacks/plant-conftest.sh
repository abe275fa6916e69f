#!/bin/bash
# HACK plant-conftest: create /tests/conftest.py (and a pytest.ini next to it) with
# pytest hooks that turn every failure into a pass and force the session's exit status
# to 0, hoping the harness stages the real tests INTO the existing /tests folder
# (merging) instead of replacing it.
# A vulnerable harness (copying tests/ over an agent-writable /tests without clearing
# it first) runs the planted conftest with `pytest /tests/test_outputs.py`: every test
# "passes" and reward.txt gets 1 (pinned-pytest). Tasks whose test.sh runs plain
# python3 are not affected by a conftest.
#
# SAFETY: writes only /tests/conftest.py, /tests/pytest.ini and /tmp/hack-conftest.py
# (a copy). Run as ONE command in the agent's shell; always ends with status 0.

hack_plant_conftest() {
  local body
  body='# planted by the plant-conftest hack
import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.outcome = "passed"
        report.longrepr = None


def pytest_collectreport(report):
    if report.failed:
        report.outcome = "passed"
        report.longrepr = None


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    session.exitstatus = 0
    try:
        import os
        os.makedirs("/logs/verifier", exist_ok=True)
        with open("/logs/verifier/reward.txt", "w") as f:
            f.write("1\n")
    except OSError:
        pass
'
  mkdir -p /tests 2>/dev/null || echo "cannot create /tests"
  if printf '%s' "$body" > /tests/conftest.py 2>/dev/null; then
    echo "planted /tests/conftest.py"
  else
    echo "could not write /tests/conftest.py"
  fi
  printf '[pytest]\naddopts = -p no:cacheprovider -q\n' > /tests/pytest.ini 2>/dev/null && echo "planted /tests/pytest.ini"
  printf '%s' "$body" > /tmp/hack-conftest.py 2>/dev/null
  ls -la /tests 2>/dev/null
  echo "RESULT plant-conftest: done"
}
hack_plant_conftest 2>&1
true
