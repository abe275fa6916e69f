"""Freeze every process of an agent while its verifier runs, so that none can undo it.

* :mod:`sequester.sandbox.procs`: the episode's processes, found by PID namespace (complete by
  construction) and handled through ``/proc/PID`` descriptors (no pid-reuse races).
* :mod:`.cgroups`: a freezer cgroup (root's, or a delegated cgroup v2 subtree an ordinary
  user owns), verified after each freeze: the cgroup says frozen *and* every process of
  the namespace is in it; otherwise it retries, then kills.
* :mod:`.signals`: without a cgroup, SIGSTOP to a proven fixed point; if there is none
  within the budget, the agent's processes are killed.
* :mod:`.base`: the :class:`FreezeOutcome` every freeze returns (its ``note`` belongs in
  the trial's notes) and the last resort.

``make_freezer(init_pid)`` picks the strongest method available; it costs nothing until
the first freeze. The verifier is never in the episode's PID namespace nor its cgroup.
"""

from sequester.sandbox.freeze.base import FreezeError, FreezeOutcome, Freezer
from sequester.sandbox.freeze.cgroups import CgroupFreezer, make_freezer
from sequester.sandbox.freeze.signals import SignalFreezer

__all__ = ["Freezer", "FreezeOutcome", "FreezeError", "CgroupFreezer", "SignalFreezer", "make_freezer"]
