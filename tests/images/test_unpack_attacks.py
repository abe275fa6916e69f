"""Hostile layer members refused by :mod:`sequester.images.unpack`, with nothing left behind and
nothing outside touched: names that escape, writes and hard links through symbolic links,
whiteouts used as folders, unknown entry types, and a rename that never replaces."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from layer_tars import entry, refused, tar_bytes, unpack


@pytest.mark.parametrize("name,escape", [
    ("../escape", "escape"), ("/abs/../../x", "x"), ("a/../../b", "b"), ("a//b", None),
    ("./a/./b", None), (".wh...", None), ("d/.wh..", None), (".", None),
])
def test_hostile_names(tmp_path: Path, name: str, escape: str | None) -> None:
    (tmp_path / "canary").write_text("still here")
    refused(tmp_path, tar_bytes([entry("d/ok", data=b"ok"), entry(name, data=b"evil")]), "member")
    assert (tmp_path / "canary").read_text() == "still here"   # ".wh..." must not remove dest's parent
    if escape:
        assert not os.path.lexists(tmp_path / escape) and not os.path.lexists(tmp_path.parent / escape)


@pytest.mark.parametrize("target,then", [("OUTSIDE", "evil/file"), ("..", "evil/x"), ("d", "evil/sub/x")])
def test_writing_through_a_symlink_is_refused(tmp_path: Path, target: str, then: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    link = str(outside) if target == "OUTSIDE" else target
    layer = tar_bytes([entry("d", "dir"), entry("evil", "sym", link=link), entry(then, data=b"pwned")])
    refused(tmp_path, layer, "parent evil is a symbolic link")
    assert list(outside.iterdir()) == [] and not os.path.lexists(tmp_path / "x")


def test_a_later_member_replaces_a_symlink_never_writes_through(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "target").write_text("original")
    stats, out = unpack(tmp_path, [
        entry("x", "sym", link=str(outside / "target")), entry("x", data=b"new"),
        entry("d", "sym", link=str(outside)), entry("d", "dir", mode=0o755), entry("d/f", data=b"in d"),
        entry("h", "sym", link=str(outside / "target")), entry("h", "link", link="x"),
        entry("r", "dir"), entry("r/sub/f", data=b"gone"), entry("r", data=b"a file now"), entry("q/f", data=b"q"),
    ])
    assert (out / "r").read_bytes() == b"a file now" and (out / "q/f").read_bytes() == b"q"
    assert (outside / "target").read_text() == "original" and sorted(os.listdir(outside)) == ["target"]
    assert stat.S_ISREG(os.lstat(out / "x").st_mode) and (out / "x").read_bytes() == b"new"
    assert stat.S_ISDIR(os.lstat(out / "d").st_mode) and (out / "d/f").read_bytes() == b"in d"
    assert os.lstat(out / "h").st_ino == os.lstat(out / "x").st_ino


@pytest.mark.parametrize("target", ["/etc/passwd", "../../x", "sym", "d", "missing", "sym/f"])
def test_hard_link_outside_the_layer_is_refused(tmp_path: Path, target: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f").write_text("host file")
    before = os.stat("/etc/passwd").st_nlink
    layer = tar_bytes([entry("d", "dir"), entry("sym", "sym", link=str(outside)),
                       entry("etc/other", data=b"x"), entry("h", "link", link=target)])
    refused(tmp_path, layer, "hard link|symbolic link|not an allowed")
    assert os.stat("/etc/passwd").st_nlink == before and os.stat(outside / "f").st_nlink == 1


def test_whiteout_used_as_a_folder_and_unknown_types_are_refused(tmp_path: Path) -> None:
    refused(tmp_path, tar_bytes([entry(".wh.d/x", data=b"x")]), "whiteout used as a folder")
    odd = entry("odd", data=b"")
    odd[0].type = b"Z"
    refused(tmp_path, tar_bytes([odd]), "unsupported tar entry type")
    stats, out = unpack(tmp_path, [entry(".wh..wh.plnk", "dir"), entry(".wh..wh.plnk/1.2", data=b"")])
    assert stats.entries == 2 and os.listdir(out) == []   # aufs bookkeeping is never content


def test_rename_never_replaces_an_empty_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The folder appears between the check and the rename (simulated: the check is blind)."""
    from sequester.sandbox.rename import rename_noreplace
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours/f").write_text("ours")
    (tmp_path / "theirs").mkdir()
    monkeypatch.setattr(os.path, "lexists", lambda path: False)
    assert rename_noreplace(tmp_path / "ours", tmp_path / "theirs") is False
    assert os.listdir(tmp_path / "theirs") == [] and (tmp_path / "ours/f").exists()
