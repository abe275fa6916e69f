"""Folders as bytes for Ray's object store: a task to the nodes, a trial's folder back.

Nodes share no filesystem with the driver, so a task reaches them as a tar archive put
in the object store once (:func:`pack_task`, :func:`unpack_task`: unpacked once per node
into a cache named by the archive's digest), and a finished trial's folder comes back the
same way (:func:`pack_folder`, :func:`unpack_folder`), for the driver to write the job
folder. Both are bounded: a task larger than ``MAX_TASK_BYTES`` is refused before any
trial starts, and a trial folder ships at most ``MAX_TRIAL_BYTES``, its ``result.json``
and ``config.json`` first, the files left out named (they are what the agent printed or
left: its 0 or its verdict never depends on them).

Only folders and regular files travel (and a task's symlinks that stay inside it):
unpacking goes through :mod:`tarfile`'s ``data`` filter and a name check of our own, so
an archive cannot write outside the folder it is unpacked into.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import os
import shutil
import stat
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from sequester.errors import PolicyError

__all__ = [
    "TaskBundle",
    "pack_task",
    "unpack_task",
    "hold_task",
    "task_on_node",
    "bundle_digest",
    "evict_unused",
    "pack_folder",
    "unpack_folder",
    "MAX_TASK_BYTES",
    "MAX_TRIAL_BYTES",
    "FIRST_FILES",
]

MAX_TASK_BYTES = 1 << 30  # a task's files (environment/, tests/, solution/); TB2's largest is far below
MAX_TRIAL_BYTES = 256 << 20  # what one trial folder ships back to the driver
EVICT_AFTER = 7 * 86400.0  # a node's shipped task not used for this long is removed
STALE_UNPACK = 3600.0  # an unpacking folder this old was left by a killed worker
UNPACK_POLL = 0.05  # seconds between looks while another worker unpacks a task
FIRST_FILES = ("result.json", "config.json", "trial.log")  # shipped before anything else


@dataclass(frozen=True)
class TaskBundle:
    """A task folder as an archive: ``name`` is the folder's name, ``digest`` names both
    (:func:`bundle_digest`)."""

    name: str
    digest: str
    data: bytes


def _entries(root: Path) -> list[tuple[str, Path, os.stat_result]]:
    """Every entry under ``root`` in a fixed order (sorted names), relative names."""
    found: list[tuple[str, Path, os.stat_result]] = []
    stack = [(root, "")]
    while stack:
        folder, prefix = stack.pop()
        for name in sorted(os.listdir(folder), reverse=True):
            path = folder / name
            st = path.lstat()
            rel = f"{prefix}{name}"
            found.append((rel, path, st))
            if stat.S_ISDIR(st.st_mode):
                stack.append((path, f"{rel}/"))
    found.sort(key=lambda item: item[0])
    return found


def _tarinfo(rel: str, st: os.stat_result, kind: bytes, size: int = 0, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(rel)
    info.type, info.size, info.linkname = kind, size, link
    info.mode = stat.S_IMODE(st.st_mode) & 0o755 | (0o700 if kind == tarfile.DIRTYPE else 0o600)
    info.mtime = int(st.st_mtime)  # no owner: the unpacking user owns every file
    return info


def pack_task(folder: Path) -> TaskBundle:
    """``folder`` (a task) as a :class:`TaskBundle`; :class:`PolicyError` naming the file
    for what cannot travel (a device, a socket, a link out of the task, too many bytes)."""
    folder = folder.resolve()
    buffer, total = io.BytesIO(), 0
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel, path, st in _entries(folder):
            if stat.S_ISDIR(st.st_mode):
                tar.addfile(_tarinfo(rel, st, tarfile.DIRTYPE))
            elif stat.S_ISREG(st.st_mode):
                total += st.st_size
                if total > MAX_TASK_BYTES:
                    raise PolicyError(
                        f"task {folder}: more than {MAX_TASK_BYTES >> 20} MiB of files: too large to "
                        "ship to the cluster's nodes"
                    )
                with open(path, "rb") as f:
                    tar.addfile(_tarinfo(rel, st, tarfile.REGTYPE, st.st_size), f)
            elif stat.S_ISLNK(st.st_mode):
                target = os.readlink(path)
                inside = Path(os.path.normpath(path.parent / target))
                if os.path.isabs(target) or not (inside == folder or folder in inside.parents):
                    raise PolicyError(
                        f"task {folder}: {rel} links out of the task ({target!r}): it cannot be shipped "
                        "to the cluster's nodes"
                    )
                tar.addfile(_tarinfo(rel, st, tarfile.SYMTYPE, link=target))
            else:
                raise PolicyError(f"task {folder}: {rel} is not a file, folder or link: it cannot be shipped")
    data = buffer.getvalue()
    return TaskBundle(folder.name, bundle_digest(folder.name, data), data)


def bundle_digest(name: str, data: bytes) -> str:
    """Of the folder's name and its archive: two tasks of one content under two names
    (a copy of a task) are two cache entries (each unpacked under its own name)."""
    return hashlib.sha256(name.encode() + b"\0" + data).hexdigest()


def _check_members(tar: tarfile.TarFile, what: str) -> None:
    """Only folders, regular files and links that stay inside, under plain relative names:
    checked here whatever the Python (``tarfile``'s ``data`` filter, applied as well where
    it exists, came in 3.11.4; Debian 12 has 3.11.2)."""
    for member in tar.getmembers():
        parts = member.name.split("/")
        if member.name.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise PolicyError(f"{what}: the archive names {member.name!r}: refused")
        if member.issym():
            target = os.path.normpath(os.path.join(os.path.dirname(member.name), member.linkname))
            if os.path.isabs(member.linkname) or target == ".." or target.startswith("../"):
                raise PolicyError(f"{what}: {member.name!r} links out of the archive: refused")
        elif not (member.isdir() or member.isreg()):
            raise PolicyError(f"{what}: {member.name!r} is not a file, folder or link: refused")


def _extract(data: bytes, dest: Path, what: str) -> None:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        _check_members(tar, what)
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:  # Python < 3.11.4: the checks above are the filter
            tar.extractall(dest)


def unpack_task(bundle: TaskBundle, cache: Path) -> Path:
    """The task's folder on this node: ``cache/<digest>/<name>``, unpacked the first time
    (into a temporary folder renamed into place, under a lock: concurrent trials of one
    task on a node unpack it once)."""
    final = cache / bundle.digest / bundle.name
    if final.is_dir():
        return final
    cache.mkdir(parents=True, exist_ok=True, mode=0o700)
    with _unpack_lock(cache / f".{bundle.digest}.lock", final) as landed:
        if landed or final.is_dir():
            return final
        if (
            bundle_digest(bundle.name, bundle.data) != bundle.digest
            or "/" in bundle.name
            or bundle.name in ("", ".", "..")
        ):
            raise PolicyError(f"task {bundle.name}: the shipped archive does not match its digest")
        temp = Path(tempfile.mkdtemp(prefix=".unpack-", dir=cache))
        try:
            _extract(bundle.data, temp / bundle.name, f"task {bundle.name}")
            os.rename(temp, cache / bundle.digest)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
    return final


@contextlib.contextmanager
def _unpack_lock(path: Path, final: Path) -> Iterator[bool]:
    """The task's lock held exclusively (yields False), or True as soon as another worker
    has landed ``final``. The exclusive lock is only waited for while ``final`` is missing:
    the worker that landed it holds the same lock shared for as long as its trials use the
    task (:func:`hold_task`), so a blocking wait for it would last as long as they do."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if final.is_dir():
                    yield True
                    return
                time.sleep(UNPACK_POLL)
        yield False
    finally:
        os.close(fd)


