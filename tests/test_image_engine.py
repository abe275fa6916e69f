"""Importing a Docker-API engine's image (``docker-daemon:NAME``): podman serving the
Docker API on a socket of the test's own, with storage of its own (nothing of the
machine's podman or Docker is touched)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from images import busybox_rootfs
from registry import skip_unless_tools

from sequester.images import ImageSettings, ImageStore

CONTAINERS_CONF = """[containers]
default_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]
[engine]
runtime = "runc"
"""


@pytest.fixture
def engine(tmp_path) -> Iterator[tuple[list[str], str, dict[str, str]]]:
    """(podman argv prefix, DOCKER_HOST, environment) of a podman API service on a private socket."""
    skip_unless_tools("podman", "runc", "skopeo")
    if os.geteuid() != 0:
        pytest.skip("a podman service of the test's own is run as root here (CI runs as root)")
    conf = tmp_path / "containers.conf"
    conf.write_text(CONTAINERS_CONF)
    runroot = Path(tempfile.mkdtemp(prefix="pd-", dir="/tmp"))  # podman wants it under 50 characters
    podman = ["podman", "--root", str(tmp_path / "storage"), "--runroot", str(runroot),
              "--storage-driver", "vfs"]
    env = {**os.environ, "CONTAINERS_CONF": str(conf)}
    socket = tmp_path / "podman.sock"
    service = subprocess.Popen([*podman, "system", "service", "--time=0", f"unix://{socket}"], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while not socket.exists():
            if service.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"podman's API service did not start: {service.stderr.read().decode()[-2000:]}")
            time.sleep(0.05)
        yield podman, f"unix://{socket}", env
    finally:
        service.terminate()
        try:
            service.wait(10)
        except subprocess.TimeoutExpired:
            service.kill()
            service.wait()
        subprocess.run([*podman, "system", "reset", "--force"], env=env, capture_output=True, timeout=60)
        shutil.rmtree(runroot, ignore_errors=True)


def test_import_an_engines_image_through_the_docker_api(tmp_path, engine, monkeypatch):
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
