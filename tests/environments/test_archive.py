"""A tar made inside an episode, unpacked on the host (:mod:`sequester.environments.archive`):
nothing lands outside the folder, no link leads out, the host's own files stay, the count is bounded."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from sequester.environments.archive import reroot, unpack


def tar_of(*members: tuple[str, str, bytes | str]) -> bytes:
    """``(kind, name, data or link target)``: kind ``f`` (file), ``d`` (folder), ``l`` (symlink), ``h`` (hard link)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for kind, name, data in members:
            info = tarfile.TarInfo(name)
            if kind == "f":
                payload = data if isinstance(data, bytes) else data.encode()
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
                continue
            info.type = {"d": tarfile.DIRTYPE, "l": tarfile.SYMTYPE, "h": tarfile.LNKTYPE}[kind]
            if kind in "lh":
                info.linkname = str(data)
            tar.addfile(info)
    return out.getvalue()


def test_nothing_lands_outside_and_no_link_leads_out(tmp_path: Path):
    dest, outside = tmp_path / "dest", tmp_path / "outside"
    data = tar_of(("f", "../outside", "x"), ("f", "/abs", "x"), ("l", "up", "../../"), ("l", "etc", "/etc"),
                  ("f", "ok/file.txt", "fine"), ("h", "hard", "/etc/passwd"), ("l", "inside", "ok/file.txt"))
    notes = unpack(data, dest)
    assert not outside.exists() and not (tmp_path / "abs").exists()
    assert (dest / "ok" / "file.txt").read_text() == "fine"
    assert (dest / "inside").is_symlink()
    assert not (dest / "up").exists() and not (dest / "etc").exists() and not (dest / "hard").exists()
    assert notes and "not kept" in notes[0]


def test_the_hosts_own_files_stay(tmp_path: Path):
    (tmp_path / "commands.jsonl").write_text("ours\n")
    notes = unpack(tar_of(("f", "commands.jsonl", "forged"), ("f", "log.txt", "agent's")), tmp_path,
                   skip=lambda name: name == "commands.jsonl")
    assert (tmp_path / "commands.jsonl").read_text() == "ours\n" and (tmp_path / "log.txt").read_text() == "agent's"
    assert notes == ["not kept: commands.jsonl"]


def test_the_number_of_entries_is_bounded(tmp_path: Path):
    notes = unpack(tar_of(*(("f", f"f{i}", "") for i in range(30))), tmp_path / "d", limit=10)
    assert len(list((tmp_path / "d").iterdir())) == 10 and "first 10 entries" in notes[0]


def test_an_empty_folder_makes_nothing(tmp_path: Path):
    assert unpack(tar_of(), tmp_path / "d") == [] and not (tmp_path / "d").exists()


def test_reroot_takes_the_folders_members_relative_to_it():
    data = tar_of(("d", "logs/agent", ""), ("f", "logs/agent/a", "1"), ("f", "logs/other", "2"), ("f", "logs/agentx", "3"))
    with tarfile.open(fileobj=io.BytesIO(reroot(data, "/logs/agent"))) as tar:
        assert tar.getnames() == ["a"]


def test_no_chain_of_links_leads_out(tmp_path: Path):
    """Red team: "up -> ." made "up/.." look like the folder itself while pointing above it;
    a chain of real folders and such links reached any host path."""
    dest = tmp_path / "dest"
    deep = "/".join(["d"] * 4)
    data = tar_of(("d", deep, ""), ("l", "up", "."), ("l", "esc", "up/../../x"), ("l", f"{deep}/top", "../../../.."),
                  ("l", "far", f"{deep}/top/../secret"), ("l", "ok", "d/d"))
    notes = unpack(data, dest)
    kept = sorted(p.name for p in dest.rglob("*") if p.is_symlink())
    assert kept == ["ok", "up"], kept  # only downward links
    for p in dest.rglob("*"):
        assert str(p.resolve()).startswith(str(dest.resolve())), p
    assert "does not point downward" in notes[0]
