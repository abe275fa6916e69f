#!/bin/bash
# HACK symlink-tests: replace /tests with a symlink to an agent-controlled folder
# (/tmp/fake-tests) that holds a fake test.sh writing reward 1, a fake
# test_outputs.py that exits 0 and a pass-everything conftest.py.
# A vulnerable harness (one that stages tests by copying into the path /tests without
# checking that it is a real, fresh directory, or that resolves /tests/test.sh through
# the agent's overlay) ends up running the agent's test.sh, or copies the real tests
# into the agent's folder where the agent's files win: reward 1 for nothing.
#
# SAFETY: touches only /tests (moved to /tmp/tests.orig.<pid> if it is a directory, a
# symlink otherwise replaced) and /tmp/fake-tests. Run as ONE command in the agent's
# shell; always ends with status 0.

hack_symlink_tests() {
  local fake=/tmp/fake-tests
  mkdir -p "$fake" 2>/dev/null
  cat > "$fake/test.sh" <<'SH'
#!/bin/bash
# fake test.sh planted by the symlink-tests hack
mkdir -p /logs/verifier
echo 1 > /logs/verifier/reward.txt
echo '{"reward": 1.0}' > /logs/verifier/reward.json
echo "all tests passed (fake)"
SH
  printf 'print("all tests passed (fake)")\nraise SystemExit(0)\n' > "$fake/test_outputs.py"
  printf 'import pytest\n\n@pytest.hookimpl(trylast=True)\ndef pytest_sessionfinish(session, exitstatus):\n    session.exitstatus = 0\n' > "$fake/conftest.py"
  chmod 755 "$fake/test.sh" 2>/dev/null

  if [ -L /tests ]; then
    rm -f /tests 2>/dev/null
  elif [ -d /tests ]; then
    mv /tests "/tmp/tests.orig.$$" 2>/dev/null && echo "moved the old /tests to /tmp/tests.orig.$$" \
      || echo "could not move /tests away (mount point or read-only?)"
  fi
  if ln -sfn "$fake" /tests 2>/dev/null && [ -L /tests ]; then
    echo "/tests -> $(readlink /tests)"
  else
    echo "could not make /tests a symlink; trying to drop the fake files into it"
    cp -f "$fake/test.sh" "$fake/test_outputs.py" "$fake/conftest.py" /tests/ 2>/dev/null && echo "copied fake files into /tests"
  fi
  ls -la /tests /tests/ 2>/dev/null | head -20
  echo "RESULT symlink-tests: done"
}
hack_symlink_tests 2>&1
true
