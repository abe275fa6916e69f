"""Files in and out of a container through the engine's archive calls (``put_archive`` /
``get_archive``), each tar made or read in the host's memory.

The engine extracts and packs inside the container's own root (a link in the container
resolves there, never on the host), so nothing here follows a path of the agent's on the
host. What comes out is the agent's and untrusted: it is read bounded (attack: a huge
file, or a tar stream without end, filling the host's memory) and parsed only by
:mod:`tarfile` in memory, never extracted on the host.
"""

from __future__ import annotations

import io
import os
import posixpath
import tarfile
import time
from pathlib import Path
from typing import Any

from sequester.environments.docker.engine import EngineError
from sequester.errors import SequesterError

__all__ = [
    "ContainerFileError",
    "TooLarge",
    "file_tar",
    "dir_tar",
    "put_tar",
    "get_tar",
    "read_file",
    "write_file",
    "upload_dir",
]

_TAR_SLACK = 1 << 20  # headers and padding around a file's bytes in a tar
_MAX_LINKS = 8


class ContainerFileError(SequesterError):
    """A path in the container is missing, not a regular file, or could not be read."""


class TooLarge(ContainerFileError):
    """What was to be read is larger than its limit (it was not read further)."""


def _errors() -> Any:
    import docker.errors

    return docker.errors


def file_tar(path: str, data: bytes, mode: int = 0o644) -> bytes:
    """A tar of one file at ``path`` (absolute; stored relative, to extract at ``/``)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(path.lstrip("/"))
        info.size, info.mode, info.mtime = len(data), mode, int(time.time())
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def dir_tar(paths: list[str], mode: int = 0o755) -> bytes:
    """A tar of empty folders at ``paths`` (absolute; stored relative, to extract at ``/``)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in paths:
            info = tarfile.TarInfo(path.strip("/"))
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, mode, int(time.time())
            tar.addfile(info)
    return buf.getvalue()


def put_tar(container: Any, path: str, data: bytes) -> None:
    """Extract ``data`` (a tar) at ``path``, a folder that must exist in the container."""
    try:
        ok = container.put_archive(path, data)
    except Exception as exc:  # noqa: BLE001 - the SDK's and requests' errors alike
        raise EngineError(f"the engine could not extract an archive at {path}: {exc}") from exc
    if ok is False:
        raise EngineError(f"the engine refused to extract an archive at {path}")


def get_tar(container: Any, path: str, limit: int) -> tuple[bytes, dict[str, Any]] | None:
    """The engine's tar of ``path`` (a folder: with everything in it) and its stat, or
    None when the path does not exist; :class:`TooLarge` past ``limit`` bytes (the stream
    is abandoned there, not read to its end)."""
    errors = _errors()
    try:
        stream, stat = container.get_archive(path, chunk_size=1 << 20)
    except errors.NotFound:
        return None
    except Exception as exc:  # noqa: BLE001
        raise EngineError(f"the engine could not archive {path}: {exc}") from exc
    buf = bytearray()
    try:
        for chunk in stream:
            buf += chunk
            if len(buf) > limit:
                raise TooLarge(f"{path} is larger than {limit} bytes")
    except TooLarge:
        raise
    except Exception as exc:  # noqa: BLE001
        raise EngineError(f"the engine's archive of {path} broke off: {exc}") from exc
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()
    return bytes(buf), stat


def read_file(container: Any, path: str, limit: int) -> bytes:
    """The bytes of the regular file at ``path`` (a symlink is followed, in the container);
    :class:`ContainerFileError` when it is missing or not a regular file, :class:`TooLarge`
    past ``limit``."""
    for _ in range(_MAX_LINKS):
        got = get_tar(container, path, limit + _TAR_SLACK)
        if got is None:
            raise ContainerFileError(f"{path}: no such file in the container")
        data, stat = got
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            member = tar.next()
            if member is None:
                raise ContainerFileError(f"{path}: the engine's archive of it is empty")
            if member.issym():
                target = member.linkname
                path = target if target.startswith("/") else posixpath.join(posixpath.dirname(path), target)
                continue
            if not member.isreg():
                raise ContainerFileError(f"{path} is not a regular file")
            if member.size > limit:
                raise TooLarge(f"{path} is larger than {limit} bytes")
            extracted = tar.extractfile(member)
            assert extracted is not None
            return extracted.read()
    raise ContainerFileError(f"{path}: more than {_MAX_LINKS} symbolic links")


def write_file(container: Any, path: str, data: bytes, mode: int = 0o644) -> None:
    """Write ``data`` at the absolute ``path``, making missing parent folders."""
    put_tar(container, "/", file_tar(path, data, mode))


def upload_dir(container: Any, source: str | os.PathLike[str], dest: str) -> None:
    """Copy the host folder ``source`` (its contents, links as links) to the absolute ``dest``."""
    buf = io.BytesIO()
    arcname = dest.strip("/") or "."
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.add(Path(source).resolve(), arcname=arcname)
    put_tar(container, "/", buf.getvalue())
