"""The owners of an unpacked layer (:mod:`sequester.images.owners`) and the store's
migration when the id map changes (:mod:`sequester.images.migrate`): real files, real
``lchown``; a hostile layer's links never lead the owners outside the layer."""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from conditions import requires_root

from sequester.images.migrate import parse_tag
from sequester.images.owners import Owners, apply_owners, map_tag, read_owners
from sequester.images.unpack import unpack_layer
from sequester.sandbox.idmap import IdMap

MAP = IdMap(uid=0, gid=0, sub_uid=400000, sub_gid=500000)


def test_only_other_owners_than_root_are_listed_and_the_last_member_wins(tmp_path):
    owners = Owners()
    owners.note(("etc", "shadow"), 0, 42, 0o640)
    owners.note(("usr", "bin", "chage"), 0, 42, 0o2755)  # setgid: set again after the chown
    owners.note(("var", "mail"), 0, 8, None)
    owners.note(("var", "mail"), 0, 0, None)  # the same name, root's again in a later member
    owners.note(("big",), 70000, 0, None)  # no map holds it: left root's, counted
    path = tmp_path / "x.owners"
    owners.write(path)
    assert list(read_owners(path)) == [(("etc", "shadow"), 0, 42, None), (("usr", "bin", "chage"), 0, 42, 0o2755)]
    assert owners.unmapped == 1
    assert list(read_owners(tmp_path / "missing.owners")) == []


def test_map_tags_read_back():
    assert parse_tag(map_tag(MAP)) == MAP
    assert parse_tag(map_tag(None)) is None
    with pytest.raises(ValueError):
        parse_tag("map 1:2")


@requires_root
def test_owners_are_applied_through_the_map_and_never_through_a_link(tmp_path):
    layer, outside = tmp_path / "layer", tmp_path / "outside"
    (layer / "usr" / "bin").mkdir(parents=True)
    outside.mkdir()
    (outside / "victim").write_text("host file")
    (layer / "usr" / "bin" / "chage").write_text("#!/bin/sh\n")
    os.chmod(layer / "usr" / "bin" / "chage", 0o2755)
    (layer / "link").symlink_to(outside)  # a folder link of the layer: entries "below" it are not followed
    (layer / "file-link").symlink_to(outside / "victim")
    owners = Owners()
    owners.note(("usr", "bin", "chage"), 0, 42, 0o2755)
    owners.note(("link", "victim"), 7, 7, None)
    owners.note(("file-link",), 9, 9, None)  # the link itself changes, never its target
    owners.note(("gone",), 5, 5, None)  # replaced later in the layer: skipped
    owners.write(tmp_path / "l.owners")
    done = apply_owners(str(layer), str(tmp_path / "l.owners"), [MAP.uid, MAP.gid, MAP.sub_uid, MAP.sub_gid])
    chage = os.lstat(layer / "usr" / "bin" / "chage")
    assert (chage.st_uid, chage.st_gid, stat.S_IMODE(chage.st_mode)) == (0, 500041, 0o2755)
    assert (os.lstat(layer / "file-link").st_uid, os.lstat(layer / "file-link").st_gid) == (400008, 500008)
    assert os.lstat(outside / "victim").st_uid == 0 and os.lstat(outside).st_uid == 0
    assert done == 2


def _layer(path: Path, members: list[tuple[str, int, int, int, str]]) -> Path:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, uid, gid, mode, kind in members:
            info = tarfile.TarInfo(name)
            info.uid, info.gid, info.mode = uid, gid, mode
            if kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                data = b"content\n"
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    path.write_bytes(buf.getvalue())
    return path


@requires_root
def test_an_unpacked_layer_shows_its_owners_and_lists_them(tmp_path):
    blob = _layer(tmp_path / "layer.tar", [("var", 0, 0, 0o755, "dir"), ("var/mail", 0, 8, 0o2775, "dir"),
                                           ("usr", 0, 0, 0o755, "dir"), ("usr/chage", 0, 42, 0o2755, "file"),
                                           ("home", 0, 0, 0o755, "dir"), ("home/app", 1000, 1000, 0o700, "dir"),
                                           ("huge", 90000, 90000, 0o644, "file")])
    dest, listed = tmp_path / "layers" / "x", tmp_path / "layers" / "x.owners"
    dest.parent.mkdir()
    stats = unpack_layer(blob, dest, owners=listed, ids=MAP)
    assert stats.owned == 3 and stats.unmapped_owners == 1
    seen = {p: (os.lstat(dest / p).st_uid, os.lstat(dest / p).st_gid, stat.S_IMODE(os.lstat(dest / p).st_mode))
            for p in ("var/mail", "usr/chage", "home/app", "huge")}
    assert seen == {"var/mail": (0, 500007, 0o2775), "usr/chage": (0, 500041, 0o2755),
                    "home/app": (400999, 500999, 0o700), "huge": (0, 0, 0o644)}, seen
    assert len(list(read_owners(listed))) == 3


MIGRATE = r'''
import json, logging, sys
from pathlib import Path
from sequester.images import ImageSettings
from sequester.images.store import ImageStore
from sequester.sandbox.idmap import IdMap
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
root, layer, ids = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
store = ImageStore(ImageSettings(store_dir=root), ids=IdMap(*ids) if ids else None)
import fcntl
with store.lock("gc.lock", fcntl.LOCK_SH):  # what a build holds: the migration comes first, never a wait on ourselves
    pass
import os
st = os.lstat(root / "layers" / layer / "home" / "app")
print(json.dumps([st.st_uid, st.st_gid, (root / "ids").read_text().strip()]))
'''


