"""Test images built with real tools: debootstrap, umoci, skopeo, apt-get and dpkg-deb.

Every builder returns a skopeo/containers-image reference (``oci:PATH:TAG``,
``oci-archive:PATH``, ``docker-archive:PATH``). What is slow to make (the debootstrap
root filesystem, the busybox one, whole-rootfs layouts) is cached under
``$SEQUESTER_TEST_CACHE/images/`` (default /srv/sequester-test-cache), each item next to
a ``NAME.stamp`` recording the recipe it was made with: a changed recipe rebuilds it.
Items are built in a temporary folder and renamed into place, under a flock(2) on
``.NAME.lock`` (the lock .ci/run takes too), so an interrupted build is never used and
parallel runs build once. A user who cannot write the shared cache reads fresh items
from it and builds the rest under ``$TMPDIR/sequester-test-cache-UID/images``. Per-test
products go where the caller says (tmp_path).

umoci 0.4.7 notes: layers are made only with ``umoci unpack`` + edit + ``umoci repack``
(``--rootless`` for an ordinary user; repack reads the mode from the bundle's
umoci.json). ``umoci insert`` is avoided: 0.4.7 never closes its tar writer, so its layers
lack the end-of-archive blocks and padding (GNU tar and Python's tarfile reject them;
umoci issue #436, fixed in #534 after 0.4.7). umoci's repack writes a ``.wh.NAME`` for
each deleted path but never an opaque ``.wh..wh..opq``: that layer is written with
tarfile and added verbatim by ``umoci raw add-layer``. umoci cannot make image indexes:
the multi-platform index is a blob written here, listing umoci-built manifests.
"""

from __future__ import annotations

import fcntl
import io
import json
import os
import platform as _platform
import random
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from hashlib import sha256
from pathlib import Path

import pytest
from registry import run, skip_unless_tools, which

SHARED_CACHE = Path(os.environ.get("SEQUESTER_TEST_CACHE", "/srv/sequester-test-cache")) / "images"

# The debootstrap run .ci/run makes too; ROOTFS stands for the target folder. The stamp
# is this line with ROOTFS kept literal, byte for byte what .ci/run writes.
TRIXIE_DEBOOTSTRAP = ("debootstrap", "--variant=minbase", "--include=python3", "trixie", "ROOTFS",
                      "http://deb.debian.org/debian")
# Bump a recipe's version when its builder changes, so caches made by the old one go.
BUSYBOX_RECIPE = "busybox-static: apt-get download, dpkg-deb -x, --list-full links; v1"
TINY_RECIPE = "busybox + 28 MiB of seeded random data, umoci repack; v1"
TRIXIE_LAYOUT_RECIPE = "umoci repack of trixie-rootfs without /dev entries; v1"

DEFAULT_ENV = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",)  # as Debian's images
INDEX_TYPE = "application/vnd.oci.image.index.v1+json"
REF_NAME = "org.opencontainers.image.ref.name"
PLATFORM_FILE = "platform"  # /platform in each image of an index holds its architecture

# What layered_with_whiteouts' final image shows and hides (paths inside the image).
WHITEOUT_VISIBLE = ("fixture/keep.txt", "fixture/emptied", "fixture/opaque/new.txt")
WHITEOUT_HIDDEN = ("fixture/gone.txt", "fixture/emptied/a", "fixture/emptied/b", "fixture/removed",
                   "fixture/removed/x", "fixture/opaque/old1", "fixture/opaque/old2")

_GOARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "armv6l": "arm", "i386": "386", "i686": "386"}


def host_arch() -> str:
    """This machine's architecture as OCI (Go's GOARCH) names it: ``uname -m`` mapped."""
    return _GOARCH.get(_platform.machine(), _platform.machine())  # ppc64le, s390x... are the same


def other_arch() -> str:
    """An architecture this machine is not: arm64, or amd64 on an arm64 host."""
    return "amd64" if host_arch() == "arm64" else "arm64"


