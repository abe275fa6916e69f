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
    """A tar stream of ``paths`` of the view (symlinks kept as links, never followed;
    only folders, files and links) onto ``out``; returns the paths that do not exist."""
    import fnmatch

    missing = []
    with os.fdopen(out, "wb") as stream, tarfile.open(fileobj=stream, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for path in paths:
            if not os.path.lexists(path):
                missing.append(path)
                continue
            patterns = exclude.get(path, [])

            def keep(info: tarfile.TarInfo, patterns: list[str] = patterns) -> tarfile.TarInfo | None:
                if not (info.isfile() or info.isdir() or info.issym()):
                    return None  # no devices, fifos or hard links into the view
                rel = info.name.split("/", 1)[-1]
                return None if any(fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(info.name, p) for p in patterns) else info

            tar.add(path, arcname=path.lstrip("/"), filter=keep)
    return missing


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
