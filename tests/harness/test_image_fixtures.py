"""The image fixtures against the real tools: a real registry, skopeo, umoci, debootstrap.

These check the helpers themselves (tests/helpers/registry.py and images.py), so that a
failing image test elsewhere means sequester is wrong, not its fixtures.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from images import (
    INDEX_TYPE,
    PLATFORM_FILE,
    WHITEOUT_HIDDEN,
    WHITEOUT_VISIBLE,
    busybox_rootfs,
    docker_archive,
    edit_image,
    host_arch,
    is_root,
    layer_members,
    layered_with_whiteouts,
    manifest,
    multi_platform_index,
    oci_archive,
    oci_from_rootfs,
    other_arch,
    other_platform_only,
    read_blob,
    tiny_image_30mb,
    trixie_image,
    trixie_rootfs,
    zstd_copy,
)
from registry import Registry, manifest_digest, needs_tools, running_registry, skopeo

pytestmark = needs_tools("skopeo", "umoci")


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    """An anonymous registry on loopback, stopped after the test whatever happened."""
    with running_registry(tmp_path / "registry") as served:
        yield served


@pytest.fixture
def small_image(tmp_path: Path) -> str:
    """A one-layer image of a few files (no root, no network needed)."""
    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    (rootfs / "etc" / "hello").write_text("hello\n")
    return oci_from_rootfs(rootfs, tmp_path / "layout", "small", env={"GREETING": "hi"}, workdir="/etc",
                           user="1000:1000", cmd=["/bin/sh", "-c", "cat hello"])


def test_registry_serves_v2_and_stops(tmp_path: Path) -> None:
    with running_registry(tmp_path / "registry") as served:
        with served.urlopen(f"{served.url}/v2/") as response:
            assert response.status == 200
        process = served.process
    assert process.poll() is not None, "the registry must be stopped and reaped on exit"


def test_registry_stops_when_the_test_fails(tmp_path: Path) -> None:
    with pytest.raises(ZeroDivisionError):
        with running_registry(tmp_path / "registry") as served:
            process = served.process
            1 / 0
    assert process.poll() is not None


def test_push_then_inspect_by_tag_and_by_digest(registry: Registry, small_image: str) -> None:
    pushed = registry.push(small_image, "small:v1")
    by_tag = registry.inspect("small:v1")
    assert by_tag["Digest"] == pushed
    # The HTTP API's Docker-Content-Digest and the sha256 of the stored bytes agree.
    assert registry.digest("small:v1") == pushed
    assert manifest_digest(registry.raw_manifest("small:v1")) == pushed
    by_digest = registry.inspect(f"small@{pushed}")
    assert by_digest["Digest"] == pushed and by_digest["Layers"] == by_tag["Layers"]
    assert registry.digest(f"small@{pushed}") == pushed
    config = json.loads(skopeo("inspect", "--config", *registry.tls_args(), registry.ref("small:v1")))["config"]
    assert config["Env"][-1] == "GREETING=hi"
    assert (config["WorkingDir"], config["User"], config["Cmd"]) == ("/etc", "1000:1000", ["/bin/sh", "-c", "cat hello"])


def test_multi_platform_index_keeps_both_manifests(registry: Registry, tmp_path: Path) -> None:
    layout = tmp_path / "multi"
    ref = multi_platform_index(layout, "multi")
    pushed = registry.push(ref, "multi:v1", all=True)
    raw = registry.raw_manifest("multi:v1")
    assert manifest_digest(raw) == pushed
    index = json.loads(raw)
    assert index["mediaType"] == INDEX_TYPE
    platforms = {entry["platform"]["architecture"]: entry["digest"] for entry in index["manifests"]}
    assert set(platforms) == {host_arch(), other_arch()}
    for arch, digest in platforms.items():
        # Each manifest is in the registry, and its last layer holds /platform = its arch.
        one = json.loads(registry.raw_manifest(f"multi@{digest}"))
        with tarfile.open(fileobj=_blob_file(layout, one["layers"][-1]["digest"])) as tar:
            assert tar.extractfile(PLATFORM_FILE).read() == f"{arch}\n".encode()
    # Without --all skopeo picks this machine's platform.
    host = registry.push(ref, "multi:host")
    assert host == platforms[host_arch()]


def test_other_platform_only_has_no_image_for_this_machine(registry: Registry, tmp_path: Path) -> None:
    ref = other_platform_only(tmp_path / "other", "other")
    registry.push(ref, "other:v1", all=True)
    index = json.loads(registry.raw_manifest("other:v1"))
    assert [entry["platform"]["architecture"] for entry in index["manifests"]] == [other_arch()]
    with pytest.raises(AssertionError, match="no image found in (image index|manifest list) for architecture"):
        registry.push(ref, "other:host")


def _blob_file(layout: Path, digest: str) -> io.BytesIO:
    return io.BytesIO(read_blob(layout, digest))


def test_whiteout_layers_hold_whiteouts_and_umoci_applies_them(tmp_path: Path) -> None:
    layout = tmp_path / "wh"
    layered_with_whiteouts(layout, "wh")
    layers = manifest(layout, "wh")["layers"]
    assert len(layers) == 3
    deletions = layer_members(layout, "wh", 1)
    assert {"fixture/.wh.gone.txt", "fixture/emptied/.wh.a", "fixture/emptied/.wh.b",
            "fixture/.wh.removed"} <= set(deletions), deletions
    assert "fixture/opaque/.wh..wh..opq" in layer_members(layout, "wh", 2)
    # What a real unpacker makes of it: the whiteouts hide the lower layers' paths.
    with edit_image(layout, "wh") as rootfs:
        for path in WHITEOUT_VISIBLE:
            assert os.path.lexists(rootfs / path), path
        for path in WHITEOUT_HIDDEN:
            assert not os.path.lexists(rootfs / path), path
        assert not any((rootfs / "fixture" / "emptied").iterdir())


def test_whiteouts_survive_a_registry(registry: Registry, tmp_path: Path) -> None:
    registry.push(layered_with_whiteouts(tmp_path / "wh", "wh"), "wh:v1")
    assert len(registry.inspect("wh:v1")["Layers"]) == 3


def test_zstd_copy_has_zstd_layers(registry: Registry, small_image: str, tmp_path: Path) -> None:
    zstd_copy(small_image, tmp_path / "zstd", "small")
    layers = manifest(tmp_path / "zstd", "small")["layers"]
    assert [layer["mediaType"] for layer in layers] == ["application/vnd.oci.image.layer.v1.tar+zstd"]
    assert read_blob(tmp_path / "zstd", layers[0]["digest"])[:4] == b"\x28\xb5\x2f\xfd"  # zstd magic
    registry.push(f"oci:{tmp_path / 'zstd'}:small", "zstd:v1")
    pushed = json.loads(registry.raw_manifest("zstd:v1"))
    assert pushed["layers"] == layers, "the registry must keep the zstd layers as they are"


def test_archives_exist_and_inspect(small_image: str, tmp_path: Path) -> None:
    oci_ref = oci_archive(small_image, tmp_path / "image.oci.tar", "small")
    docker_ref = docker_archive(small_image, tmp_path / "image.docker.tar", "example.test/small:v1")
    assert (tmp_path / "image.oci.tar").stat().st_size > 0 and (tmp_path / "image.docker.tar").stat().st_size > 0
    assert {"index.json", "oci-layout"} <= set(tarfile.open(tmp_path / "image.oci.tar").getnames())
    assert "manifest.json" in tarfile.open(tmp_path / "image.docker.tar").getnames()
    from_oci = json.loads(skopeo("inspect", oci_ref))
    from_docker = json.loads(skopeo("inspect", docker_ref))
    assert from_oci["Layers"] and from_docker["Layers"]
    assert from_oci["Env"] == from_docker["Env"]


def test_authenticated_registry_takes_docker_config_credentials(tmp_path: Path, small_image: str) -> None:
    with running_registry(tmp_path / "registry", auth=("alice", "s3cret")) as served:
        served.push(small_image, "private:v1")
        home = tmp_path / "home"
        served.write_docker_config(home)
        # No credentials on the command line: only HOME/.docker/config.json has them.
        env = {"PATH": os.environ["PATH"], "HOME": str(home), "XDG_RUNTIME_DIR": os.environ["XDG_RUNTIME_DIR"]}
        args = ["inspect", *served.tls_args(), served.ref("private:v1")]
        assert json.loads(skopeo(*args, env=env))["RepoTags"] == ["v1"]
        anonymous = subprocess.run(["skopeo", *args], capture_output=True, text=True,
                                   env={**env, "HOME": str(tmp_path / "nobody")})
        assert anonymous.returncode != 0 and "authentication required" in anonymous.stderr


def test_tls_registry_verifies_its_certificate(tmp_path: Path, small_image: str) -> None:
    with running_registry(tmp_path / "registry", auth=("alice", "s3cret"), tls=True) as served:
        assert served.url.startswith("https://")
        assert served.push(small_image, "tls:v1") == served.digest("tls:v1")
        unverified = subprocess.run(["skopeo", "inspect", *served.creds_args(), served.ref("tls:v1")],
                                    capture_output=True, text=True)
        assert unverified.returncode != 0 and "certificate" in unverified.stderr


@pytest.mark.slow
def test_busybox_image_has_a_shell_but_no_bash_or_python(registry: Registry, tmp_path: Path) -> None:
    rootfs = busybox_rootfs()
    assert (rootfs / "bin" / "sh").is_symlink() and os.readlink(rootfs / "bin" / "sh") == "busybox"
    for absent in ("bin/bash", "usr/bin/bash", "usr/bin/python3", "bin/python3"):
        assert not os.path.lexists(rootfs / absent), absent
    assert subprocess.run([rootfs / "bin" / "busybox", "sh", "-c", "echo ok"], capture_output=True,
                          text=True).stdout == "ok\n"
    ref = oci_from_rootfs(rootfs, tmp_path / "bb", "bb", cmd=["/bin/sh"])
    registry.push(ref, "busybox:v1")
    assert registry.inspect("busybox:v1")["Architecture"] == host_arch()


@pytest.mark.slow
def test_multi_platform_index_over_busybox(tmp_path: Path) -> None:
    layout = tmp_path / "multi"
    multi_platform_index(layout, "multi", base=busybox_rootfs())
    index = json.loads(read_blob(layout, json.loads((layout / "index.json").read_text())["manifests"][0]["digest"]))
    assert all(len(json.loads(read_blob(layout, entry["digest"]))["layers"]) == 2 for entry in index["manifests"])


@pytest.mark.slow
def test_tiny_image_is_about_30_mb(registry: Registry) -> None:
    ref = tiny_image_30mb()
    layout = Path(ref.split(":")[1])
    size = sum(layer["size"] for layer in manifest(layout, "tiny")["layers"])
    assert 28 << 20 < size < 34 << 20, size
    registry.push(ref, "tiny:v1")
    assert tiny_image_30mb() == ref  # cached: the same layout the second time


@pytest.mark.slow
def test_trixie_rootfs_has_python_and_packs(registry: Registry) -> None:
    if not is_root():
        pytest.skip("the trixie image is built and packed as root (it holds files only root reads)")
    rootfs = trixie_rootfs()
    assert (rootfs / "usr" / "bin" / "python3").exists()
    assert "VERSION_CODENAME=trixie" in (rootfs / "etc" / "os-release").read_text()
    ref = trixie_image()
    layout = Path(ref.split(":")[1])
    names = layer_members(layout, "trixie", 0)
    assert "usr/bin/python3" in names and not [n for n in names if n.startswith("dev/") and n != "dev/"]
    pushed = registry.push(ref, "trixie:v1")
    assert registry.digest("trixie:v1") == pushed
