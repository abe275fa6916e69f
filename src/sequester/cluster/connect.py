"""Ray, imported only when a cluster is asked for, and the driver's connection to it.

Ray is an optional extra (``pip install 'sequester[ray]'``): without it everything else
works, and asking for the cluster says how to install it (:func:`require_ray`).
:func:`connect` joins the cluster at ``address`` (``host:port``, ``auto``, ``ray://...``;
``None``: ``$RAY_ADDRESS``, else a cluster started on this machine with ``ray start``,
else a new one-machine cluster), or uses the one the caller (a trainer) already joined.
Every node needs the same sequester installed (Ray ships the calls, not the code).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import ModuleType
from typing import Any

from sequester.errors import SequesterError

__all__ = ["ClusterError", "require_ray", "connect", "ray_dirs", "system_failures"]

log = logging.getLogger("sequester.cluster")

INSTALL_HINT = "pip install 'sequester[ray]' (Ray 2.60 or newer; every node needs it and sequester)"


class ClusterError(SequesterError):
    """The cluster cannot be used (Ray missing, no cluster at the address), or a trial was
    lost with its node or worker more often than it may be retried."""


def require_ray() -> ModuleType:
    try:
        import ray
    except ImportError as exc:
        raise ClusterError(f"the ray backend needs Ray, which is not installed here ({exc}): {INSTALL_HINT}") from None
    return ray


def connect(address: str | None = None, **init: Any) -> ModuleType:
    """Ray, joined to a cluster (see module doc); :class:`ClusterError` naming the address."""
    ray = require_ray()
    if ray.is_initialized():  # the caller's (a trainer's) connection: used as it is
        if address not in (None, "auto"):
            log.warning("this process is already connected to a Ray cluster: the address %s is not used", address)
        return ray
    options: dict[str, Any] = {"log_to_driver": False, "configure_logging": False, "namespace": "sequester", **init}
    try:
        ray.init(address=address, **options)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = address or os.environ.get("RAY_ADDRESS") or "a cluster on this machine"
        raise ClusterError(f"cannot join the Ray cluster at {where}: {exc}") from None
    return ray


def ray_dirs() -> tuple[Path, ...]:
    """This node's Ray folders (the session's: logs, sockets, objects spilled from the
    object store, task archives among them), to hide from agents. Best effort through
    Ray's worker state, as Ray has no public call for it; ``/tmp/ray`` (the default) is in
    every episode's fresh ``/tmp`` anyway."""
    try:
        from ray._private import worker as _worker  # noqa: PLC0415 - private, guarded

        node = _worker.global_worker.node
        return tuple(Path(p) for p in {node.get_temp_dir_path(), node.get_session_dir_path()} if p)
    except Exception:  # noqa: BLE001 - another Ray version: the default folder only
        return ()


def system_failures() -> tuple[type[BaseException], ...]:
    """Ray's errors for a trial lost with its worker or node (not its own failure)."""
    ray = require_ray()
    e = ray.exceptions
    names = (
        "WorkerCrashedError",
        "NodeDiedError",
        "LocalRayletDiedError",
        "ObjectLostError",
        "OwnerDiedError",
        "ObjectFetchTimedOutError",
        "ObjectReconstructionFailedError",
        "RaySystemError",
        "OutOfMemoryError",
        "ActorDiedError",
        "ActorUnavailableError",
    )
    return tuple(getattr(e, n) for n in names if isinstance(getattr(e, n, None), type))
