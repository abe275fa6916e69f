"""Task and trial archives (:mod:`sequester.cluster.bundles`), without a cluster: a task
travels whole and unpacks once into a node's cache, archives cannot carry what they must
not, trial folders come back within their limit, and unused tasks are evicted."""

from __future__ import annotations

import dataclasses
import fcntl
import io
import os
import tarfile
import threading
import time
from pathlib import Path

import pytest
from paths import EXAMPLES

from sequester.cluster import bundles
from sequester.cluster.bundles import (evict_unused, pack_folder, pack_task, task_on_node, unpack_folder,
                                       unpack_task)
from sequester.errors import PolicyError


def tree(root: Path) -> dict[str, bytes | str]:
    out: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        out[rel] = f"-> {os.readlink(path)}" if path.is_symlink() else (path.read_bytes() if path.is_file() else "/")
    return out


def test_a_task_travels_whole_and_unpacks_once(tmp_path: Path) -> None:
    task = EXAMPLES / "python-csv-stats"
    bundle = pack_task(task)
    assert bundle.name == task.name and pack_task(task).digest == bundle.digest, "the archive is reproducible"
    first = unpack_task(bundle, tmp_path / "cache")
    assert tree(first) == tree(task)
    assert (first / "solution" / "solve.sh").stat().st_mode & 0o111, "modes travel"
    marker = first / "marker"
    marker.write_text("x")
    assert unpack_task(bundle, tmp_path / "cache") == first and marker.exists(), "unpacked once"
    assert not [n for n in os.listdir(tmp_path / "cache") if n.startswith(".unpack-")]


