"""Freeze every process of an agent while its verifier runs (an option per run or task).

With a freezer cgroup (root: cgroup v2's ``cgroup.freeze``, or the v1 ``freezer``
controller), the first freeze moves the episode's init and every process under it into a
cgroup of the episode's own (again until none is left outside: a process forking
meanwhile is caught on the next pass; children of moved processes are born inside), and
freezing is then one atomic write. The move happens only when a freeze is asked for:
moving a process costs the kernel a few milliseconds, which ``reset`` should not pay.
Without a cgroup (an ordinary user with no delegated one), every process under the init
is stopped with SIGSTOP, pass after pass until none runs. The verifier is never under the
episode's init nor in its cgroup.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
from pathlib import Path

from ..sandbox.bwrap import descendants

__all__ = ["Freezer", "CgroupFreezer", "SignalFreezer", "make_freezer"]

log = logging.getLogger("sequester.episodes")
_PASSES = 100


class Freezer:
    """Freezes and thaws everything under an episode's init."""

    method = "none"

    def __init__(self, init_pid: int):
        self.init_pid = init_pid

    @property
    def procs_path(self) -> str | None:
        """Where a new agent process must enrol itself (None: nowhere, yet)."""
        return None

    def freeze(self) -> None:
        raise NotImplementedError

    def thaw(self) -> None:
        raise NotImplementedError

    def remove(self) -> None:
        """Thaw and forget; the processes themselves are the episode's to kill."""
        self.thaw()

    def members(self) -> list[int]:
        return [self.init_pid, *descendants(self.init_pid)]


class SignalFreezer(Freezer):
    method = "SIGSTOP"

    def __init__(self, init_pid: int):
        super().__init__(init_pid)
        self.stopped: set[int] = set()

    def freeze(self) -> None:
        for _ in range(_PASSES):
            running = [p for p in descendants(self.init_pid) if p not in self.stopped]
            if not running:
                return
            for pid in running:
                try:
                    os.kill(pid, signal.SIGSTOP)
                    self.stopped.add(pid)
                except ProcessLookupError:
                    pass
        raise OSError("the agent's processes kept multiplying; could not stop them all")

    def thaw(self) -> None:
        for pid in self.stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.stopped.clear()


class CgroupFreezer(Freezer):
    def __init__(self, init_pid: int, base: Path, v2: bool):
        super().__init__(init_pid)
        self.base, self.v2 = base, v2
        self.method = "cgroup v2" if v2 else "cgroup v1 freezer"
        self.path: Path | None = None

    @property
    def procs_path(self) -> str | None:
        return str(self.path / "cgroup.procs") if self.path else None

    def _enrol(self) -> None:
        if self.path is None:
            self.path = _take_cgroup(self.base)
        procs = self.path / "cgroup.procs"
        for _ in range(_PASSES):
            inside = set(map(int, procs.read_text().split()))
            outside = [p for p in self.members() if p not in inside]
            if not outside:
                return
            for pid in outside:
                try:
                    procs.write_text(str(pid))
                except ProcessLookupError:
                    pass
                except OSError as exc:
                    if Path(f"/proc/{pid}").exists():
                        raise
                    log.debug("process %s went away while enrolling: %s", pid, exc)
        raise OSError("the agent's processes kept multiplying; could not enrol them all")

    def _state(self, frozen: bool) -> None:
        assert self.path is not None
        if self.v2:
            (self.path / "cgroup.freeze").write_text("1" if frozen else "0")
            wanted, probe = f"frozen {1 if frozen else 0}", self.path / "cgroup.events"
        else:
            (self.path / "freezer.state").write_text("FROZEN" if frozen else "THAWED")
            wanted, probe = ("FROZEN" if frozen else "THAWED"), self.path / "freezer.state"
        deadline = time.monotonic() + 5
        while wanted not in probe.read_text() and time.monotonic() < deadline:
            time.sleep(0.001)

    def freeze(self) -> None:
        self._enrol()
        self._state(True)

    def thaw(self) -> None:
        if self.path is not None:
            self._state(False)

    def remove(self) -> None:
        """Thaw, and give the cgroup back once empty (reused by the next episode)."""
        if self.path is None:
            return
        try:
            self.thaw()
        except OSError:
            pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                if not (self.path / "cgroup.procs").read_text().strip():
                    with _pool_lock:
                        _pool.append(self.path)
                    self.path = None
                    return
            except OSError:
                return
            time.sleep(0.002)
        log.warning("cgroup %s still has processes; not reused", self.path)


_pool: list[Path] = []
_pool_lock = threading.Lock()
_created = [0]


def _take_cgroup(base: Path) -> Path:
    with _pool_lock:
        for i, path in enumerate(_pool):
            if path.parent == base:
                return _pool.pop(i)
        if _created[0] == 0:
            _remove_stale_cgroups(base)
        _created[0] += 1
        path = base / f"sequester-{os.getpid()}-{_created[0]}"
    path.mkdir()
    return path


def _release_pool() -> None:
    with _pool_lock:
        for path in _pool:
            try:
                path.rmdir()
            except OSError:
                pass
        _pool.clear()


atexit.register(_release_pool)


def _remove_stale_cgroups(base: Path) -> None:
    """Cgroups of sequester processes that died without cleaning up."""
    for path in base.glob("sequester-*-*"):
        pid = path.name.split("-")[1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            try:
                path.rmdir()
            except OSError:
                pass


def _cgroup_root() -> tuple[Path, bool] | None:
    for base, v2 in ((Path("/sys/fs/cgroup"), True), (Path("/sys/fs/cgroup/unified"), True),
                     (Path("/sys/fs/cgroup/freezer"), False)):
        marker = base / ("cgroup.controllers" if v2 else "freezer.state")
        if base.is_dir() and (marker.exists() or (base / "cgroup.procs").exists()) and os.access(base, os.W_OK):
            if v2 and not marker.exists():
                continue
            return base, v2
    return None


def make_freezer(init_pid: int) -> Freezer:
    """A cgroup freezer if this process may make cgroups, else a signal one. Costs nothing
    until the first freeze."""
    root = _cgroup_root()
    return CgroupFreezer(init_pid, *root) if root else SignalFreezer(init_pid)
