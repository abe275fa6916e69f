""":class:`~.verify.ContainerOps` on a real container (:class:`ContainerHandle`), and what
this host can see and do of the container's processes (its PID namespace, killing its init).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from sequester.environments.docker import files
from sequester.environments.docker.container import KEEP_ALIVE, remove_container
from sequester.environments.docker.engine import EngineError
from sequester.environments.docker.exec import run_exec
from sequester.environments.docker.verify import WIPE
from sequester.sandbox.procs import kill_init, pid_namespace

__all__ = ["ContainerHandle", "host_namespace", "kill_from_host"]

_RM_TIMEOUT = 60.0
_INIT_WAIT = 5.0  # seconds for a started container's init to become our keep-alive command


def host_namespace(container: Any) -> str | None:
    """The container's PID namespace if its processes are visible from here: its init's
    host pid runs our keep-alive command in a namespace not ours. Attack/accident: a
    remote engine's pid naming an unrelated process of this host, which a timeout would
    then kill."""
    pid = (container.attrs.get("State") or {}).get("Pid") or 0
    wanted = b"\0".join(a.encode() for a in KEEP_ALIVE) + b"\0"
    # The engine reports the pid as soon as the runtime's init has it, which may still be
    # the runtime's own program for a moment (seen under load: runc init), not ours yet.
    deadline = time.monotonic() + _INIT_WAIT
    while True:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            return None
        if cmdline == wanted or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    ns = pid_namespace(pid) if pid > 0 else None
    if cmdline != wanted or ns == pid_namespace(os.getpid()):
        return None
    return ns


def kill_from_host(ops: ContainerHandle) -> None:
    """Kill the container's processes from this host first, when they are visible here:
    a fork-bombed container's removal through the engine timed out (podman: "given PIDs
    did not die within timeout"), and its processes outlived the engine's teardown."""
    pid = (ops.container.attrs.get("State") or {}).get("Pid") or 0
    if ops.namespace is not None and pid > 0:
        kill_init(pid, ops.namespace)


class ContainerHandle:
    """:class:`~.verify.ContainerOps` on a real container."""

    def __init__(self, client: Any, container: Any, output_limit: int, *, remove_on_discard: bool):
        self.client, self.container, self.output_limit = client, container, output_limit
        self.namespace = host_namespace(container)
        # The container's init as this host sees it (None: the engine's processes are not visible here).
        self.init_pid: int | None = (
            ((container.attrs.get("State") or {}).get("Pid") or None) if self.namespace else None
        )
        self._remove = remove_on_discard

    def exec(
        self, argv: list[str], timeout: float, *, env: Mapping[str, str] | None = None, workdir: str | None = None
    ) -> tuple[int | None, bytes, bool]:
        raw = run_exec(
            self.client,
            self.container.id,
            argv,
            timeout=timeout,
            output_bytes=self.output_limit,
            env=dict(env) if env else None,
            workdir=workdir,
            namespace=self.namespace,
        )
        return raw.exit_code, raw.stdout + raw.stderr, raw.timed_out

    def put_tar(self, path: str, data: bytes) -> None:
        files.put_tar(self.container, path, data)

    def get_tar(self, path: str, limit: int) -> bytes | None:
        got = files.get_tar(self.container, path, limit)
        return None if got is None else got[0]

    def read_file(self, path: str, limit: int) -> bytes | None:
        try:
            return files.read_file(self.container, path, limit)
        except files.TooLarge:
            raise
        except files.ContainerFileError:
            return None

    def remove(self, paths: Sequence[str]) -> bool:
        raw = run_exec(
            self.client,
            self.container.id,
            ["/bin/sh", "-c", WIPE, "sh", *paths],
            timeout=_RM_TIMEOUT,
            output_bytes=4096,
            namespace=self.namespace,
        )
        return raw.exit_code == 0 and not raw.timed_out

    def discard(self) -> None:
        kill_from_host(self)
        try:
            if self._remove:
                remove_container(self.container)
            else:
                self.container.kill()
        except Exception as exc:  # noqa: BLE001
            raise EngineError(
                f"the engine could not {'remove' if self._remove else 'kill'} {self.container.name}: {exc}"
            ) from exc
