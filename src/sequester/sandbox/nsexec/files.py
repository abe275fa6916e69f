"""File operations of the namespace helper (see :mod:`.server`), run by a worker
inside an episode's namespaces: write, read or unpack files in the agent's view, and pack
artifacts for a separate verifier."""

from __future__ import annotations

import base64
import errno
import io
import os
import tarfile
from typing import Any, Literal

from sequester.sandbox.nsexec.ns import enter, read_all, report


def extract(data: bytes, dest: str, policy: Literal["data", "tar", "artifacts"]) -> None:
    """Unpack a tar with tarfile's extraction filters (``data``: no links out, no special
    files, no setuid bits; ``tar``: the same minus the mode cleaning; ``artifacts``: see
    :func:`_artifact_filter`). Pythons before 3.11.4 lack the filters: there the same rules
    are applied member by member (in order, so a link unpacked earlier counts)."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter=_artifact_filter if policy == "artifacts" else policy)
            return
        for member in tar:
            name = os.path.normpath(member.name)
            link_out = (member.issym() or member.islnk()) and os.path.normpath(
                os.path.join(os.path.dirname(name), member.linkname)
            ).startswith(("/", ".."))
            if (
                name.startswith(("/", ".."))
                or member.isdev()
                or (link_out and not (policy == "artifacts" and member.issym()))
            ):
                raise OSError(errno.EPERM, f"refusing to unpack {member.name!r}")
            parent = os.path.dirname(os.path.join(dest, name))
            if os.path.realpath(parent) != os.path.normpath(parent):
                raise OSError(errno.EPERM, f"refusing to unpack {member.name!r} (below a link)")
            if policy == "data":
                member.mode &= 0o755
            tar.extract(member, dest, set_attrs=not member.issym())


def _pack(paths: list[str], exclude: dict[str, list[str]], out: int) -> list[str]:
    """A tar stream of ``paths`` of the view (symlinks kept as links, never followed; only
    folders, files and links) onto ``out``; returns the paths that do not exist.

    Walked by descriptors: each entry opened relative to its folder's descriptor with
    ``O_NOFOLLOW | O_NONBLOCK`` and checked with ``fstat`` on what was opened (red team: a
    process of the agent's swapping a file and a fifo between ``tarfile``'s ``lstat`` and
    its ``open`` by path made the open wait, holding the copy to its timeout)."""
    import fnmatch
    import stat

    missing = []
    with os.fdopen(out, "wb") as stream, tarfile.open(fileobj=stream, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for path in paths:
            patterns = exclude.get(path, [])
            arc = path.lstrip("/")

            def skipped(rel: str, patterns: list[str] = patterns, arc: str = arc) -> bool:
                return any(fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(f"{arc}/{rel}", p) for p in patterns)

            try:
                top = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except FileNotFoundError:
                missing.append(path)
                continue
            except OSError as exc:
                if exc.errno != errno.ELOOP:  # (a link: kept as the link itself)
                    missing.append(path)
                    continue
                top = -1
            try:
                if top < 0:
                    parent = os.open(os.path.dirname(path) or "/", os.O_RDONLY | os.O_DIRECTORY)
                    try:
                        _add_entry(tar, parent, os.path.basename(path), arc)
                    finally:
                        os.close(parent)
                    continue
                st = os.fstat(top)
                if stat.S_ISREG(st.st_mode):
                    _add_file(tar, top, st, arc)
                    continue
                if not stat.S_ISDIR(st.st_mode):
                    continue
                _add_dir_info(tar, st, arc)
                _pack_dir(tar, top, arc, "", skipped)
            finally:
                if top >= 0:
                    os.close(top)
    return missing


def _pack_dir(tar: tarfile.TarFile, dirfd: int, arc: str, rel: str, skipped: Any) -> None:
    for name in sorted(os.listdir(dirfd)):
        sub = f"{rel}/{name}" if rel else name
        if skipped(sub):
            continue
        _add_entry(tar, dirfd, name, f"{arc}/{sub}", lambda fd, st, sub=sub: _pack_dir(tar, fd, arc, sub, skipped))


def _add_entry(tar: tarfile.TarFile, dirfd: int, name: str, arcname: str, into: Any = None) -> None:
    """One entry of the folder ``dirfd``: a link as a link, a file or folder as opened."""
    import stat

    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dirfd)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            return  # gone, or not ours to read
        try:
            target = os.readlink(name, dir_fd=dirfd)
            st = os.lstat(name, dir_fd=dirfd)
        except OSError:
            return
        info = tarfile.TarInfo(arcname)
        info.type, info.linkname, info.mode, info.mtime = tarfile.SYMTYPE, target, 0o777, int(st.st_mtime)
        tar.addfile(info)
        return
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):
            _add_file(tar, fd, st, arcname)
        elif stat.S_ISDIR(st.st_mode):
            _add_dir_info(tar, st, arcname)
            if into is not None:
                into(fd, st)
        # anything else (a fifo, a device, a socket) is left out
    finally:
        os.close(fd)


def _add_dir_info(tar: tarfile.TarFile, st: os.stat_result, arcname: str) -> None:
    info = tarfile.TarInfo(arcname)
    info.type, info.mode, info.mtime = tarfile.DIRTYPE, st.st_mode & 0o7777, int(st.st_mtime)
    info.uid, info.gid = st.st_uid, st.st_gid
    tar.addfile(info)


def _add_file(tar: tarfile.TarFile, fd: int, st: os.stat_result, arcname: str) -> None:
    """A regular file by its descriptor: its size as ``fstat`` saw it (a file that grows is
    cut there, one that shrinks padded: the stream stays a valid tar)."""
    info = tarfile.TarInfo(arcname)
    info.size, info.mode, info.mtime = st.st_size, st.st_mode & 0o7777, int(st.st_mtime)
    info.uid, info.gid = st.st_uid, st.st_gid
    with os.fdopen(os.dup(fd), "rb") as f:
        tar.addfile(info, _Exactly(f, st.st_size))


class _Exactly(io.RawIOBase):
    """``size`` bytes of ``f``: what is missing read as zeros."""

    def __init__(self, f: Any, size: int) -> None:
        self.f, self.left = f, size

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        n = min(len(buf), self.left)
        if n <= 0:
            return 0
        data = self.f.read(n) or b""
        data = data + bytes(n - len(data))
        buf[:n] = data
        self.left -= n
        return n


def _artifact_filter(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
    """tarfile's ``tar`` filter, except that a symlink may point anywhere (the link itself
    is data), and no member may lie below a link: artifacts unpack at ``/``, where the
    filter's own "outside the destination" test cannot catch ``app/link -> /etc``
    followed by ``app/link/passwd``; a tar made by ``_pack`` never has such members."""
    parent = os.path.dirname(os.path.join(dest, member.name.lstrip("/")))
    if os.path.realpath(parent) != os.path.normpath(parent):
        raise tarfile.OutsideDestinationError(member, parent)
    try:
        return tarfile.tar_filter(member, dest)
    except (tarfile.AbsoluteLinkError, tarfile.LinkOutsideDestinationError):
        if member.issym():
            return member
        raise


def op_files(req: dict[str, Any], fds: list[int]) -> None:
    result = fds[0]
    enter(req["target"], user="agent", pid=False, cgroup=None)
    action, path = req["action"], req["path"]
    if action == "write":
        data = read_all(fds[1])
        if req.get("mkdirs"):
            os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, req.get("mode", 0o644))
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fchmod(fd, req.get("mode", 0o644))
        finally:
            os.close(fd)
        report(result, {"ok": True})
    elif action == "read":
        with open(path, "rb") as f:
            data = f.read(req["limit"] + 1)
        if len(data) > req["limit"]:
            raise OSError(errno.EFBIG, f"{path} is larger than {req['limit']} bytes")
        report(result, {"data": base64.b64encode(data).decode()})
    elif action == "extract":
        os.makedirs(path, exist_ok=True)
        extract(read_all(fds[1]), path, req.get("policy", "tar"))
        report(result, {"ok": True})
    elif action == "pack":
        report(result, {"missing": _pack(req["paths"], req.get("exclude", {}), fds[1])})
    else:
        raise ValueError(f"unknown file action {action!r}")