def is_root() -> bool:
    return os.geteuid() == 0


def _writable_cache() -> Path:
    """The shared cache if this user may write it, else a per-user one."""
    try:
        SHARED_CACHE.mkdir(parents=True, exist_ok=True)
    except OSError:
        pass
    if os.access(SHARED_CACHE, os.W_OK | os.X_OK):
        return SHARED_CACHE
    own = Path(tempfile.gettempdir()) / f"sequester-test-cache-{os.getuid()}" / "images"
    own.mkdir(parents=True, exist_ok=True)
    return own


def _fresh(base: Path, name: str, key: str) -> bool:
    try:
        return (base / name).is_dir() and (base / f"{name}.stamp").read_text() == key
    except OSError:
        return False


def remove_tree(path: Path) -> None:
    """``rm -rf --one-file-system``: never descends into a mount an interrupted debootstrap
    left (its /proc); ``chmod -R u+rwX`` first lets an ordinary user remove what a rootless
    unpack made read-only."""
    if path.is_dir() and not path.is_symlink() and not is_root():  # chmod follows a symlink
        subprocess.run(["chmod", "-R", "u+rwX", str(path)], capture_output=True)
    if os.path.lexists(path):
        run(["rm", "-rf", "--one-file-system", str(path)])


@contextmanager
def _locked(lock: Path) -> Iterator[None]:
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cached(name: str, key: str, build: Callable[[Path], None], *, cannot_build: str | None = None) -> Path:
    """The cache item ``name`` made by the recipe ``key``; ``build(folder)`` fills an empty
    folder when there is none. ``cannot_build``: why this user cannot (then it skips)."""
    if _fresh(SHARED_CACHE, name, key):
        return SHARED_CACHE / name
    base = _writable_cache()
    with _locked(base / f".{name}.lock"):
        if _fresh(base, name, key):
            return base / name
        if cannot_build:
            pytest.skip(cannot_build)
        for leftover in base.glob(f".{name}.*.tmp"):  # dead builds: a live one holds the lock
            remove_tree(leftover)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=base))
        try:
            build(tmp)
            tmp.chmod(0o755)  # mkdtemp's 0700 would hide it from other users
            (base / f"{name}.stamp").unlink(missing_ok=True)
            remove_tree(base / name)
            tmp.rename(base / name)
            (base / f"{name}.stamp").write_text(key)
        finally:
            remove_tree(tmp)
    return base / name


def trixie_stamp() -> str:
    return " ".join(TRIXIE_DEBOOTSTRAP) + "\n"


def trixie_rootfs() -> Path:
    """Debian trixie minbase with python3 (about 260 MB), made by debootstrap (about 40 s)."""
    def build(folder: Path) -> None:
        run([arg.replace("ROOTFS", str(folder)) for arg in TRIXIE_DEBOOTSTRAP], timeout=1800)

    why = None if is_root() else "building the trixie rootfs needs root (debootstrap); run .ci/run as root once"
    if why is None and which("debootstrap") is None:
        why = "building the trixie rootfs needs debootstrap (Debian package; .ci/run installs it)"
    return cached("trixie-rootfs", trixie_stamp(), build, cannot_build=why)


