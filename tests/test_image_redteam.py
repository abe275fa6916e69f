"""Red team of episodes on an image: attacks by the agent, by a hostile image, by a hostile
layer tar. Each test is an attack that passes only while the protection holds.

The five found broken when written, since fixed, are in test_image_redteam_fixed.py;
these held. Images are busybox (no bash, no Python): the agent's tools are busybox and
the runner's own programs at /opt/sequester-verifier, which it may run like any program.
"""

from __future__ import annotations

import io
import os
import shutil
import stat
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from images import busybox_rootfs, oci_from_rootfs
from registry import skip_unless_tools
from tasks import make_task

from sequester.environments.local.episode import Episode
from sequester.sandbox.remove import remove_tree
from sequester.environments.settings import EpisodeSettings
from sequester.environments.verdict import VerifierError, VerifierResult
from sequester.errors import ImageError
from sequester.images import ImageSettings, ImageStore
from sequester.images.unpack import unpack_layer

PY = "/opt/sequester-verifier/bin/python3"  # the runner's Python: in every view, usable by the agent
WORK_TEST = ('test "$(cat /app/out.txt 2>/dev/null)" = hello && echo 1 > /logs/verifier/reward.txt '
             '|| echo 0 > /logs/verifier/reward.txt\n')
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="the agent is host uid 0 only when sequester runs as root")


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Iterator[ImageSettings]:
    skip_unless_tools("skopeo")
    root = tmp_path_factory.mktemp("redteam-store")
    settings = ImageSettings(store_dir=root / "store", source="prebuilt")
    ImageStore(settings).import_source(str(busybox_rootfs()), "test/bb:1")
    yield settings
    remove_tree(root)


def _task(root: Path, test_sh: str = WORK_TEST, image: str = "test/bb:1", name: str = "t") -> Path:
    toml = f'[environment]\ndocker_image = "{image}"\nworkdir = "/app"\n'
    return make_task(root, name, test_sh, toml=toml, dockerfile="FROM scratch\n")


def _episode(settings: ImageSettings, **kw) -> Episode:
    return Episode(EpisodeSettings(images=settings, **kw))


def _verdict(ep: Episode) -> VerifierResult:
    """A verdict: any VerifierError (a voided trial) fails the test."""
    try:
        return ep.evaluate()
    except VerifierError as exc:
        pytest.fail(f"the agent voided its verdict: {type(exc).__name__}: {exc}")


def _snapshot(layer: Path) -> dict[str, tuple]:
    """Everything of a layer folder an attack could change (metadata, xattrs, content)."""
    seen = {}
    for folder, dirs, files in os.walk(layer):
        for name in [".", *dirs, *files]:
            path = os.path.join(folder, name)
            st = os.lstat(path)
            data = open(path, "rb").read() if os.path.isfile(path) and not os.path.islink(path) else b""
            xattrs = sorted(os.listxattr(path, follow_symlinks=False))
            seen[os.path.relpath(path, layer)] = (st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_mtime_ns,
                                                  st.st_nlink, st.st_ino, xattrs, data)
    return seen


# -- held ----------------------------------------------------------------------------


def test_signals_to_pid1_change_nothing(tmp_path, store):
    """The init (the runner's bash) ignores every signal the agent may send."""
    with _episode(store) as ep:
        ep.reset(_task(tmp_path))
        out = ep.exec("echo hello > /app/out.txt; for s in KILL TERM INT HUP QUIT USR1 USR2 CHLD PIPE ALRM; do "
                      "kill -$s 1; done; sleep 0.5; cat /proc/1/comm", timeout=20).stdout
        assert out.strip().endswith("bash"), out
        assert ep.exec("echo still").stdout.strip() == "still"
        assert _verdict(ep).reward == 1.0


