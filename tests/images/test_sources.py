"""Importing a Docker-API engine's image (``docker-daemon:NAME``, :mod:`sequester.images.sources`): podman serving the
Docker API on a socket of the test's own, with storage of its own (nothing of the
machine's podman or Docker is touched)."""

from __future__ import annotations

import subprocess

import pytest
from engine import engine  # noqa: F401 - the fixture
from images import busybox_rootfs
from registry import skip_unless_tools

from sequester.images import ImageSettings, ImageStore


def test_import_an_engines_image_through_the_docker_api(tmp_path, engine, monkeypatch):  # noqa: F811
    skip_unless_tools("skopeo")
    podman, host, env = engine
    archive = tmp_path / "busybox.tar"
    subprocess.run(["tar", "-C", str(busybox_rootfs()), "-cf", str(archive), "."], check=True)
    subprocess.run([*podman, "import", str(archive), "localhost/engine-test:1"], env=env, check=True,
                   capture_output=True, timeout=120)
    monkeypatch.setenv("DOCKER_HOST", host)
    store = ImageStore(ImageSettings(store_dir=tmp_path / "store"))
    record = store.import_source("docker-daemon:localhost/engine-test:1", "test/from-engine:1")
    assert record.names == ("docker.io/test/from-engine:1",) and record.source.startswith("docker-daemon:")
    layer = store.layer_dir(record.layers[0].diff_id)
    assert (layer / "bin" / "busybox").is_file()
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'no-such.sock'}")
    with pytest.raises(Exception, match="docker-daemon:localhost/other:1"):
        store.import_source("docker-daemon:localhost/other:1", "test/x:1")