def busybox_rootfs() -> Path:
    """A shell-only root filesystem: Debian's static busybox with its applets as symlinks
    (``/bin/sh`` is busybox ash), /etc/passwd and /etc/group, no bash and no python."""
    skip_unless_tools("apt-get", "dpkg-deb")

    def build(root: Path) -> None:
        download = _scratch(root, "download")
        try:
            done = subprocess.run(["apt-get", "download", "busybox-static"], cwd=download,
                                  capture_output=True, text=True, timeout=300)
            debs = list(download.glob("busybox-static_*.deb"))
            if done.returncode != 0 or not debs:
                pytest.skip(f"apt-get download busybox-static failed (no Debian mirror?): {done.stderr.strip()}")
            run(["dpkg-deb", "-x", str(debs[0]), str(root)])
        finally:
            remove_tree(download)
        remove_tree(root / "usr" / "share")  # docs only
        # --list-full gives each applet's usual place (bin/sh, usr/bin/env, sbin/...).
        for applet in run([str(root / "bin" / "busybox"), "--list-full"]).split():
            link = root / applet
            if applet != "bin/busybox" and not os.path.lexists(link):
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(os.path.relpath(root / "bin" / "busybox", link.parent))
        (root / "etc").mkdir(exist_ok=True)
        (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n")
        (root / "etc" / "group").write_text("root:x:0:\nnogroup:x:65534:\n")
        for empty, mode in (("tmp", 0o1777), ("root", 0o700), ("dev", 0o755), ("proc", 0o555), ("sys", 0o555)):
            (root / empty).mkdir(exist_ok=True)
            (root / empty).chmod(mode)

    return cached("busybox-rootfs", BUSYBOX_RECIPE, build)


def _index(layout: Path) -> dict:  # the layout's index.json
    return json.loads((layout / "index.json").read_text())


def descriptor(layout: Path, tag: str) -> dict:
    """index.json's descriptor for ``tag``."""
    for entry in _index(layout)["manifests"]:
        if entry.get("annotations", {}).get(REF_NAME) == tag:
            return entry
    raise KeyError(f"no tag {tag!r} in {layout}")


def read_blob(layout: Path, digest: str) -> bytes:
    return (layout / "blobs" / "sha256" / digest.removeprefix("sha256:")).read_bytes()


def manifest(layout: Path, tag: str) -> dict:
    """The (single-platform) manifest ``tag`` points to."""
    return json.loads(read_blob(layout, descriptor(layout, tag)["digest"]))


def _write_blob(layout: Path, data: bytes) -> tuple[str, int]:
    digest = "sha256:" + sha256(data).hexdigest()
    (layout / "blobs" / "sha256" / digest.removeprefix("sha256:")).write_bytes(data)
    return digest, len(data)


def _new_image(layout: Path, tag: str) -> None:
    layout.parent.mkdir(parents=True, exist_ok=True)
    if not (layout / "index.json").exists():
        run(["umoci", "init", "--layout", str(layout)])
    run(["umoci", "new", "--image", f"{layout}:{tag}"])


def _scratch(beside: Path, what: str) -> Path:
    """A temporary folder next to ``beside`` whose name extends it: a cache item's scratch
    (``.NAME.XXX.tmp.what-YYY.tmp``) matches the leftover pattern of its build."""
    return Path(tempfile.mkdtemp(prefix=f"{beside.name}.{what}-", suffix=".tmp", dir=beside.parent))


@contextmanager
def edit_image(layout: Path, tag: str) -> Iterator[Path]:
    """Yields the unpacked rootfs of ``layout:tag``; what the block changes (adds, deletes)
    becomes one new layer (``umoci repack``) when it ends without error."""
    skip_unless_tools("umoci")
    work = _scratch(layout, "umoci")
    bundle = work / "bundle"
    try:
        run(["umoci", "unpack", *([] if is_root() else ["--rootless"]), "--image", f"{layout}:{tag}",
             str(bundle)])
        yield bundle / "rootfs"
        run(["umoci", "repack", "--image", f"{layout}:{tag}", str(bundle)])
    finally:
        remove_tree(work)


def configure(layout: Path, tag: str, *, env: Sequence[str] | Mapping[str, str] | None = None,
              workdir: str | None = None, user: str | None = None, cmd: Sequence[str] | None = None,
              entrypoint: Sequence[str] | None = None, arch: str | None = None) -> None:
    """``umoci config``: only the fields given change (env entries are added)."""
    items = [f"{k}={v}" for k, v in env.items()] if isinstance(env, Mapping) else list(env or ())
    args = [arg for item in items for arg in ("--config.env", item)]
    args += ["--config.workingdir", workdir] if workdir else []
    args += ["--config.user", user] if user else []
    args += [arg for item in cmd or () for arg in ("--config.cmd", item)]
    args += [arg for item in entrypoint or () for arg in ("--config.entrypoint", item)]
    args += ["--architecture", arch, "--os", "linux"] if arch else []
    if args:
        run(["umoci", "config", "--image", f"{layout}:{tag}", *args])


def oci_from_rootfs(rootfs: Path, layout: Path, tag: str, *, env: Sequence[str] | Mapping[str, str] = DEFAULT_ENV,
                    workdir: str | None = None, user: str | None = None, cmd: Sequence[str] | None = None,
                    entrypoint: Sequence[str] | None = None, arch: str | None = None,
                    keep_dev: bool = False) -> str:
    """A one-layer image of ``rootfs`` tagged ``tag`` in ``layout`` (made if missing);
    ``oci:LAYOUT:TAG``. /dev's entries are left out unless ``keep_dev``: real images ship
    an empty /dev (the runtime mounts one) and device nodes need root to extract. An
    ordinary user can only pack a rootfs it can read (not trixie's /etc/shadow)."""
    skip_unless_tools("umoci", "cp")
    _new_image(layout, tag)
    with edit_image(layout, tag) as target:
        run(["cp", "-a", f"{rootfs}/.", f"{target}/"])
        if not keep_dev and (target / "dev").is_dir():
            for entry in (target / "dev").iterdir():
                remove_tree(entry)
    configure(layout, tag, env=env, workdir=workdir, user=user, cmd=cmd, entrypoint=entrypoint, arch=arch)
    return f"oci:{layout}:{tag}"


def _files_image(layout: Path, tag: str, files: Mapping[str, bytes], base: Path | None, **config) -> None:
    """``base`` (if any) as a first layer, then ``files`` (path inside -> content) as one."""
    if base is not None:
        oci_from_rootfs(base, layout, tag, **config)
    else:
        _new_image(layout, tag)
        configure(layout, tag, **config)
    with edit_image(layout, tag) as root:
        for name, content in files.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes(content)


def _opaque_layer(path: Path) -> None:
    """A layer that replaces fixture/opaque: its dir, the opaque marker, one new file."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, content in (("fixture", None), ("fixture/opaque", None), ("fixture/opaque/.wh..wh..opq", b""),
                              ("fixture/opaque/new.txt", b"new in layer 3\n")):
            info = tarfile.TarInfo(name)
            info.mtime, info.mode, info.size = 1_700_000_000, 0o644, len(content or b"")
            if content is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info, io.BytesIO(content) if content is not None else None)


def layered_with_whiteouts(layout: Path, tag: str, *, base: Path | None = None) -> str:
    """An image whose later layers delete what earlier ones made; ``oci:LAYOUT:TAG``.

    Layers: [``base``, if given,] files under /fixture; deletions by ``umoci repack``
    (``fixture/.wh.gone.txt``, ``fixture/emptied/.wh.a`` and ``.wh.b``, ``fixture/.wh.removed``);
    an opaque ``fixture/opaque/.wh..wh..opq`` layer. :data:`WHITEOUT_VISIBLE` and
    :data:`WHITEOUT_HIDDEN` say what the result must show and hide."""
    files = {"fixture/keep.txt": b"kept\n", "fixture/gone.txt": b"deleted in layer 2\n",
             "fixture/emptied/a": b"a\n", "fixture/emptied/b": b"b\n", "fixture/removed/x": b"x\n",
             "fixture/opaque/old1": b"old\n", "fixture/opaque/old2": b"old\n"}
    _files_image(layout, tag, files, base)
    with edit_image(layout, tag) as root:
        (root / "fixture" / "gone.txt").unlink()
        for entry in (root / "fixture" / "emptied").iterdir():
            entry.unlink()
        remove_tree(root / "fixture" / "removed")
    work = _scratch(layout, "opaque")
    try:
        _opaque_layer(work / "layer.tar")
        run(["umoci", "raw", "add-layer", "--image", f"{layout}:{tag}", str(work / "layer.tar")])
    finally:
        remove_tree(work)
    return f"oci:{layout}:{tag}"


def _cached_layout(name: str, key: str, rootfs: Callable[[], Path], tag: str, why: str | None,
                   extra: Callable[[Path], None] | None = None, **config) -> str:
    def build(layout: Path) -> None:
        source = rootfs()
        staging = _scratch(layout, "rootfs")
        try:
            if extra:  # a copy to add to: the cached rootfs stays as it is
                run(["cp", "-a", f"{source}/.", f"{staging}/"])
                extra(staging)
                source = staging
            layout.rmdir()  # umoci init wants to make it
            oci_from_rootfs(source, layout, tag, **config)
            run(["chmod", "-R", "a+rX", str(layout)])  # umoci writes blobs 0600
        finally:
            remove_tree(staging)

    return f"oci:{cached(name, key, build, cannot_build=why)}:{tag}"


def _random_data(rootfs: Path) -> None:
    """28 files of 1 MiB that no compressor shrinks, the same bytes every build."""
    generator = random.Random(20240601)
    (rootfs / "data").mkdir()
    for number in range(28):
        (rootfs / "data" / f"blob-{number:02d}").write_bytes(generator.randbytes(1 << 20))


def tiny_image_30mb() -> str:
    """A ~30 MB busybox image (28 MiB of incompressible data): ``oci:CACHED:tiny``."""
    return _cached_layout("tiny-30mb", TINY_RECIPE + "\n" + BUSYBOX_RECIPE, busybox_rootfs, "tiny", None,
                          _random_data, cmd=["/bin/sh"])


def trixie_image() -> str:
    """The trixie rootfs as a one-layer image (~118 MB gzip): ``oci:CACHED:trixie``."""
    why = None if is_root() else "packing the trixie rootfs needs root (it holds files only root reads)"
    return _cached_layout("trixie-layout", TRIXIE_LAYOUT_RECIPE + "\n" + trixie_stamp(), trixie_rootfs,
                          "trixie", why, cmd=["/bin/bash"])


# Indexes, archives and re-compressed copies (tests/helpers/image_variants.py), importable
# from here as before.
from image_variants import (docker_archive, layer_members, multi_platform_index, oci_archive,  # noqa: E402
                            other_platform_only, zstd_copy)

REEXPORTED = (docker_archive, layer_members, multi_platform_index, oci_archive, other_platform_only, zstd_copy)


ONE_TASK_TEST = "grep -q one /app/x && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n"


def busybox_task_folder(root: Path, tag: str, tests: Mapping[str, str] | None = None):
    """A store (``root/store``) holding the busybox image as ``test/busybox:TAG`` and a tasks
    folder (``root/tasks``) of tasks on it, ``{name: test.sh}`` (default: ``ck``, write
    ``one`` to ``/app/x``, whose solution does). Returns ``(tasks folder, ImageSettings)``."""
    from sequester.images import ImageSettings, ImageStore

    skip_unless_tools("skopeo")
    images = ImageSettings(store_dir=root / "store", source="prebuilt")
    ImageStore(images).import_source(str(busybox_rootfs()), f"test/busybox:{tag}")
    for name, test_sh in (tests or {"ck": ONE_TASK_TEST}).items():
        task = root / "tasks" / name
        for sub in ("tests", "environment", "solution"):
            (task / sub).mkdir(parents=True)
        (task / "instruction.md").write_text(f"Task {name}: write one to /app/x.\n")
        (task / "task.toml").write_text('version = "1.0"\n[verifier]\ntimeout_sec = 60\n[environment]\n'
                                        f'docker_image = "test/busybox:{tag}"\nworkdir = "/app"\n')
        (task / "environment" / "Dockerfile").write_text("FROM scratch\n")
        (task / "tests" / "test.sh").write_text(test_sh)
        (task / "solution" / "solve.sh").write_text("echo one > /app/x\n")
    return root / "tasks", images