def test_writes_never_reach_the_store_or_another_episode(tmp_path, store):
    """Copy-up everywhere: links, metadata, xattrs of overlay's own names, whiteouts,
    reopening through /proc, deletions. The store's layer stays byte-identical and a
    concurrent episode on the image sees it as it is, unlocked."""
    image_store = ImageStore(store)
    lease = image_store.lease(image_store.find("test/bb:1"))
    lease.release()
    layer = lease.layers[0]
    before = _snapshot(layer)
    task = _task(tmp_path)
    with _episode(store) as a, _episode(store) as b:
        a.reset(task)
        b.reset(task)
        r = a.exec(f"""
ln /bin/busybox /bin/bb2 && echo garbage >> /bin/bb2
chmod 000 /etc/passwd; chown 7:7 /etc/group; touch -d 2001-01-01 /root /etc
exec 3</etc/group; echo via-fd > /proc/self/fd/3; exec 3<&-
echo evil >> /etc/passwd 2>/dev/null; chmod 644 /etc/passwd; echo evil >> /etc/passwd
mknod /usr/.wh-test c 0 0; ln /etc/passwd /app/pw 2>/dev/null && echo CROSS_LINK
ls /proc/1/root/oldroot 2>/dev/null && echo OLDROOT
{PY} -c "
import fcntl, os, time
for p, n in (('/usr/bin', 'user.overlay.opaque'), ('/etc/group', 'user.overlay.redirect'), ('/sbin', 'user.x')):
    os.setxattr(p, n, b'y')
f = open('/etc/shadow-none', 'w'); g = open('/bin/busybox'); fcntl.flock(g, fcntl.LOCK_EX)
if os.fork() == 0:
    time.sleep(60)
"
rm -rf /usr/bin/* /sbin/*; echo done""", timeout=30)
        assert r.stdout.strip().endswith("done") and "CROSS_LINK" not in r.stdout and "OLDROOT" not in r.stdout, r
        seen = b.exec(f"grep -c evil /etc/passwd; ls /usr/bin | wc -l; ls -l /etc/group | cut -c1-10; {PY} -c \""
                      "import fcntl; fcntl.flock(open('/bin/busybox'), fcntl.LOCK_EX | fcntl.LOCK_NB); print('free')\"")
        mode = stat.filemode(os.stat(layer / "etc" / "group").st_mode)
        assert seen.stdout.split() == ["0", str(len(os.listdir(layer / "usr" / "bin"))), mode, "free"], seen
    assert _snapshot(layer) == before


def test_moving_the_runner_away_is_the_agents_zero_not_an_error(tmp_path, store):
    """/opt holds the runner's mount point and can be renamed; a fake runner in its place
    (its bash a script for the image's static busybox) must make the verifier fail
    closed, and the pristine re-run must call that the agent's 0."""
    fake = "#!/bin/busybox sh\necho 1 > /logs/verifier/reward.txt\n"
    with _episode(store) as ep:
        ep.reset(_task(tmp_path))
        r = ep.exec("mv /opt /opt2 && mkdir -p /opt/sequester-verifier/bin /opt/sequester-verifier/run && echo moved")
        assert "moved" in r.stdout
        ep.write_file("/opt/sequester-verifier/bin/bash", fake, mode=0o755)
        result = _verdict(ep)
        assert result.reward == 0.0 and "pristine environment does not fail that way" in result.zero_reason


def test_agents_shells_never_run_in_the_verifier(tmp_path, store):
    """/bin/sh, ls, dash, env replaced by programs that forge a reward: the verifier's
    names are the runner's."""
    fake = "#!/opt/sequester-verifier/bin/bash\necho 1 > /logs/verifier/reward.txt\nexit 0\n"
    test_sh = ('if /bin/sh -c "exit 3" || /bin/ls /no-such-file || /bin/env false; then echo 1; else echo 0; fi '
               '> /logs/verifier/reward.txt\n')
    with _episode(store) as ep:
        ep.reset(_task(tmp_path, test_sh))
        for name in ("/bin/sh", "/bin/ls", "/bin/dash", "/bin/env", "/usr/bin/env"):
            ep.exec(f"rm -f {name}")
            ep.write_file(name, fake, mode=0o755)
        assert ep.exec("/bin/sh -c 'exit 3'; echo $?").stdout.strip() == "0"  # the agent's own sh is the fake
        assert _verdict(ep).reward == 0.0


