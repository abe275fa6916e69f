"""The Docker-API engine: connecting to it, labelling what we create, reaping what a dead
process of ours left behind.

Every container sequester creates carries three labels:

* ``sequester.managed=1``: ours (nothing else on the engine is ever touched);
* ``sequester.owner=HOST:PID:START``: the process that created it, by host name, pid and
  the process's start time (``/proc/self/stat`` field 22) -- a pid alone is reused;
* ``sequester.role=agent|verifier``.

:func:`reap_orphans` removes the containers whose owner ran on this host and is gone (a
crash, a ``kill -9``, a power cut): without it every such run leaves an agent's container
running, with its processes, for ever.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import TYPE_CHECKING, Any

from sequester.environments.base import UnsupportedByBackend
from sequester.errors import SequesterError

if TYPE_CHECKING:
    import docker

__all__ = [
    "EngineError",
    "connect",
    "owner_label",
    "labels",
    "reap_orphans",
    "reap_once",
    "process_start_time",
    "MANAGED",
    "OWNER",
    "ROLE",
]

log = logging.getLogger("sequester.environments.docker")

MANAGED, OWNER, ROLE = "sequester.managed", "sequester.owner", "sequester.role"
DEFAULT_SOCKET = "unix:///var/run/docker.sock"


class EngineError(SequesterError):
    """The engine refused or failed a request (not the agent's doing)."""


def _sdk() -> Any:
    try:
        import docker
    except ImportError:
        raise UnsupportedByBackend(
            "the docker backend needs the Docker SDK for Python: pip install 'sequester[docker]' (docker>=7)"
        ) from None
    return docker


def connect(base_url: str | None = None, timeout: float = 120) -> docker.DockerClient:
    """A client of the engine at ``base_url``, else ``$DOCKER_HOST``, else the default
    socket; :class:`UnsupportedByBackend` when no engine answers there."""
    sdk = _sdk()
    url = base_url or os.environ.get("DOCKER_HOST") or DEFAULT_SOCKET
    try:
        # The API version is asked once per engine: the SDK's negotiation (GET /version)
        # cost 0.3 s of each environment's start on podman. A client per environment, not
        # one shared: its requests session is not made for many threads.
        version = _versions.get(url)
        client = sdk.DockerClient(base_url=url, timeout=timeout, **({"version": version} if version else {}))
        client.ping()
        _versions.setdefault(url, client.api.api_version)
    except Exception as exc:  # noqa: BLE001 - the SDK raises many kinds; all mean "no engine"
        raise UnsupportedByBackend(
            f"no Docker-API engine answers at {url} ({type(exc).__name__}: {exc}); "
            "start one (dockerd, or `podman system service`) or set DOCKER_HOST"
        ) from None
    return client


_versions: dict[str, str] = {}  # engine URL -> the API version its first client negotiated


def process_start_time(pid: int | str = "self") -> str | None:
    """Field 22 of ``/proc/PID/stat`` (clock ticks since boot), or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    # comm (field 2) is in parentheses and may hold spaces and ')': split after the last one.
    return stat.rsplit(")", 1)[1].split()[19]


def owner_label() -> str:
    """``HOST:PID:START`` of this process (see the module)."""
    return f"{socket.gethostname()}:{os.getpid()}:{process_start_time()}"


def labels(role: str) -> dict[str, str]:
    return {MANAGED: "1", OWNER: owner_label(), ROLE: role}


def _owner_gone(owner: str) -> bool:
    """Whether ``owner`` names a process of this host that no longer exists. Another
    host's containers are never judged: its processes cannot be seen from here."""
    parts = owner.rsplit(":", 2)
    if len(parts) != 3 or parts[0] != socket.gethostname() or not parts[1].isdigit():
        return False
    return process_start_time(int(parts[1])) != parts[2]


def reap_orphans(client: docker.DockerClient) -> list[str]:
    """Force-remove sequester's containers whose owner process on this host is gone; the
    names of those removed. Failures are logged, never raised: reaping is housekeeping."""
    removed: list[str] = []
    try:
        found = client.containers.list(all=True, filters={"label": f"{MANAGED}=1"})
    except Exception as exc:  # noqa: BLE001
        log.warning("could not list sequester's containers to reap orphans: %s", exc)
        return removed
    for container in found:
        owner = (container.labels or {}).get(OWNER, "")
        if not _owner_gone(owner):
            continue
        try:
            container.remove(force=True)
            removed.append(container.name)
        except Exception as exc:  # noqa: BLE001 - e.g. removed meanwhile by another reaper
            log.info("could not remove orphaned container %s: %s", container.name, exc)
    if removed:
        log.info("removed %d orphaned sequester container(s): %s", len(removed), ", ".join(removed))
    return removed


_reaped: set[str] = set()
_reap_lock = threading.Lock()


def reap_once(client: docker.DockerClient, url: str) -> None:
    """:func:`reap_orphans` at most once per process and engine (``url``)."""
    with _reap_lock:
        if url in _reaped:
            return
        _reaped.add(url)
    reap_orphans(client)
