"""Freeze every process of an agent while its verifier runs (an option per run or task).

With a freezer cgroup (root: cgroup v2's ``cgroup.freeze``, or the v1 ``freezer``
controller) the episode's init and every process the agent starts are placed in a cgroup
of their own at start, and freezing is one atomic write. Without one (an ordinary user
with no delegated cgroup), every process under the episode's init is stopped with SIGSTOP,
repeatedly until no running one is left (a process forking meanwhile is caught on the
next pass). The verifier is never in the agent's cgroup or under its init.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

__all__ = ["Freezer", "CgroupFreezer", "SignalFreezer", "make_freezer"]

log = logging.getLogger("sequester.episodes")


class Freezer:
    method = "none"
    procs_path: str | None = None

    def add(self, pid: int) -> None:
        """Put ``pid`` (and its future children) under this freezer."""

    def freeze(self) -> None:
        raise NotImplementedError

    def thaw(self) -> None:
        raise NotImplementedError

    def remove(self) -> None:
        """Thaw and forget; the processes themselves are the episode's to kill."""


class CgroupFreezer(Freezer):
    def __init__(self, path: Path, v2: bool):
        self.path, self.v2 = path, v2
        self.method = "cgroup v2" if v2 else "cgroup v1 freezer"
        self.procs_path = str(path / "cgroup.procs")

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def _state(self, frozen: bool) -> None:
        if self.v2:
            (self.path / "cgroup.freeze").write_text("1" if frozen else "0")
            wanted = f"frozen {1 if frozen else 0}"
            events = self.path / "cgroup.events"
            deadline = time.monotonic() + 5
            while wanted not in events.read_text() and time.monotonic() < deadline:
                time.sleep(0.001)
        else:
            (self.path / "freezer.state").write_text("FROZEN" if frozen else "THAWED")
            deadline = time.monotonic() + 5
            target = "FROZEN" if frozen else "THAWED"
            while (self.path / "freezer.state").read_text().strip() != target and time.monotonic() < deadline:
                time.sleep(0.001)

    def freeze(self) -> None:
        self._state(True)

    def thaw(self) -> None:
        self._state(False)

    def remove(self) -> None:
        try:
            self.thaw()
        except OSError:
            pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                self.path.rmdir()  # only once its processes are gone
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.01)
        log.warning("could not remove cgroup %s", self.path)


class SignalFreezer(Freezer):
    method = "SIGSTOP"

    def __init__(self, init_pid: int):
        self.init_pid = init_pid
        self.stopped: set[int] = set()

    def freeze(self) -> None:
        for _ in range(100):
            running = [p for p in _descendants(self.init_pid) if p not in self.stopped]
            if not running:
                return
            for pid in running:
                try:
                    os.kill(pid, signal.SIGSTOP)
                    self.stopped.add(pid)
                except ProcessLookupError:
                    pass

    def thaw(self) -> None:
        for pid in self.stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.stopped.clear()

    def remove(self) -> None:
        self.thaw()


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                children = [int(c) for c in f.read().split()]
        except OSError:
            continue
        for child in children:
            out.append(child)
            out += _descendants(child)
    return out


def _cgroup_root() -> tuple[Path, bool] | None:
    for base, v2 in ((Path("/sys/fs/cgroup"), True), (Path("/sys/fs/cgroup/unified"), True),
                     (Path("/sys/fs/cgroup/freezer"), False)):
        marker = base / ("cgroup.controllers" if v2 else "freezer.state")
        if base.is_dir() and (marker.exists() or (not v2 and (base / "cgroup.procs").exists())) and os.access(base, os.W_OK):
            return base, v2
    return None


def make_freezer(name: str, init_pid: int) -> Freezer:
    """A cgroup freezer holding ``init_pid`` if this process may make one, else signals."""
    root = _cgroup_root()
    if root is not None:
        base, v2 = root
        path = base / f"sequester-{name}"
        try:
            path.mkdir()
            freezer = CgroupFreezer(path, v2)
            freezer.add(init_pid)
            return freezer
        except OSError as exc:
            log.debug("no cgroup freezer at %s: %s", base, exc)
            try:
                path.rmdir()
            except OSError:
                pass
    return SignalFreezer(init_pid)