def _rootfs_image(store: ImageSettings, tmp: Path, tag: str, edit) -> None:
    root = tmp / "rootfs"
    shutil.copytree(busybox_rootfs(), root, symlinks=True)
    try:
        edit(root)
        ImageStore(store).import_source(str(root), tag)
    finally:
        remove_tree(root)


def _odd_names(root: Path) -> None:
    for name in ("a,b", "x:y", "n\nl", "c,upperdir=x", "oldroot", "newroot"):
        (root / name).mkdir()
        (root / name / "f").write_text(name)


def _top_links(root: Path) -> None:
    os.symlink("/oldroot/etc", root / "opt")  # bwrap would follow it out of the new root
    os.symlink("/", root / "tests")
    os.symlink("/oldroot/etc", root / "logs")


@pytest.mark.parametrize("edit", [_odd_names, _top_links], ids=lambda f: f.__name__.strip("_"))
def test_hostile_image_layouts_keep_the_view_and_the_verdict(tmp_path, store, edit):
    tag = f"test/{edit.__name__.strip('_').replace('_', '-')}:1"
    _rootfs_image(store, tmp_path, tag, edit)
    with _episode(store) as ep:
        ep.reset(_task(tmp_path, image=tag))
        out = ep.exec("echo hello > /app/out.txt; ls -A /tests | wc -l; ls -A /logs | wc -l; "
                      "ls /opt/sequester-verifier/bin/bash").stdout
        assert out.split() == ["0", "0", "/opt/sequester-verifier/bin/bash"], out
        assert _verdict(ep).reward == 1.0


def test_image_runner_mount_point_as_a_link_never_reaches_the_host(tmp_path, store):
    """The image's /opt/sequester-verifier is a link into bwrap's old root (the host's
    tree): refused with a clear ImageError before bwrap runs (bwrap would follow it in its
    own mount namespace), and nothing is made or mounted on the host."""
    (tmp_path / "exists").mkdir()
    for i, target in enumerate((f"/oldroot{tmp_path}/made/x", f"/oldroot{tmp_path}/exists", "/oldroot/etc")):
        def edit(root: Path, target=target) -> None:
            (root / "opt").mkdir()
            os.symlink(target, root / "opt" / "sequester-verifier")
        _rootfs_image(store, tmp_path, f"test/runner-link{i}:1", edit)
        try:
            with _episode(store) as ep:
                ep.reset(_task(tmp_path, image=f"test/runner-link{i}:1", name=f"t{i}"))
                bash = "/opt/sequester-verifier/bin/bash"
                assert ep.exec(f"ls {bash}").stdout.strip() == bash
        except ImageError as exc:
            assert "/opt/sequester-verifier, where the verifier's runner is mounted" in str(exc)
        else:
            raise AssertionError("an image holding the runner's mount point was used")
    assert not (tmp_path / "made").exists() and os.listdir(tmp_path / "exists") == []
    assert not os.path.ismount(tmp_path / "exists") and not os.path.ismount("/etc") and not os.path.exists("/etc/ready")


