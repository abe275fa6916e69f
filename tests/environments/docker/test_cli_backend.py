"""``--backend docker`` (:mod:`sequester.cli.backend`) on ``sequester run`` and ``sequester serve``: the user's path,
end to end, against a real Docker-API engine (podman's service, tests/helpers/engine.py).
The example task's own Dockerfile (``FROM python:3.11-slim-bookworm``) is built by the
engine (``--docker-build``) on a Debian trixie image tagged so (no registry is reachable)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
from engine import import_rootfs, module_engine  # noqa: F401 - the fixture
from images import trixie_rootfs
from paths import EXAMPLES

from sequester.serve.client import SequesterClient

# Every test runs on the module's own engine (podman, started and fed an image once per
# module): slow, whichever test pays for the start.
pytestmark = pytest.mark.slow

TASK = "python-csv-stats"
SOLVE = (EXAMPLES / TASK / "solution" / "solve.sh").read_text()


@pytest.fixture(scope="module")
def host(module_engine):  # noqa: F811 - the fixture
    import_rootfs(module_engine, trixie_rootfs(), "docker.io/library/python:3.11-slim-bookworm")
    return module_engine.host


def _containers(host: str) -> list:
    import docker

    client = docker.DockerClient(base_url=host)
    try:
        return client.containers.list(all=True, filters={"label": "sequester.managed=1"})
    finally:
        client.close()


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sequester.cli", "run", *args], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize(("agent", "reward"), [("oracle", 1.0), ("nop", 0.0)])
def test_sequester_run_on_the_docker_backend(host, tmp_path, agent, reward):
    done = _run(str(EXAMPLES / TASK), "--agent", agent, "--backend", "docker", "--docker-host", host,
                "--docker-build", "-o", str(tmp_path), "--job-name", "d")
    assert done.returncode == 0, done.stderr[-3000:]
    (trial,) = [json.loads(p.read_text()) for p in (tmp_path / "d").glob("*/result.json")]
    assert trial["exception_info"] is None, trial["exception_info"]
    assert trial["verifier_result"]["rewards"] == {"reward": reward}
    # The mode its tests can pass in, in every backend: the example declares no artifacts.
    assert trial["verifier_environment_mode"] == "shared"
    config = json.loads(next((tmp_path / "d").glob("*/config.json")).read_text())
    assert config["environment"]["import_path"] == "sequester.environments.docker:DockerEnvironment"
    assert not _containers(host)  # the agent's and the verifier's containers are gone


def test_a_bad_backend_is_exit_2_naming_it(tmp_path):
    done = _run(str(EXAMPLES / TASK), "--agent", "nop", "--backend", "kubernetes", "-o", str(tmp_path))
    assert done.returncode == 2 and "--backend" in done.stderr and "Traceback" not in done.stderr


def test_sequester_serve_on_the_docker_backend(host, tmp_path):
    token = "docker-serve-" + os.urandom(12).hex()
    log = tmp_path / "serve.log"
    with open(log, "wb") as err:
        server = subprocess.Popen([sys.executable, "-m", "sequester.cli", "serve", "--port", "0", "--tasks-dir",
                                   str(EXAMPLES), "--backend", "docker", "--docker-host", host, "--docker-build"],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                  env={**os.environ, "SEQUESTER_SERVE_TOKEN": token})
    try:
        deadline, url = time.monotonic() + 60, None
        while url is None and time.monotonic() < deadline and server.poll() is None:
            found = re.search(r"(http://127\.0\.0\.1:\d+)", log.read_text(errors="replace"))
            url = found[1] if found else time.sleep(0.1)
        assert url, log.read_text()[-3000:]
        with SequesterClient(url, token) as client:
            reset = client.reset(task=TASK)
            assert reset.observation["workdir"] == "/app"
            assert "no such" in client.exec("ls /tests 2>&1; ls /solution 2>&1").observation["stdout"].lower()
            assert client.evaluate().reward == 0.0
            client.reset(task=TASK)
            client.write_file("/tmp/solve.sh", SOLVE)
            assert client.exec("bash /tmp/solve.sh").observation["exit_code"] == 0
            result = client.evaluate()
            assert result.reward == 1.0 and result.done
            assert result.observation["verifier"]["error"] is None
        assert _wait(lambda: not _containers(host))  # the closed sessions' containers are gone
    finally:
        server.terminate()
        server.wait(60)


def _wait(condition, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return False
