"""Tasks built from their Dockerfiles (:mod:`sequester.imagebuild.task_build`): ``sequester build``, ``sequester run --image-source
dockerfile`` and ``auto``, build logs, timeouts and failures as environment errors.

The example ``examples/build-tasks/c-adler32`` installs gcc with ``RUN apt-get install``
from Debian's package index (through the build proxy), on a Debian base served by a real
registry on loopback standing in for Docker Hub; its ``tests/test.sh`` is TB2's canonical
script, verbatim.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from images import busybox_rootfs, is_root, trixie_image
from paths import BUILD_TASKS, IMAGE_TASKS
from registry import running_registry, skip_unless_tools
from tasks import make_task

from sequester.cli import main
from sequester.environments.local.episode import Episode
from sequester.environments.settings import EpisodeSettings
from sequester.images import ImageSettings, ImageStore

EXAMPLE = BUILD_TASKS / "c-adler32"


def _trial(job: Path) -> dict:
    trial = next(p for p in job.iterdir() if p.is_dir() and (p / "result.json").exists())
    return json.loads((trial / "result.json").read_text())


@pytest.fixture
def busybox_config(tmp_path) -> Path:
    """A config whose store has busybox as ``test/bb:1`` (no network needed to build on it)."""
    skip_unless_tools("skopeo")
    ImageStore(ImageSettings(store_dir=tmp_path / "store")).import_source(str(busybox_rootfs()), "test/bb:1")
    config = tmp_path / "config.toml"
    config.write_text('[images]\nstore_dir = "store"\nbuild_network = "none"\n')
    return config


@pytest.mark.slow
def test_example_builds_with_apt_get_from_the_package_index_oracle_1_nop_0(tmp_path):
    skip_unless_tools("skopeo", "umoci", "docker-registry")
    if not is_root():
        pytest.skip("the Debian base image is made from the trixie rootfs, which needs root to pack")
    assert (EXAMPLE / "tests" / "test.sh").read_bytes() == (
        IMAGE_TASKS / "python313-primes" / "tests" / "test.sh").read_bytes()  # TB2's, verbatim
    assert "apt-get install -y --no-install-recommends gcc" in (EXAMPLE / "environment" / "Dockerfile").read_text()
    with running_registry(tmp_path / "registry") as registry:
        registry.push(trixie_image(), "library/debian:trixie-slim")
        config = tmp_path / "config.toml"
        config.write_text(f'[images]\nstore_dir = "store"\nmirrors = {{ "docker.io" = "{registry.host}" }}\n'
                          f'insecure = ["{registry.host}"]\n')
        assert main(["build", str(EXAMPLE), "--config", str(config), "--logs", str(tmp_path / "logs")]) == 0
        log = (tmp_path / "logs" / "c-adler32.log").read_text()
        assert "Setting up gcc" in log and "apt-get install" in log
        for agent, expected in (("oracle", 1.0), ("nop", 0.0)):
            status = main(["run", str(EXAMPLE), "--agent", agent, "--config", str(config), "-o", str(tmp_path / "jobs"),
                           "--job-name", agent, "--image-source", "dockerfile"])
            assert status == 0
            result = _trial(tmp_path / "jobs" / agent)
            assert result["verifier_result"]["rewards"]["reward"] == expected, result
            assert result["system"]["mode"] == "image"
            assert result["system"]["source"].startswith("dockerfile:")
            # cached: the job's build log says every step was
            assert "CACHED" in (tmp_path / "jobs" / agent / "c-adler32.build.log").read_text()


def test_build_cli_table_log_and_exit_statuses(tmp_path, busybox_config, capsys):
    good = make_task(tmp_path, "good", dockerfile="FROM test/bb:1\nWORKDIR /app\nRUN echo ok > /app/ok\n")
    bad = make_task(tmp_path, "bad", dockerfile="FROM test/bb:1\nWORKDIR /app\nRUN echo broken >&2; exit 4\n")
    logs = tmp_path / "logs"
    assert main(["build", str(good), "--config", str(busybox_config), "--logs", str(logs)]) == 0
    out = capsys.readouterr()
    assert "good" in out.out and "built" in out.out and "[stage-0 1/3] FROM docker.io/test/bb:1@sha256:" in out.err and "[stage-0 3/3] RUN echo ok" in out.err
    assert main(["build", str(good), "--config", str(busybox_config), "--logs", str(logs)]) == 0
    assert "cached" in capsys.readouterr().out
    assert main(["build", str(bad), "--config", str(busybox_config), "--logs", str(logs)]) == 1
    err = capsys.readouterr().err
    assert f"{bad / 'environment' / 'Dockerfile'}:3" in err.replace("\n", "") and "exit status 4" in err
    assert "broken" in (logs / "bad.log").read_text()
    assert main(["build", str(tmp_path / "missing"), "--config", str(busybox_config)]) == 2
    with pytest.raises(SystemExit) as exited:  # argparse: exit 2, naming the value
        main(["build", str(good), "--config", str(busybox_config), "--build-network", "bogus"])
    assert exited.value.code == 2 and "'bogus'" in capsys.readouterr().err
    assert main(["build", str(good), "--config", str(busybox_config), "--build-network", "allowlist",
                 "--allowed-host", "https://x.org/"]) == 2
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.slow
def test_failed_or_timed_out_build_is_an_environment_error_not_the_agents_zero(tmp_path, busybox_config):
    slow = make_task(tmp_path, "slow", toml="[environment]\nbuild_timeout_sec = 1.5\n",
                     dockerfile="FROM test/bb:1\nRUN sleep 30\n")
    status = main(["run", str(slow), "--agent", "oracle", "--config", str(busybox_config), "-o",
                   str(tmp_path / "jobs"), "--job-name", "slow", "--image-source", "dockerfile"])
    assert status == 1
    result = _trial(tmp_path / "jobs" / "slow")
    assert result["verifier_result"] is None and result["exception_info"] is not None
    assert "timed out" in result["exception_info"]["exception_message"]
    assert "Dockerfile:2" in result["exception_info"]["exception_message"]
    assert "timed out" in (tmp_path / "jobs" / "slow" / "slow.build.log").read_text()


def test_auto_builds_a_task_without_a_prebuilt_image(tmp_path, busybox_config):
    task = make_task(tmp_path, "auto", "test -f /app/made && echo 1 > /logs/verifier/reward.txt\n",
                     dockerfile="FROM test/bb:1\nWORKDIR /app\nRUN touch /app/made\n")
    settings = EpisodeSettings(images=ImageSettings(store_dir=busybox_config.parent / "store", build_network="none"))
    with Episode(settings) as episode:
        episode.reset(task, image_source="auto")
        assert episode.system["mode"] == "image" and episode.system["source"].startswith("dockerfile:")
        assert episode.exec("ls /app").stdout.split() == ["made"]
        assert episode.evaluate().reward == 1.0
