"""Freeze with SIGSTOP when no cgroup is ours: stop everything, then prove it stayed stopped.

Stopping each process once is not a freeze: SIGSTOP is delivered asynchronously (the
target stops when it next returns to user mode, so a process on another CPU in the middle
of ``kill(-1, SIGCONT)`` finishes that call first), and SIGCONT both resumes a stopped
process and cancels a SIGSTOP still pending. Agent processes that keep sending SIGCONT to
each other resume as fast as a one-pass freezer stops them.

So :func:`stop_until_stable` repeats *passes*. A pass enumerates the namespace afresh
(:meth:`sequester.sandbox.procs.Namespace.members`) and looks at every thread: its state and its count of
context switches. Threads that are not stopped get their process SIGSTOP'd, and the pass
is *dirty*. The freeze holds when two consecutive passes are *clean* (no signal sent) and
saw exactly the same threads in exactly the same states with the same switch counts.

Why that is a fixed point (the argument the code relies on):

1. A stopped process cannot send signals, fork, ptrace or write anything: it runs no
   instruction of its own. Only a running process of the namespace can resume one (an
   outsider could, but the host's other users are not the adversary here).
2. A thread seen stopped at time a (pass 1) and stopped at b (pass 2) with the same
   switch count did not run in between: to run it must be scheduled in, and to be
   stopped again at b it must be switched out, which increments the count. (The count
   moves even when the thread is resumed and re-stopped between our two looks, which is
   exactly the case a look at the state alone cannot see.)
3. Every look of pass 1 precedes every look of pass 2, so the intervals [a, b] of all
   threads share the instant between the two passes: at that instant every thread the
   passes saw was stopped at once, so none of them can ever resume another (1).
4. Completeness. A listing of ``/proc`` shows every process that exists for the whole
   listing (pids are handed out upwards and the listing walks upwards); one created
   meanwhile is missed only if the pid counter wraps below the listing's position just
   then. So a clean pass also checks that every child of every process it saw was seen
   (``task/*/children``): an unseen process has an unseen parent, and so on up to the
   init (orphans are re-parented to it), which is always seen; with every child of
   every seen process seen, there is no unseen process. Hence after a stable pair
   nothing in the namespace can run until we send SIGCONT.

"Stopped" means state ``T`` (group stop), ``t`` (ptrace stop: its tracer, an agent
process, is stopped too, or it would not be stable), ``Z``/``X`` (dead), or ``D`` with a
SIGSTOP pending (a ``vfork`` parent waits in ``D`` until its stopped child execs: it will
stop before its next instruction, and no one is left to cancel the pending signal).

A pass that sends signals is never counted: a process we just signalled may not have
stopped yet (asynchronous delivery), and the next passes find out. When the passes or
the time run out first, the caller kills the agent instead (:mod:`.base`).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass

from sequester.sandbox.freeze.base import FreezeError, FreezeOutcome, Freezer, kill_agent, stop_init
from sequester.sandbox.procs import Identity, Namespace, Proc, Thread, reopen

__all__ = ["SignalFreezer", "stop_until_stable", "Stabilised"]

MAX_PASSES = 400
BUDGET_S = 5.0


@dataclass(frozen=True)
class Stabilised:
    stable: bool
    passes: int
    reason: str = ""  # why not: "they kept resuming each other" / "new processes kept appearing"


def _stopped(thread: Thread) -> bool:
    return thread.state in "tTZX" or (thread.state == "D" and thread.stop_pending)


def stop_until_stable(
    ns: Namespace, signalled: set[Identity], *, max_passes: int = MAX_PASSES, budget: float = BUDGET_S
) -> Stabilised:
    """SIGSTOP every process of ``ns`` until two consecutive clean passes agree (see the
    module's docstring). Adds each process it signals to ``signalled`` (to resume on thaw)."""
    deadline = time.monotonic() + budget
    previous: dict[tuple[Identity, int], tuple[str, int]] | None = None
    known: set[Identity] = set()
    reason = "they kept resuming each other"
    passes = 0
    while passes < max_passes and (passes == 0 or time.monotonic() < deadline):
        passes += 1
        seen: dict[tuple[Identity, int], tuple[str, int]] = {}
        running: list[Proc] = []
        pids: set[int] = set()
        children: set[int] = set()
        fresh = False
        for proc in ns.members():
            ident = proc.identity()
            threads = proc.threads() if ident is not None else []
            if ident is None or (not threads and not proc.alive()):
                proc.close()  # gone between the listing and the look
                continue
            fresh |= ident not in known
            known.add(ident)
            pids.add(ident.pid)
            for t in threads:
                seen[(ident, t.tid)] = (t.state, t.switches)
            # No thread readable but alive: we cannot tell, so treat it as running.
            if not threads or not all(_stopped(t) for t in threads):
                running.append(proc)
            else:
                children |= proc.children()
                proc.close()
        if running:
            for proc in running:
                with proc:
                    ident = proc.identity()
                    if proc.signal(signal.SIGSTOP) and ident is not None:
                        signalled.add(ident)
            reason = "new processes kept appearing" if fresh and passes > 1 else "they kept resuming each other"
            previous = None
            time.sleep(min(0.0002 * passes, 0.002))  # let the stops land before looking again
            continue
        if not children <= pids:
            previous = None  # a process no listing showed (4): look again
            continue
        if seen == previous:
            return Stabilised(True, passes)
        previous = seen
    return Stabilised(False, passes, reason)


class SignalFreezer(Freezer):
    """SIGSTOP to a fixed point; SIGKILL the agent if there is none within the budget."""

    method = "SIGSTOP"

    def __init__(
        self, init_pid: int, *, max_passes: int = MAX_PASSES, budget: float = BUDGET_S, ns: Namespace | None = None
    ):
        super().__init__(init_pid, ns)
        self.max_passes, self.budget = max_passes, budget
        self.signalled: set[Identity] = set()

    def freeze(self) -> FreezeOutcome:
        started = time.monotonic()
        result = stop_until_stable(self.ns, self.signalled, max_passes=self.max_passes, budget=self.budget)
        if result.stable:
            self.outcome = FreezeOutcome(
                "SIGSTOP",
                f"SIGSTOP, stable after {result.passes} passes",
                result.passes,
                seconds=time.monotonic() - started,
            )
            return self.outcome
        self.outcome = kill_and_confirm(self.ns, self.signalled, result, started)
        return self.outcome

    def thaw(self) -> None:
        """SIGCONT what we stopped, each only if it is still the same process (its pid
        may belong to someone else by now) and still in the namespace."""
        for ident in sorted(self.signalled, key=lambda i: i.pid):
            proc = reopen(ident)
            if proc is not None:
                with proc:
                    if proc.namespace() == self.ns.key:
                        proc.signal(signal.SIGCONT)
        self.signalled.clear()


def kill_and_confirm(ns: Namespace, signalled: set[Identity], why: Stabilised, started: float) -> FreezeOutcome:
    """The last resort: kill all but the init, then prove that what is left (the init,
    stopped; zombies) is stable. The init cannot be killed without ending the episode, so
    if even it will not stay stopped, nothing is guaranteed and we say so."""
    if (init := stop_init(ns)) is not None:
        signalled.add(init)
    killed = len(kill_agent(ns))
    after = stop_until_stable(ns, signalled, max_passes=50, budget=2.0)
    if not after.stable:
        raise FreezeError("could not freeze the agent: its processes were killed, yet the namespace keeps running")
    passes = why.passes + after.passes
    return FreezeOutcome(
        "killed",
        f"could not freeze: {killed} agent processes killed ({why.reason}; not stable after {why.passes} passes)",
        passes,
        killed,
        time.monotonic() - started,
    )