def hold_task(bundle: TaskBundle, cache: Path) -> tuple[Path, int]:
    """The task's folder on this node (:func:`unpack_task`) and a file descriptor holding
    it (a shared lock, which :func:`evict_unused` respects) until it is closed; its last
    use noted."""
    path = unpack_task(bundle, cache)
    fd = os.open(cache / f".{bundle.digest}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        if not path.is_dir():  # evicted between the unpack and the lock: unpack again
            os.close(fd)
            return hold_task(bundle, cache)
        os.utime(cache / bundle.digest)
    except BaseException:
        os.close(fd)
        raise
    return path, fd


@contextlib.contextmanager
def task_on_node(bundle: TaskBundle, cache: Path) -> Iterator[Path]:
    """:func:`hold_task` while inside."""
    path, fd = hold_task(bundle, cache)
    try:
        yield path
    finally:
        os.close(fd)


def evict_unused(cache: Path, older_than: float = EVICT_AFTER) -> list[str]:
    """Remove the tasks no trial used for ``older_than`` seconds and none holds now (the
    cache grows by one folder per task version a node has run); returns their digests."""
    removed, now = [], time.time()
    try:
        names = os.listdir(cache)
    except FileNotFoundError:
        return []
    for name in names:
        folder = cache / name
        try:
            age = now - folder.lstat().st_mtime
        except FileNotFoundError:
            continue
        if name.startswith(".unpack-") and age > STALE_UNPACK:  # a worker killed while unpacking
            shutil.rmtree(folder, ignore_errors=True)
            continue
        if name.startswith(".") or not folder.is_dir() or age < older_than:
            continue
        lock = cache / f".{name}.lock"
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a trial holds it
            os.close(fd)
            continue
        try:
            shutil.rmtree(folder, ignore_errors=True)
            os.unlink(lock)  # (a trial that opened it before this sees the folder gone and unpacks again)
            removed.append(name)
        finally:
            os.close(fd)
    return removed


def pack_folder(folder: Path, limit: int = MAX_TRIAL_BYTES) -> tuple[bytes, list[str]]:
    """A trial folder's folders and regular files (``FIRST_FILES`` first), at most
    ``limit`` bytes of file content; returns the archive and the names left out."""
    entries = _entries(folder)
    order = {name: i for i, name in enumerate(FIRST_FILES)}
    entries.sort(key=lambda e: (order.get(e[0], len(order)), e[0]) if not stat.S_ISDIR(e[2].st_mode) else (-1, e[0]))
    buffer, total, left_out = io.BytesIO(), 0, []
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel, path, st in entries:
            if stat.S_ISDIR(st.st_mode):
                tar.addfile(_tarinfo(rel, st, tarfile.DIRTYPE))
            elif stat.S_ISREG(st.st_mode) and total + st.st_size <= limit:
                with open(path, "rb") as f:
                    data = f.read(st.st_size)  # as big as it was when listed: a growing file is cut there
                total += len(data)
                tar.addfile(_tarinfo(rel, st, tarfile.REGTYPE, len(data)), io.BytesIO(data))
            else:
                left_out.append(rel)
    return buffer.getvalue(), left_out


def unpack_folder(data: bytes, dest: Path) -> None:
    """Unpack a :func:`pack_folder` archive into ``dest`` (which must not exist)."""
    dest.mkdir()
    try:
        _extract(data, dest, f"trial folder {dest.name}")
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
