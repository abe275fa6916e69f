"""Freeze with a cgroup freezer, and check that it held.

The first freeze moves every process of the episode's PID namespace (its init included)
into a cgroup of the episode's own; new agent shells enrol themselves there (``procs_path``)
and children are born in their parent's cgroup, so later freezes move little. Freezing is
then one write (``cgroup.freeze`` in v2, ``freezer.state`` in v1), after which the
freeze is *verified*, not assumed:

* the cgroup reports frozen (``cgroup.events: frozen 1``, ``freezer.state: FROZEN``),
* every process of the namespace, enumerated by namespace (:mod:`sequester.sandbox.procs`), is in the
  cgroup (its ``/proc/PID/cgroup``), and
* the cgroup still reports frozen after that enumeration.

A frozen process runs nothing, so it cannot leave the cgroup, signal, or fork; a process
outside it is the only way the agent could still act (one forked before its parent moved,
one that moved itself out where cgroupfs is writable to it): the next attempt moves it
and freezes again. After a few attempts that do not verify, the agent is killed instead
(:mod:`.base`). No cgroup to be had (a failed ``mkdir``, a delegation that is not really
ours): the SIGSTOP method (:mod:`.signals`), reported as such.
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

from sequester.sandbox.cgroups.freezer import Hierarchy, find_hierarchy
from sequester.sandbox.cgroups.pool import give_back, take_cgroup
from sequester.sandbox.freeze.base import FreezeError, FreezeOutcome, Freezer, kill_agent, kill_round, stop_init
from sequester.sandbox.freeze.signals import SignalFreezer
from sequester.sandbox.procs import Identity, Namespace, Proc, parse_stat, reopen

__all__ = ["CgroupFreezer", "make_freezer"]

log = logging.getLogger("sequester.sandbox")
ATTEMPTS = 8
_SETTLE_S = 2.0


class CgroupFreezer(Freezer):
    def __init__(
        self,
        init_pid: int,
        hierarchy: Hierarchy,
        *,
        attempts: int = ATTEMPTS,
        ns: Namespace | None = None,
        path: Path | None = None,
    ):
        super().__init__(init_pid, ns)
        self.h, self.attempts = hierarchy, attempts
        self.method = (
            "cgroup v2 (delegated)" if hierarchy.delegated else "cgroup v2" if hierarchy.v2 else "cgroup v1 freezer"
        )
        # ``path``: a cgroup v2 the episode's processes are in already, its limits' (see
        # sequester.sandbox.cgroups.limits): frozen in place, never pooled nor removed here.
        self.path: Path | None = path
        self.shared = path is not None
        self.fallback: SignalFreezer | None = None
        self.stopped_init: Identity | None = None  # SIGSTOP'd by the kill path; resumed on thaw

    @property
    def procs_path(self) -> str | None:
        return str(self.path / "cgroup.procs") if self.path else None

    # -- the cgroup's state ------------------------------------------------------------

    def _write_state(self, frozen: bool) -> None:
        assert self.path is not None
        if self.h.v2:
            (self.path / "cgroup.freeze").write_text("1" if frozen else "0")
        else:
            (self.path / "freezer.state").write_text("FROZEN" if frozen else "THAWED")

    def _reports_frozen(self) -> bool:
        assert self.path is not None
        if self.h.v2:
            lines = (self.path / "cgroup.events").read_text().splitlines()
            return "frozen 1" in (line.strip() for line in lines)
        return (self.path / "freezer.state").read_text().strip() == "FROZEN"

    def _settle(self, frozen: bool, timeout: float = _SETTLE_S) -> bool:
        deadline = time.monotonic() + timeout
        while self._reports_frozen() != frozen:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    # -- membership --------------------------------------------------------------------

    def _inside(self, proc: Proc) -> bool:
        """Every live thread of ``proc`` is in our cgroup, by its own ``task/TID/cgroup``
        (kernel-written; the path is ours, and an agent cannot rename a cgroup). Dead
        threads (a zombie, which has already left every cgroup) run nothing; a dead
        leader does not speak for its live threads (attack: hide a running thread behind
        an exited main thread)."""
        assert self.path is not None
        wanted = self.h.cgroup_path(self.path)
        for tid in proc.tids():
            stat, data = proc.read(f"task/{tid}/stat"), proc.read(f"task/{tid}/cgroup")
            if stat is None or parse_stat(stat)[0] in "ZX":
                continue
            if data is None or self._path_in(data) != wanted:
                return not proc.alive() if data is None else False
        return True

    def _path_in(self, data: bytes) -> str | None:
        for line in data.decode("ascii", "replace").splitlines():
            hid, _, rest = line.partition(":")
            controllers, _, path = rest.partition(":")
            if (hid == "0" and controllers == "") if self.h.v2 else ("freezer" in controllers.split(",")):
                return path
        return None

    def _enrol(self) -> int:
        """Move every process of the namespace that is outside into our cgroup; returns
        how many were outside."""
        assert self.path is not None
        procs = self.path / "cgroup.procs"
        outside = 0
        for proc in self.ns.members():
            with proc:
                if self._inside(proc):
                    continue
                outside += 1
                try:
                    procs.write_text(str(proc.pid))
                except PermissionError:
                    raise  # the cgroup is not ours to use: the caller falls back to signals
                except OSError as exc:
                    # Gone, or not movable (an exiting leader): the verification will not
                    # pass while it lives, and the kill path ends it.
                    log.debug("could not move process %s into %s: %s", proc.pid, self.path, exc)
                    continue
                if not proc.alive():
                    self._evict(proc.pid)
        return outside

    def _evict(self, pid: int) -> None:
        """The process we looked at died before our write: its pid may have been handed
        to a host process, which we just moved into a cgroup about to freeze. Put it back
        at the base (attack: cycle pids so that a host process is frozen)."""
        other = Proc.open(pid)
        if other is None:
            return
        with other:
            if other.namespace() != self.ns.key and self._inside(other):
                log.warning("pid %s was recycled while we moved it; moving the new process out", pid)
                (self.h.base / "cgroup.procs").write_text(str(pid))

    def _verified(self) -> bool:
        if not self._reports_frozen():
            return False
        for proc in self.ns.members():
            with proc:
                if not self._inside(proc):
                    return False
        return self._reports_frozen()

    # -- the interface -----------------------------------------------------------------

    def freeze(self) -> FreezeOutcome:
        started = time.monotonic()
        if self.fallback is None:
            try:
                if self.path is None:
                    self.path = take_cgroup(self.h.base)
                for attempt in range(1, self.attempts + 1):
                    self._enrol()
                    self._write_state(True)
                    if self._settle(True) and self._verified():
                        self.outcome = FreezeOutcome(
                            self.method,
                            f"{self.method} freezer, verified (every process of the namespace in the "
                            f"frozen cgroup) after {attempt} attempt{'s' if attempt > 1 else ''}",
                            attempt,
                            seconds=time.monotonic() - started,
                        )
                        return self.outcome
                return self._kill(started)
            except PermissionError as exc:  # not ours after all: signals are what is left
                log.warning("the %s is not usable (%s); freezing with SIGSTOP", self.method, exc)
                try:
                    self._thaw_cgroup()
                except OSError:
                    pass
                self.fallback = SignalFreezer(self.init_pid, ns=self.ns)
        self.outcome = self.fallback.freeze()
        if self.outcome.held:
            self.outcome = FreezeOutcome(
                self.outcome.method,
                f"{self.outcome.note} (no usable cgroup)",
                self.outcome.passes,
                self.outcome.killed,
                self.outcome.seconds,
            )
        return self.outcome

    def _kill(self, started: float) -> FreezeOutcome:
        """The freeze did not verify: stop the init (:func:`.base.stop_init`), SIGKILL all
        but it (while frozen, so none runs again), thaw (the v1 freezer lets them die only
        then; each dies before its next instruction), finish them, then freeze what is
        left (the init) and verify that."""
        self.stopped_init = stop_init(self.ns) or self.stopped_init
        killed = kill_round(self.ns)
        self._write_state(False)
        total = len(killed | kill_agent(self.ns))
        self._enrol()
        self._write_state(True)
        if not (self._settle(True) and self._verified()):
            raise FreezeError("could not freeze the agent: its processes were killed, yet the cgroup does not freeze")
        self.outcome = FreezeOutcome(
            "killed",
            f"could not freeze: {total} agent processes killed ({self.method} "
            f"did not verify after {self.attempts} attempts)",
            self.attempts,
            total,
            time.monotonic() - started,
        )
        return self.outcome

    def _thaw_cgroup(self) -> None:
        if self.path is not None:
            self._write_state(False)
            self._settle(False)

    def thaw(self) -> None:
        if self.fallback is not None:
            self.fallback.thaw()  # the cgroup was thawed (or never frozen) when we fell back
        else:
            self._thaw_cgroup()
        init, self.stopped_init = self.stopped_init, None
        if init is not None and (proc := reopen(init)) is not None:
            with proc:
                proc.signal(signal.SIGCONT)

    def remove(self) -> None:
        """Thaw, and give the cgroup back once empty (reused by the next episode). Always
        completes: a cgroup that will not empty is left (and logged), never waited on."""
        try:
            try:
                self.thaw()
            except OSError as exc:
                log.warning("thawing %s failed: %s", self.path, exc)
            path, self.path = self.path, None
            if path is None or self.shared:
                return  # (a shared cgroup is removed with the limits it holds)
            if self.fallback is not None:
                try:
                    path.rmdir()  # not usable to us: not worth pooling
                except OSError as exc:
                    log.warning("could not remove %s: %s", path, exc)
            else:
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    try:
                        if not (path / "cgroup.procs").read_text().strip():
                            give_back(path)
                            return
                    except OSError:
                        return
                    time.sleep(0.002)
                log.warning("cgroup %s still has processes; not reused", path)
        finally:
            self.ns.close()


def make_freezer(init_pid: int, *, method: str | None = None, cgroup: tuple[Hierarchy, Path] | None = None) -> Freezer:
    """The strongest freezer available: a cgroup if this process may make one (root, or a
    delegated subtree), else SIGSTOP to a fixed point. ``method="signal"`` forces the
    latter (tests). ``cgroup``: the episode's cgroup v2 of its limits, which the freezer
    must share (a v2 process is in one cgroup only). Costs nothing until the first freeze."""
    if method not in (None, "signal", "cgroup"):
        raise ValueError(f"unknown freeze method {method!r}")
    if cgroup is not None and method != "signal":
        return CgroupFreezer(init_pid, cgroup[0], path=cgroup[1])
    hierarchy = None if method == "signal" else find_hierarchy()
    if hierarchy is None:
        if method == "cgroup":
            raise FreezeError("no freezer cgroup is available to this process")
        return SignalFreezer(init_pid)
    return CgroupFreezer(init_pid, hierarchy)
