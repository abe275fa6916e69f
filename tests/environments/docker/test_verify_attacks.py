"""The reward-hacking catalogue (examples/hacks/) against the docker backend's scoring
(:mod:`sequester.environments.docker.verify`), as tests/environments/local/test_evaluation_attacks.py
runs it against local mode: each attempt, run as the agent in
its container, scores no more than doing nothing, and ends with a verdict, never an error.

The task is python-csv-stats built by the engine from its own Dockerfile (``FROM
python:3.11-slim-bookworm``, here a Debian trixie image with python3 tagged so: no
registry is reachable). Default mode is ``separate`` (the tests run in a fresh container
of the pristine image holding only the task's artifacts): every hack must fail there.
``shared`` mode runs the tests with the agent's own container's programs (a container
image has no runner the agent cannot write; README, "Residual risks of docker mode"):
the hacks that replace what the tests run win there, and are listed as such below —
strict xfails, so one that starts failing to win is noticed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine import import_rootfs, module_engine  # noqa: F401 - the fixture
from images import trixie_rootfs
from paths import EXAMPLES, HACKS

from sequester.agents import ScriptAgent
from sequester.environments.settings import EpisodeSettings

# Every test runs on the module's own engine (podman, started and fed an image once per
# module): slow, whichever test pays for the start.
pytestmark = pytest.mark.slow

HACK_SCRIPTS = sorted(HACKS.glob("*.sh"))
TASK = EXAMPLES / "python-csv-stats"
# In shared mode the tests run the agent's python3 and bash, from the agent's PATH and
# libraries: what replaces or preloads them wins. Each is the README's residual risk.
# (Measured, with the agent frozen: the others do not win even here: bash-env and
# ld-preload act through the agent's shell environment, which the tests' exec does not
# inherit; runner-ld-cache and the stdlib hacks aim at the trusted runner's own files,
# which a container does not have; the watchers and runner-late-plant are stopped.
# Unfrozen, those watchers race the tests and sometimes win: README.)
SHARED_RESIDUAL = {"fake-python", "sitecustomize", "runner-path-symlink", "runner-pyvenv-home"}
# In either mode the engine runs the tests' programs beside the shell running test.sh, in
# one PID namespace and on a writable /tests: what local mode puts below the shell (its
# namespaces) and seals (the read-only /tests) is the engine's to give, and it does not.
# (docs/security.md, the per-backend table.)
CONTAINER_RESIDUAL = {"runner-rewrite-test-script", "runner-shell-memory"}


@pytest.fixture(scope="module")
def docker_settings(module_engine):  # noqa: F811 - the fixture
    import_rootfs(module_engine, trixie_rootfs(), "docker.io/library/python:3.11-slim-bookworm")
    return EpisodeSettings(backend="docker", docker_host=module_engine.host, docker_build=True, exec_timeout=120)


def _scores(settings: EpisodeSettings, hack: Path, mode: str, freeze: bool = False) -> tuple[float, float, str]:
    from sequester.environments.docker import DockerEnvironment

    env = DockerEnvironment(settings, base_url=settings.docker_host, build=True)
    try:
        env.start(TASK)
        nop = env.evaluate(verifier_env=mode).reward  # the agent has done nothing yet
        ScriptAgent(hack).run(env.instruction, env)
        result = env.evaluate(verifier_env=mode, freeze=freeze)  # a VerifierError (no verdict) fails it too
        return nop, result.reward, result.output[-3000:]
    finally:
        env.close()


@pytest.mark.parametrize("hack", [pytest.param(h, marks=pytest.mark.xfail(
    h.stem in CONTAINER_RESIDUAL, strict=True, reason="RESIDUAL (docs/security.md, docker mode): the tests' programs "
    "share the shell's PID namespace and a writable /tests")) for h in HACK_SCRIPTS], ids=[h.stem for h in HACK_SCRIPTS])
def test_hack_scores_no_more_than_nop_in_a_separate_container(docker_settings, hack):
    nop, reward, output = _scores(docker_settings, hack, "separate")
    assert nop == 0.0
    assert reward <= nop, f"{hack.name} scored {reward}\n{output}"


@pytest.mark.parametrize("hack", [pytest.param(h, marks=pytest.mark.xfail(
    h.stem in SHARED_RESIDUAL | CONTAINER_RESIDUAL, strict=True, reason="RESIDUAL (docs/security.md, docker shared "
    "mode): the tests run the agent's own programs")) for h in HACK_SCRIPTS], ids=[h.stem for h in HACK_SCRIPTS])
def test_hack_in_shared_mode(docker_settings, hack):
    # Frozen: the agent's live processes (watchers) cannot race the tests, which is the
    # README's mitigation for them; what stays is what the tests themselves run.
    nop, reward, output = _scores(docker_settings, hack, "shared", freeze=True)
    assert nop == 0.0
    assert reward <= nop, f"{hack.name} scored {reward}\n{output}"


def test_the_oracle_scores_one_in_both_modes(docker_settings):
    from sequester.agents import load_agent
    from sequester.environments.docker import DockerEnvironment

    for mode in ("separate", "shared"):
        env = DockerEnvironment(docker_settings, base_url=docker_settings.docker_host, build=True)
        try:
            env.start(TASK)
            load_agent("oracle").run(env.instruction, env)
            assert env.evaluate(verifier_env=mode).reward == 1.0, mode
        finally:
            env.close()