def test_a_worker_waits_for_a_task_another_lands_and_holds(tmp_path: Path) -> None:
    """Two workers of one node: the first lands the task and holds its lock shared for
    as long as its trials run; the second, which saw the task missing, gets the task as
    soon as it is there rather than waiting for the first one's trials to end."""
    cache, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    bundle = pack_task(EXAMPLES / "python-csv-stats")
    cache.mkdir()
    held = os.open(cache / f".{bundle.digest}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(held, fcntl.LOCK_SH)  # the first worker, unpacking and then using the task
        got: list[Path] = []
        second = threading.Thread(target=lambda: got.append(unpack_task(bundle, cache)), daemon=True)
        second.start()
        time.sleep(0.3)
        assert not got, "the task is not there yet"
        unpack_task(bundle, elsewhere)
        os.rename(elsewhere / bundle.digest, cache / bundle.digest)  # landed; still held
        second.join(10)
        assert got == [cache / bundle.digest / bundle.name], "the second worker is still waiting"
    finally:
        os.close(held)


def test_two_tasks_of_one_content_under_two_names_are_two_entries(tmp_path: Path) -> None:
    import shutil

    shutil.copytree(EXAMPLES / "python-csv-stats", tmp_path / "copy")
    original, copy = pack_task(EXAMPLES / "python-csv-stats"), pack_task(tmp_path / "copy")
    assert original.data == copy.data and original.digest != copy.digest
    assert unpack_task(original, tmp_path / "c").name == "python-csv-stats"
    assert unpack_task(copy, tmp_path / "c").name == "copy"


def test_a_task_archive_cannot_carry_what_it_must_not(tmp_path: Path) -> None:
    task = tmp_path / "t"
    task.mkdir()
    (task / "inside").write_text("x")
    (task / "ok").symlink_to("inside")
    assert tree(unpack_task(pack_task(task), tmp_path / "c"))["ok"] == "-> inside"
    (task / "out").symlink_to("/etc/passwd")
    with pytest.raises(PolicyError, match="links out of the task"):
        pack_task(task)
    (task / "out").unlink()
    (task / "up").symlink_to("../../x")
    with pytest.raises(PolicyError, match="links out"):
        pack_task(task)
    (task / "up").unlink()
    os.mkfifo(task / "fifo")
    with pytest.raises(PolicyError, match="not a file, folder or link"):
        pack_task(task)


def test_a_task_too_large_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    task = tmp_path / "t"
    task.mkdir()
    (task / "big").write_bytes(b"x" * 2000)
    monkeypatch.setattr(bundles, "MAX_TASK_BYTES", 1000)
    with pytest.raises(PolicyError, match="too large"):
        pack_task(task)


def test_a_tampered_archive_is_refused(tmp_path: Path) -> None:
    bundle = pack_task(EXAMPLES / "python-csv-stats")
    middle = len(bundle.data) // 2
    forged = dataclasses.replace(bundle, data=bundle.data[:middle] + bytes([bundle.data[middle] ^ 1])
                                 + bundle.data[middle + 1:])
    with pytest.raises(PolicyError, match="does not match its digest"):
        unpack_task(forged, tmp_path)
    assert os.listdir(tmp_path) == [f".{bundle.digest}.lock"]


def _archive(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.type, info.linkname = kind, link
        tar.addfile(info, io.BytesIO(b""))
    return buffer.getvalue()


@pytest.mark.parametrize("filtered", [True, False], ids=["data-filter", "python-without-it"])
@pytest.mark.parametrize("name,kind,link", [("../escape", tarfile.REGTYPE, ""), ("/abs", tarfile.REGTYPE, ""),
                                            ("a/../../b", tarfile.REGTYPE, ""), ("l", tarfile.SYMTYPE, "/etc"),
                                            ("l", tarfile.SYMTYPE, "../../x"), ("h", tarfile.LNKTYPE, "/etc/passwd"),
                                            ("dev", tarfile.CHRTYPE, ""), ("fifo", tarfile.FIFOTYPE, "")])
def test_a_trial_archive_cannot_write_outside_its_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         filtered: bool, name: str, kind: bytes, link: str) -> None:
    if not filtered:  # Python before 3.11.4 (Debian 12's 3.11.2): our own checks alone
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    with pytest.raises(PolicyError):
        unpack_folder(_archive(name, kind, link), tmp_path / "trial")
    assert not (tmp_path / "trial").exists() and os.listdir(tmp_path) == []


def test_a_trial_folder_ships_its_result_first_and_at_most_the_limit(tmp_path: Path) -> None:
    trial = tmp_path / "trial"
    (trial / "agent").mkdir(parents=True)
    (trial / "result.json").write_text("{}")
    (trial / "config.json").write_text("{}")
    (trial / "agent" / "a.log").write_bytes(b"a" * 600)
    (trial / "agent" / "b.log").write_bytes(b"b" * 600)
    (trial / "link").symlink_to("/etc/passwd")
    data, left_out = pack_folder(trial, limit=1000)
    assert left_out == ["agent/b.log", "link"], "over the limit, and never a link"
    unpack_folder(data, tmp_path / "back")
    assert set(tree(tmp_path / "back")) == {"agent", "agent/a.log", "config.json", "result.json"}


def test_a_used_task_is_kept_and_an_unused_one_evicted(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    old, used = pack_task(EXAMPLES / "python-csv-stats"), pack_task(EXAMPLES / "c-word-count")
    unpack_task(old, cache)
    long_ago = time.time() - 30 * 86400
    with task_on_node(used, cache) as folder:
        os.utime(cache / old.digest, (long_ago, long_ago))
        os.utime(cache / used.digest, (long_ago, long_ago))
        assert evict_unused(cache) == [old.digest], "held by a trial: kept"
        assert folder.is_dir()
    assert not (cache / old.digest).exists()
    with task_on_node(old, cache) as folder:  # evicted: unpacked again
        assert (folder / "task.toml").is_file()
    assert evict_unused(cache) == [used.digest], "old: just used; used: backdated, no longer held"


def test_eviction_leaves_no_lock_and_sweeps_a_killed_unpack(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    bundle = pack_task(EXAMPLES / "python-csv-stats")
    unpack_task(bundle, cache)
    stale, fresh = cache / ".unpack-old", cache / ".unpack-new"
    stale.mkdir()
    fresh.mkdir()
    long_ago = time.time() - 30 * 86400
    for path in (cache / bundle.digest, stale):
        os.utime(path, (long_ago, long_ago))
    assert evict_unused(cache) == [bundle.digest]
    assert sorted(os.listdir(cache)) == [".unpack-new"], "no lock file left, the killed unpack swept"


