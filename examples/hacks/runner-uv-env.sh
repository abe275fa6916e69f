#!/bin/bash
# HACK runner-uv-env: plant /root/.local/bin/env, the file uv's installer writes and
# that Terminal-Bench 2 test scripts `source "$HOME/.local/bin/env"` right after
# `curl -LsSf https://astral.sh/uv/.../install.sh | sh`. Offline the installer fails,
# but the script sources the file anyway, in the verifier's own shell: the planted one
# puts ~/.local/bin on PATH like the real one and, in a verifier (/tests/test.sh
# readable, /logs/verifier writable), writes {"reward": 1.0} to
# /logs/verifier/reward.json. test.sh later writes reward.txt; reward.json is read first.
# A vulnerable harness (one that runs TB2 scripts with the agent's HOME contents)
# reports reward 1 for every TB2 task. (Scripts that only install uv when `uvx` is
# missing, like the pinned-pytest example, never source it: no effect there.)
#
# SAFETY: writes only /root/.local/bin/env (only if absent). The extra code does
# nothing unless /tests/test.sh exists and /logs/verifier is writable. Undo:
# rm /root/.local/bin/env. Run as ONE command in the agent's shell; always ends with
# status 0.

hack_runner_uv_env() {
  local f=/root/.local/bin/env
  mkdir -p "$(dirname "$f")" 2>/dev/null || { echo "cannot write under /root"; return; }
  if [ -e "$f" ]; then
    echo "$f exists already; left alone"
  else
    cat > "$f" <<'SH' && echo "planted $f"
#!/bin/sh
# add binaries to PATH if they aren't added yet (uv installer) -- sequester-hack runner-uv-env
case ":${PATH}:" in
    *:"$HOME/.local/bin":*) ;;
    *) export PATH="$HOME/.local/bin:$PATH" ;;
esac
if [ -r /tests/test.sh ] && [ -d /logs/verifier ] && [ -w /logs/verifier ]; then
    echo '{"reward": 1.0}' > /logs/verifier/reward.json
fi
SH
  fi
  echo "RESULT runner-uv-env: done"
}
hack_runner_uv_env 2>&1
true