@requires_root
def test_a_store_gives_its_layers_new_owners_when_the_map_changes(tmp_path):
    """Once per process, before any lock of the store is held (a build holds gc.lock
    shared: the migration waiting for it exclusively would wait for itself)."""
    store = tmp_path / "store"
    (store / "layers").mkdir(parents=True)
    blob = _layer(tmp_path / "l.tar", [("home", 0, 0, 0o755, "dir"), ("home/app", 0, 1000, 0o750, "dir")])
    unpack_layer(blob, store / "layers" / "abc", owners=store / "layers" / "abc.owners", ids=MAP)
    (store / "ids").write_text(map_tag(MAP) + "\n")

    def run(ids):
        proc = subprocess.run([sys.executable, "-c", MIGRATE, str(store), "abc", json.dumps(ids)],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout), proc.stderr

    (uid, gid, tag), said = run([0, 0, 400000, 500000])
    assert (uid, gid) == (0, 500999) and said == ""  # the same map: nothing to do, nothing said
    (uid, gid, tag), said = run([0, 0, 600000, 700000])
    assert (uid, gid, tag) == (0, 700999, "map 0:0:600000:700000") and "given their owners" in said
    (uid, gid, tag), said = run(None)  # the caller alone (a range removed)
    assert (uid, gid, tag) == (0, 0, "caller 0:0")


LEGACY = r'''
import fcntl, logging, sys
logging.basicConfig(stream=sys.stderr)
from sequester.images import ImageSettings, ImageStore
store = ImageStore(ImageSettings(store_dir=sys.argv[1]))
before = len(store.records())
with store.lock("gc.lock", fcntl.LOCK_SH):
    pass
print(before, len(store.records()))
'''


@requires_root
def test_a_store_of_an_earlier_sequester_drops_its_images_once_and_says_so(tmp_path):
    """Its layers kept no owners: their images are removed (pulled or built again when
    next used), with a warning, once."""
    from images import busybox_rootfs

    from sequester.images import ImageSettings, ImageStore

    store = tmp_path / "store"
    ImageStore(ImageSettings(store_dir=store, source="prebuilt")).import_source(str(busybox_rootfs()), "test/old:1")
    for listed in (store / "layers").glob("*.owners"):
        listed.unlink()  # what an earlier sequester left: no lists, no ids file
    (store / "ids").unlink()
    runs = [subprocess.run([sys.executable, "-c", LEGACY, str(store)], capture_output=True, text=True, timeout=60)
            for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs
    assert runs[0].stdout.split() == ["1", "0"] and "earlier sequester" in runs[0].stderr, runs[0]
    assert runs[1].stdout.split() == ["0", "0"] and runs[1].stderr == "", runs[1]
    assert not any((store / "layers").iterdir())  # its layers collected


@requires_root
def test_a_layer_with_negative_owners_gives_no_host_id_outside_the_range(tmp_path):
    """Red team: tarfile takes negative ids (a pax ``uid=-N``); through the map they named
    host ids below the range (a real user's, with its setuid bit). They are counted as
    unmapped and left root's."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("evil")
        data = b"#!/bin/sh\n"
        info.size, info.mode = len(data), 0o6755
        info.pax_headers = {"uid": str(-(MAP.sub_uid - 1002 - 1)), "gid": "-5"}
        tar.addfile(info, io.BytesIO(data))
    (tmp_path / "l.tar").write_bytes(buf.getvalue())
    dest = tmp_path / "layers" / "x"
    dest.parent.mkdir()
    stats = unpack_layer(tmp_path / "l.tar", dest, owners=tmp_path / "layers" / "x.owners", ids=MAP)
    st = os.lstat(dest / "evil")
    assert (st.st_uid, st.st_gid) == (0, 0) and stats.unmapped_owners == 1 and stats.owned == 0
    with pytest.raises(ValueError):
        MAP.host_uid(-1)


@requires_root
def test_a_layer_that_cannot_be_owned_costs_its_images_not_the_store(tmp_path):
    """Red team: a hostile list applied when the map changed failed every later use of the
    store. Now that layer's images are removed, with a warning, and the store works."""
    store = tmp_path / "store"
    (store / "layers").mkdir(parents=True)
    blob = _layer(tmp_path / "l.tar", [("home", 0, 0, 0o755, "dir"), ("home/app", 0, 1000, 0o750, "dir")])
    unpack_layer(blob, store / "layers" / "abc", owners=store / "layers" / "abc.owners", ids=MAP)
    with open(store / "layers" / "abc.owners", "a") as f:
        f.write(json.dumps([["home"], -5, 0, None]) + "\n")  # what an older, unchecked list could hold
    (store / "ids").write_text(map_tag(MAP) + "\n")
    proc = subprocess.run([sys.executable, "-c", MIGRATE, str(store), "abc", json.dumps([0, 0, 600000, 700000])],
                          capture_output=True, text=True, timeout=60)
    assert "could not be given their owners" in proc.stderr, proc.stderr
    assert not (store / "layers" / "abc").exists()  # collected with its images
    again = subprocess.run([sys.executable, "-c", LEGACY, str(store)], capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stderr == "", again  # the store serves on
