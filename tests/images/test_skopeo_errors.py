"""What a user reads when skopeo fails (:func:`sequester.images.skopeo.explain`), and
`sequester image pull` against a registry that is not there (a closed loopback port: no
packet leaves this machine)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys

import pytest

from sequester.images.skopeo import explain

REFUSED = ('Error parsing image name "docker://127.0.0.1:1/library/foo:latest": pinging container registry '
           '127.0.0.1:1: Get "https://127.0.0.1:1/v2/": dial tcp 127.0.0.1:1: connect: connection refused')


@pytest.mark.parametrize("reason, said", [
    (REFUSED, "cannot reach the registry 127.0.0.1:1 (connection refused): check the network"),
    ('Error parsing image name "docker://registry.example/x:1": pinging container registry registry.example: '
     'Get "https://registry.example/v2/": dial tcp: lookup registry.example: no such host',
     "cannot reach the registry registry.example (no such host)"),
    ('pinging container registry 127.0.0.1:5055: Get "https://127.0.0.1:5055/v2/": http: server gave HTTP '
     'response to HTTPS client', "list it in [images] insecure"),
])
def test_an_unreachable_registry_is_said_to_be_one(reason, said):
    assert said in explain(reason) and "Error parsing image name" not in explain(reason)


def test_other_reasons_are_skopeos_own():
    reason = "reading manifest latest in 127.0.0.1:5055/x: manifest unknown"
    assert explain(reason) == reason


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(shutil.which("skopeo") is None, reason="skopeo is not installed")
def test_image_pull_from_a_registry_that_is_not_there_says_so_exit_2(tmp_path):
    ref = f"127.0.0.1:{_closed_port()}/library/foo:latest"
    config = tmp_path / "config.toml"
    config.write_text(f'[images]\nstore_dir = "{tmp_path / "store"}"\n')
    done = subprocess.run([sys.executable, "-m", "sequester.cli", "image", "pull", "--config", str(config), ref],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "cannot reach the registry 127.0.0.1:" in done.stderr and "Error parsing" not in done.stderr
    assert "Traceback" not in done.stderr