def test_hostile_image_config_is_refused_before_anything_runs(tmp_path, store):
    """A User missing from /etc/passwd (behind a 2 MiB line), more top-level entries than
    planned: a clean ImageError at reset, and no episode left behind."""
    skip_unless_tools("umoci")
    root = tmp_path / "rootfs"
    shutil.copytree(busybox_rootfs(), root, symlinks=True)
    with open(root / "etc" / "passwd", "a") as f:
        f.write("x" * (2 << 20) + ":x:1:1::/:/bin/sh\nbob:x:1000:1000::/home/bob:/bin/sh\n")
    ImageStore(store).import_source(oci_from_rootfs(root, tmp_path / "layout", "u", user="bob"), "test/bob:1")
    for i in range(5000):
        (root / f"top{i}").mkdir()
    ImageStore(store).import_source(str(root), "test/wide:1")
    remove_tree(root)
    state = tmp_path / "state"
    for tag, said in (("test/bob:1", "not in its /etc/passwd"), ("test/wide:1", "top-level entries")):
        with pytest.raises(ImageError, match=said):
            Episode(EpisodeSettings(images=store, state_dir=state)).reset(
                _task(tmp_path, image=tag, name=tag.split("/")[1].split(":")[0]))
    assert not state.exists() or not [p for p in state.iterdir() if p.name[0].isdigit()]


def _member(name: str, kind: str = "file", data: bytes = b"", link: str = "", **pax: str) -> tuple:
    info = tarfile.TarInfo(name)
    info.type = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "sym": tarfile.SYMTYPE, "link": tarfile.LNKTYPE}[kind]
    info.size, info.linkname, info.mode, info.pax_headers = len(data), link, 0o755, pax
    return info, data


def _layer(tmp: Path, members: list) -> Path:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    blob = tmp / f"layer-{len(list(tmp.iterdir()))}"
    blob.write_bytes(buf.getvalue())
    return blob


X = "SCHILY.xattr."
REFUSED_LAYERS = {
    "whiteout-as-folder": [_member(".wh./x", data=b"x")],
    "whiteout-of-nothing": [_member(".wh.")],
    "whiteout-of-parent": [_member("d/.wh...")],
    "opaque-through-link": [_member("l", "sym", link="OUT"), _member("l/.wh..wh..opq")],
    "whiteout-through-link": [_member("l", "sym", link="OUT"), _member("l/.wh.canary")],
    "pax-path-escape": [_member("ok", data=b"x", path="../escaped")],
    "pax-linkpath-escape": [_member("f", data=b"x"), _member("h", "link", linkpath="../canary")],
    "hardlink-through-link": [_member("l", "sym", link="OUT"), _member("h", "link", link="l/canary")],
    "file-through-replaced-dir": [_member("d", "dir"), _member("d", "sym", link="OUT"), _member("d/x", data=b"pwn")],
}


@pytest.mark.parametrize("case", sorted(REFUSED_LAYERS))
def test_layer_tricks_are_refused_and_write_nothing_outside(tmp_path, case):
    out = tmp_path / "outside"
    out.mkdir()
    (out / "canary").write_text("canary")
    members = [(_member(i.name, "sym", link=str(out)) if i.issym() else (i, d)) for i, d in REFUSED_LAYERS[case]]
    with pytest.raises(ImageError, match="member"):
        unpack_layer(_layer(tmp_path, members), tmp_path / "dest")
    assert sorted(os.listdir(out)) == ["canary"] and (out / "canary").read_text() == "canary"
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("layer-")) == ["outside"]


def test_layer_xattrs_never_reach_the_overlay(tmp_path):
    """PAX xattrs (overlay's own user.overlay.*, trusted.*, a file capability) are dropped."""
    blob = _layer(tmp_path, [
        _member("d", "dir", **{X + "user.overlay.opaque": "y", X + "trusted.overlay.opaque": "y"}),
        _member("d/f", data=b"x", **{X + "user.overlay.redirect": "/etc", X + "user.overlay.metacopy": "",
                                     X + "security.capability": "\x01\x00\x00\x02\xff\xff\xff\xff",
                                     "LIBARCHIVE.xattr.user.overlay.opaque": "eQ=="}),
    ])
    unpack_layer(blob, tmp_path / "dest")
    assert os.listxattr(tmp_path / "dest" / "d") == [] and os.listxattr(tmp_path / "dest" / "d" / "f") == []
