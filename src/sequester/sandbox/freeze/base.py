"""What every freezer shares: the outcome it reports, its error, and the last resort.

The last resort, when a freeze cannot be made to hold (processes that keep resuming each
other, or keep appearing, faster than they can be stopped): SIGKILL every process of the
episode's PID namespace except its init, and say so. The verify window then has no agent
process at all, which is what the freeze was for; the init stays, so the episode (and the
verifier, which enters through it) goes on.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass

from sequester.errors import SandboxError
from sequester.sandbox.procs import Identity, Namespace, reopen

__all__ = ["FreezeError", "FreezeOutcome", "Freezer", "stop_init", "kill_round", "kill_agent"]

log = logging.getLogger("sequester.sandbox")


class FreezeError(SandboxError):
    """The agent could not be frozen, nor its processes killed: nothing is guaranteed."""


@dataclass(frozen=True)
class FreezeOutcome:
    """What held during a freeze.

    ``method``: ``"cgroup v2"``, ``"cgroup v1 freezer"``, ``"cgroup v2 (delegated)"``,
    ``"SIGSTOP"``, or ``"killed"`` (the agent's processes were killed instead);
    ``note``: one sentence for the trial's notes; ``passes``: full passes over the
    namespace it took; ``killed``: how many processes were killed.
    """

    method: str
    note: str
    passes: int = 0
    killed: int = 0
    seconds: float = 0.0

    @property
    def held(self) -> bool:
        """The processes were frozen (not killed)."""
        return self.method != "killed"


class Freezer:
    """Freezes and thaws every process of an episode's PID namespace (its init included).

    ``freeze()`` returns only once nothing of the agent can run, or raises
    :class:`FreezeError`; ``thaw()`` undoes it (after a kill there is nothing left to
    resume but the init); ``remove()`` thaws and lets go, and always completes.
    """

    method = "none"

    def __init__(self, init_pid: int, ns: Namespace | None = None):
        self.init_pid = init_pid
        self.ns = ns or Namespace(init_pid)
        self.outcome: FreezeOutcome | None = None

    @property
    def procs_path(self) -> str | None:
        """Where a new agent process must enrol itself (None: nowhere, yet)."""
        return None

    def freeze(self) -> FreezeOutcome:
        raise NotImplementedError

    def thaw(self) -> None:
        raise NotImplementedError

    def remove(self) -> None:
        """Thaw and forget; the processes themselves are the episode's to kill."""
        try:
            self.thaw()
        except OSError as exc:
            log.warning("thawing the episode's processes failed: %s", exc)
        finally:
            self.ns.close()

    def members(self) -> list[int]:
        """Host pids of every process of the namespace (diagnostics, tests)."""
        out = []
        for proc in self.ns.members():
            with proc:
                out.append(proc.pid)
        return out


def stop_init(ns: Namespace) -> Identity | None:
    """SIGSTOP the init before killing around it: the episode's init restarts its
    ``sleep`` child when that dies, so a running init would refill the namespace as fast
    as we empty it. Returns its identity if signalled (the caller resumes it on thaw)."""
    proc = reopen(ns.init)
    if proc is None:
        return None
    with proc:
        return ns.init if proc.signal(signal.SIGSTOP) else None


def _live_agent(ns: Namespace) -> list:
    """Processes of the namespace but its init that are not dead already (zombies wait
    for the init to reap them: they run nothing)."""
    out = []
    for proc in ns.members():
        ident = proc.identity()
        threads = proc.threads() if ident is not None else []
        if ident is None or ident == ns.init or (threads and all(t.state in "ZX" for t in threads)):
            proc.close()
        else:
            out.append(proc)
    return out


def kill_round(ns: Namespace) -> set[Identity]:
    """SIGKILL each live process of the namespace but its init, once; returns those hit.
    A stopped or cgroup-frozen process dies of it too (v2; the v1 freezer needs a thaw
    after, and then it dies before running another instruction of its own)."""
    hit = set()
    for proc in _live_agent(ns):
        with proc:
            ident = proc.identity()
            if proc.signal(signal.SIGKILL) and ident is not None:
                hit.add(ident)
    return hit


def kill_agent(ns: Namespace, *, rounds: int = 500, budget: float = 10.0) -> set[Identity]:
    """SIGKILL everything of the namespace but the init until nothing else lives.

    Converges: a process with SIGKILL pending cannot fork (``copy_process`` refuses while
    a fatal signal is pending), so only children forked before their parent was hit can
    still appear, and each round hits those. Returns the processes that were alive (some
    die of the first kills before we reach them: a session leader's death hangs up its
    orphaned, stopped process groups)."""
    before = set()
    for proc in _live_agent(ns):
        with proc:
            if (ident := proc.identity()) is not None:
                before.add(ident)
    killed: set[Identity] = set()
    deadline = time.monotonic() + budget
    for _ in range(rounds):
        hit = kill_round(ns)
        if not hit:
            return before | killed
        killed |= hit
        if time.monotonic() > deadline:
            break
        time.sleep(0.001)
    raise FreezeError(f"could not kill the agent's processes ({len(killed)} killed, some keep living)")
