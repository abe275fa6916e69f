"""Memory, CPU and process limits of an episode in cgroups of its own, where this process
may make them, on cgroup v2 or v1 (whichever offers more of the three controllers where
we may use it, v2 on a tie: :func:`choose_version`).

* **cgroup v2** (every current distribution; the only hierarchy on most hosts): *one*
  cgroup for the episode, a child of a base cgroup we may use (:func:`v2_bases`): our own
  cgroup when it is ours to use (root, or a subtree *delegated* to an ordinary user:
  systemd's ``user@UID.service``, a ``systemd-run --scope -p Delegate=yes`` scope, a
  container manager's ``Delegate=yes`` unit); where it is not and systemd runs, this
  process first asks systemd (the system's for root, the user's manager for a user) for
  a delegated transient scope of its own and moves into it (:func:`enter_systemd_scope`,
  once); else, for root, the hierarchy's root.
  ``memory.max`` (with ``memory.swap.max`` 0), ``cpu.max``, ``pids.max``. The controllers
  are enabled in the base's ``cgroup.subtree_control``; cgroup v2 refuses that while the
  base itself holds processes (the "no internal processes" rule), so when the only
  process in it is this one, it first moves into a leaf of its own
  (``sequester-PID-host``), as container runtimes do; with other processes there, v2 is
  not used, and the note says to start sequester in a cgroup of its own. The episode's
  cgroup is also its freezer's (``cgroup.freeze``): a v2 process is in one cgroup only,
  so a freezer cgroup of its own would take the agent out of its limits
  (:attr:`LimitGroups.freezer_cgroup`, :func:`sequester.sandbox.freeze.make_freezer`).
* **cgroup v1** (root on a hybrid or legacy hierarchy): a child of our own cgroup in each
  of the ``memory``, ``cpu`` and ``pids`` hierarchies: ``memory.limit_in_bytes`` (and
  ``memory.memsw.limit_in_bytes``), ``cpu.cfs_quota_us``, ``pids.max``. The freezer has a
  cgroup of its own in the v1 ``freezer`` hierarchy (or the v2 one), which leaves these.

What each version writes is a pure plan (:func:`limit_plan`; for v2 with its base,
:func:`plan_v2` over :class:`V2Base` descriptions of the host), unit-tested whatever the
machine. A limit that cannot be applied is named in :attr:`LimitGroups.missing` (the
trial's notes), never dropped.

Children of a cgroup we run in (or, for root on v2 without one, of the root), so an
episode never escapes the limits sequester itself runs under where there are any. The
episode's init is moved in once it is up; every process the agent starts joins on its way
in (a child of the namespace helper's worker writes the worker into each ``cgroup.procs``
while it enters the episode, and the worker waits for it before it forks anything: a v1
move waits for an RCU grace period). The verifier's processes do not: what the agent
leaves behind cannot starve the tests of memory. Removed at teardown, after every process
in them is gone.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sequester.sandbox.cgroups.freezer import Hierarchy, is_delegated, own_cgroup_dir
from sequester.sandbox.cgroups.hierarchy import find_v1, find_v2, own_cgroup
from sequester.sandbox.cgroups.pool import remove_stale_cgroups

__all__ = [
    "LimitGroups",
    "V2Base",
    "V2Plan",
    "choose_version",
    "enter_systemd_scope",
    "limit_plan",
    "make_limit_groups",
    "plan_v2",
    "remove_stale_groups",
    "systemd_runs",
    "systemd_scope_argv",
    "v2_bases",
]

log = logging.getLogger("sequester.sandbox")

_PERIOD_US = 100_000
_CONTROLLERS = ("memory", "cpu", "pids")
# What each controller's limit is called in LimitGroups.applied (and the trial's notes).
LABELS = {"memory": "memory", "cpu": "cpus", "pids": "pids"}


@dataclass
class LimitGroups:
    """The episode's cgroups: one per controller on v1, one for all on v2 (then also the
    freezer's, see :attr:`freezer_cgroup`). ``applied``: the labels of the limits written
    (``memory``, ``cpus``, ``pids``); ``missing``: why each other one was not."""

    paths: list[Path]
    applied: list[str] = field(default_factory=list)
    missing: dict[str, str] = field(default_factory=dict)
    v2: Hierarchy | None = None

    @property
    def procs(self) -> list[str]:
        return [str(p / "cgroup.procs") for p in self.paths]

    @property
    def freezer_cgroup(self) -> tuple[Hierarchy, Path] | None:
        """On cgroup v2: the hierarchy and the one cgroup the freezer must use too."""
        return (self.v2, self.paths[0]) if self.v2 is not None and self.paths else None

    def enrol(self, pid: int) -> None:
        for procs in self.procs:
            with open(procs, "w") as f:
                f.write(str(pid))

    def remove_soon(self) -> None:
        """:meth:`remove` without waiting: what still holds processes on their way out (a
        cgroup is busy until its last process is reaped, which may come after its report)
        is removed by a thread of its own (at most :data:`_LATER_LIMIT` waiting, else now);
        what a process that exits first leaves, the stale-state pass removes."""
        busy = []
        for path in self.paths:
            try:
                path.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                busy.append(path)
        if busy:
            _remover.add(LimitGroups(busy))

    def remove(self, timeout: float = 5.0) -> None:
        for path in self.paths:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY: a process is still on its way out
                    if time.monotonic() > deadline:
                        log.warning("cgroup %s still has processes; left for the next start", path)
                        break
                    time.sleep(0.005)


_LATER_LIMIT = 256


class _Remover:
    """One thread that removes groups still busy (see :meth:`LimitGroups.remove_soon`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: list[LimitGroups] = []
        self._thread: threading.Thread | None = None

    def add(self, groups: LimitGroups) -> None:
        with self._lock:
            if len(self._waiting) < _LATER_LIMIT:
                self._waiting.append(groups)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="sequester-cgroups", daemon=True)
                    self._thread.start()
                return
        groups.remove()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._waiting:
                    self._thread = None
                    return
                groups = self._waiting.pop(0)
            groups.remove()


_remover = _Remover()


def limit_plan(
    *, memory_mb: int | None, cpus: float | None, pids: int | None, v2: bool, memsw: bool = False
) -> list[tuple[str, str, str, str | None]]:
    """What to write for these limits: ``(controller, file, value, label)`` in order (the
    label is what :attr:`LimitGroups.applied` reports; ``None`` for a helper file). v1
    writes one cgroup per controller; v2 one cgroup for all (``controller`` is then only
    the one that must be enabled in the parent's ``cgroup.subtree_control``). ``memsw``:
    the v1 memory controller also limits swap. Pure."""
    plan: list[tuple[str, str, str, str | None]] = []
    if memory_mb:
        limit = str(memory_mb * (1 << 20))
        if v2:
            plan += [("memory", "memory.max", limit, "memory"), ("memory", "memory.swap.max", "0", None)]
        else:
            plan.append(("memory", "memory.limit_in_bytes", limit, "memory"))
            if memsw:
                plan.append(("memory", "memory.memsw.limit_in_bytes", limit, None))
    if cpus:
        quota = str(int(cpus * _PERIOD_US))
        if v2:
            plan.append(("cpu", "cpu.max", f"{quota} {_PERIOD_US}", "cpus"))
        else:
            plan += [("cpu", "cpu.cfs_period_us", str(_PERIOD_US), None), ("cpu", "cpu.cfs_quota_us", quota, "cpus")]
    if pids is not None:
        plan.append(("pids", "pids.max", str(pids), "pids"))
    return plan


def choose_version(v1: frozenset[str] | set[str], v2: frozenset[str] | set[str]) -> str | None:
    """``"v2"``, ``"v1"`` or None: which hierarchy to limit in, from the controllers each
    offers where we may use it (v1: those with a hierarchy we may make cgroups in; v2:
    the ``cgroup.controllers`` of the base). More of memory, cpu and pids wins; v2 on a
    tie. Pure."""
    n1, n2 = len(set(_CONTROLLERS) & set(v1)), len(set(_CONTROLLERS) & set(v2))
    if not n1 and not n2:
        return None
    return "v2" if n2 >= n1 else "v1"


# -- cgroup v2 ----------------------------------------------------------------------------


@dataclass(frozen=True)
class V2Base:
    """A cgroup v2 folder under which ours could be made, as read from the host (the
    input of :func:`plan_v2`). ``controllers``: its ``cgroup.controllers`` (what its
    children can be given); ``enabled``: its ``cgroup.subtree_control``; ``procs``: the
    processes in it (not read, empty, where no controller is left to enable or at the
    top: see :func:`read_v2_base`); ``usable``: we may make children and move processes there (root, or
    a delegated subtree); ``top``: the hierarchy's root cgroup (which may hold processes
    and enable controllers at once); ``what``: how the notes name it."""

    path: Path
    controllers: frozenset[str]
    enabled: frozenset[str]
    procs: tuple[int, ...]
    usable: bool
    top: bool
    what: str


@dataclass(frozen=True)
class V2Plan:
    """What to do for an episode's cgroup v2: move ``move`` (our own processes) into the
    leaf ``leaf`` first (None: nothing to move), enable ``enable`` in ``base``'s
    ``cgroup.subtree_control``, make the episode's cgroup under ``base`` and write
    ``writes`` (``(file, value, label)``) in it; ``missing``: label -> why not applied."""

    base: Path
    leaf: Path | None
    move: tuple[int, ...]
    enable: tuple[str, ...]
    writes: tuple[tuple[str, str, str | None], ...]
    missing: dict[str, str]


def plan_v2(
    bases: Sequence[V2Base],
    *,
    own_pids: frozenset[int] | set[int],
    leaf_name: str,
    memory_mb: int | None,
    cpus: float | None,
    pids: int | None,
) -> V2Plan | str:
    """The plan on the first usable base of ``bases`` (see the module), or why none is.
    ``own_pids``: this process (what may be moved out of a base into ``leaf_name``). Pure."""
    steps = limit_plan(memory_mb=memory_mb, cpus=cpus, pids=pids, v2=True)
    wanted = [c for c in _CONTROLLERS if any(step[0] == c for step in steps)]
    reasons = []
    for base in bases:
        if not base.usable:
            reasons.append(f"{base.what} {base.path} is not delegated to this user")
            continue
        have = [c for c in wanted if c in base.controllers]
        if wanted and not have:
            reasons.append(
                f"{base.what} {base.path} offers none of the cgroup v2 controllers {', '.join(wanted)} "
                f"(its cgroup.controllers: {' '.join(sorted(base.controllers)) or 'none'})"
            )
            continue
        enable = tuple(c for c in have if c not in base.enabled)
        leaf: Path | None = None
        move: tuple[int, ...] = ()
        if enable and base.procs and not base.top:
            others = set(base.procs) - set(own_pids)
            if others:
                reasons.append(
                    f"{base.what} {base.path} holds {len(others)} other process{'es' * (len(others) != 1)}, "
                    "so no controller can be enabled for its children (cgroup v2's no-internal-processes "
                    "rule): start sequester in a cgroup of its own (systemd-run --scope -p Delegate=yes ...)"
                )
                continue
            leaf, move = base.path / leaf_name, tuple(sorted(base.procs))
        missing = {
            LABELS[c]: f"the cgroup v2 {c} controller is not available in {base.what} {base.path} "
            f"(cgroup.controllers: {' '.join(sorted(base.controllers)) or 'none'})"
            for c in wanted
            if c not in have
        }
        writes = tuple((file, value, label) for c, file, value, label in steps if c in have)
        return V2Plan(base.path, leaf, move, enable, writes, missing)
    return "; ".join(reasons) or "no cgroup v2 hierarchy is mounted"


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def read_v2_base(path: Path, *, top: bool, what: str) -> V2Base:
    """What :class:`V2Base` says of the v2 cgroup at ``path``, read from the host.

    Its ``cgroup.procs`` only where :func:`plan_v2` may need it: a base not at the top
    whose controllers are not all enabled for its children yet. (Read at every reset, it
    listed every process of the machine where the base is the hierarchy's root, a hybrid
    host's: thousands with a thousand episodes open, twice per reset; issue #25.)"""
    controllers = frozenset(_read(path / "cgroup.controllers").split())
    enabled = frozenset(_read(path / "cgroup.subtree_control").split())
    wanted = controllers & frozenset(_CONTROLLERS)
    procs = (
        () if top or wanted <= enabled else tuple(int(p) for p in _read(path / "cgroup.procs").split() if p.isdigit())
    )
    if os.geteuid() == 0:
        usable = os.access(path / "cgroup.procs", os.W_OK) and os.access(path, os.W_OK | os.X_OK)
    else:
        usable = is_delegated(path)
    return V2Base(path, controllers, enabled, procs, usable, top, what)


_v2_lock = threading.Lock()
_v2_chosen: list[tuple[Hierarchy, Path]] = []  # the base our v2 cgroups go under, once chosen (a leaf moves us)


def v2_bases() -> tuple[Hierarchy, list[V2Base]] | None:
    """The v2 hierarchy and the bases to try, in order: the one already in use by this
    process, else our own cgroup, then (root) the hierarchy's root. None: no v2 mount."""
    mount = find_v2()
    if mount is None:
        return None
    hierarchy = Hierarchy(mount.mount, mount.root, True, os.geteuid() != 0, mount.mount)
    if _v2_chosen:
        h, base = _v2_chosen[0]
        return h, [read_v2_base(base, top=base == h.mount, what="sequester's cgroup")]
    bases = []
    own = own_cgroup_dir(mount.mount, mount.root)
    if own is not None:
        bases.append(read_v2_base(own, top=own == mount.mount, what="our own cgroup"))
    if os.geteuid() == 0 and own != mount.mount:
        bases.append(read_v2_base(mount.mount, top=True, what="the cgroup v2 root"))
    return hierarchy, bases


def systemd_scope_argv(unit: str, pid: int, *, user: bool) -> list[str]:
    """The ``busctl`` call that asks systemd (the system's, or with ``user`` the user's
    manager) for a transient scope ``unit`` holding ``pid`` with ``Delegate=yes``: what
    ``systemd-run --scope -p Delegate=yes`` does for the command it starts. Pure."""
    return [
        "busctl",
        *(["--user"] if user else []),
        "call",
        "org.freedesktop.systemd1",
        "/org/freedesktop/systemd1",
        "org.freedesktop.systemd1.Manager",
        "StartTransientUnit",
        "ssa(sv)a(sa(sv))",
        unit,
        "fail",
        "3",
        "PIDs",
        "au",
        "1",
        str(pid),
        "Delegate",
        "b",
        "true",
        "Description",
        "s",
        f"sequester {pid}: episodes' cgroups",
        "0",
    ]


def systemd_runs() -> bool:
    """systemd is this host's init (``sd_booted``)."""
    return Path("/run/systemd/system").is_dir()


_scope_tried: list[str] = []  # what asking systemd for a scope answered, once per process


def enter_systemd_scope() -> str | None:
    """Move this process into a delegated transient scope of systemd's (the system's for
    root, the user's manager for an ordinary user), once; None if it worked, else why not.
    Our own cgroup is then one we may make the episodes' under."""
    if _scope_tried:
        return _scope_tried[0] or None
    pid = os.getpid()
    unit = f"sequester-{pid}.scope"
    why = ""
    try:
        import subprocess

        done = subprocess.run(
            systemd_scope_argv(unit, pid, user=os.geteuid() != 0), capture_output=True, text=True, timeout=30
        )
        if done.returncode != 0:
            why = f"systemd gave no delegated scope ({done.stderr.strip()[:200] or done.returncode})"
        else:
            deadline = time.monotonic() + 5
            while not (own_cgroup(None) or "").endswith("/" + unit):
                if time.monotonic() > deadline:
                    why = f"systemd made {unit}, but this process is not in it"
                    break
                time.sleep(0.01)
    except (OSError, ImportError) as exc:
        why = f"systemd could not be asked for a delegated scope ({exc})"
    _scope_tried.append(why)
    return why or None


def _make_v2(name: str, memory_mb: int | None, cpus: float | None, pids: int | None) -> LimitGroups | str:
    found = v2_bases()
    if found is None:
        return "no cgroup v2 hierarchy is mounted"
    hierarchy, bases = found
    with _v2_lock:
        plan = plan_v2(
            bases,
            own_pids={os.getpid()},
            leaf_name=f"sequester-{os.getpid()}-host",
            memory_mb=memory_mb,
            cpus=cpus,
            pids=pids,
        )
        if isinstance(plan, str):
            return plan
        if plan.leaf is not None:
            plan.leaf.mkdir(exist_ok=True)
            for pid in plan.move:
                (plan.leaf / "cgroup.procs").write_text(str(pid))
        if plan.enable:
            (plan.base / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in plan.enable))
        if not _v2_chosen or plan.leaf is not None:
            # ``base`` of the hierarchy: where a pid recycled under the freezer is put back,
            # a cgroup that may hold processes (the leaf we moved to, if any).
            held = plan.leaf or (_v2_chosen[0][0].base if _v2_chosen else plan.base)
            _v2_chosen[:] = [(Hierarchy(hierarchy.mount, hierarchy.root, True, hierarchy.delegated, held), plan.base)]
        chosen = _v2_chosen[0][0]
    path = plan.base / name
    path.mkdir()
    group = LimitGroups([path], missing=dict(plan.missing), v2=chosen)
    try:
        for file, value, label in plan.writes:
            try:
                (path / file).write_text(value)
            except FileNotFoundError:
                if label is not None:
                    raise
                continue  # a helper file this kernel lacks (memory.swap.max without swap accounting)
            if label:
                group.applied.append(label)
    except OSError:
        group.remove(0)
        raise
    return group


# -- cgroup v1 ----------------------------------------------------------------------------


def _base(controller: str) -> Path | None:
    """Our own cgroup's folder in the v1 hierarchy of ``controller``."""
    mount, own = find_v1(controller), own_cgroup(controller)
    return None if mount is None or own is None else mount.mount / own.lstrip("/")


def _v1_controllers() -> frozenset[str]:
    """The controllers with a v1 hierarchy root may make our cgroups in."""
    if os.geteuid() != 0:
        return frozenset()  # v1 is never delegated
    return frozenset(c for c in _CONTROLLERS if (b := _base(c)) is not None and os.access(b, os.W_OK))


def _make_v1(name: str, memory_mb: int | None, cpus: float | None, pids: int | None) -> LimitGroups:
    paths = {}
    for controller in _CONTROLLERS:
        base = _base(controller)
        if base is not None:
            paths[controller] = base / name
    group = LimitGroups([])
    try:
        for path in paths.values():
            path.mkdir()
            group.paths.append(path)
        memsw = bool(memory_mb) and "memory" in paths and (paths["memory"] / "memory.memsw.limit_in_bytes").exists()
        for controller, file, value, label in limit_plan(
            memory_mb=memory_mb, cpus=cpus, pids=pids, v2=False, memsw=memsw
        ):
            if controller not in paths:
                if label:
                    group.missing[label] = f"no cgroup v1 {controller} hierarchy"
                continue
            (paths[controller] / file).write_text(value)
            if label:
                group.applied.append(label)
    except OSError:
        group.remove(0)
        raise
    return group


def _version(
    v1: frozenset[str],
    found: tuple[Hierarchy, list[V2Base]] | None,
    memory_mb: int | None,
    cpus: float | None,
    pids: int | None,
) -> str | None:
    """v1 or v2 (:func:`choose_version`), with v2's controllers those of the base its plan would use."""
    v2: frozenset[str] = frozenset()
    if found is not None:
        plan = plan_v2(found[1], own_pids={os.getpid()}, leaf_name="-", memory_mb=memory_mb, cpus=cpus, pids=pids)
        if isinstance(plan, V2Plan):
            v2 = next(b.controllers for b in found[1] if b.path == plan.base)
    return choose_version(v1, v2)


def make_limit_groups(
    name: str, *, memory_mb: int | None, cpus: float | None, pids: int | None
) -> tuple[LimitGroups | None, str | None]:
    """Cgroups named ``name`` with these limits, or ``(None, why not)``. A group may have
    applied only some of them: see :attr:`LimitGroups.missing`."""
    v1 = _v1_controllers()
    found = v2_bases()
    version = _version(v1, found, memory_mb, cpus, pids)
    if version != "v2" and found is not None and not _v2_chosen and systemd_runs() and len(v1) < len(_CONTROLLERS):
        # No cgroup of ours to use on v2 (a login session's scope, not delegated): a
        # delegated scope of systemd's, as `systemd-run --scope -p Delegate=yes` gives.
        if enter_systemd_scope() is None:
            found = v2_bases()
            version = _version(v1, found, memory_mb, cpus, pids)
    try:
        if version == "v2":
            made = _make_v2(name, memory_mb, cpus, pids)
            if isinstance(made, str):
                return None, made
            return made, None
        if version == "v1":
            return _make_v1(name, memory_mb, cpus, pids), None
    except OSError as exc:
        return None, f"the episode's cgroups could not be made ({exc})"
    if found is None:
        return None, "no cgroup v2 hierarchy is mounted, and cgroup v1 is for root only"
    why = plan_v2(found[1], own_pids={os.getpid()}, leaf_name="-", memory_mb=memory_mb, cpus=cpus, pids=pids)
    if isinstance(why, V2Plan):  # (usable, but with none of the controllers asked for)
        why = "; ".join(dict.fromkeys(why.missing.values())) or "no limit was asked for"
    return None, f"{why}{'' if os.geteuid() == 0 else ' (and cgroup v1 is for root only)'}"


def remove_stale_groups() -> None:
    """Remove the empty cgroups of episodes whose sequester process is gone (killed before
    its teardown), in each limit hierarchy. Never raises: a group that still has processes stays."""
    for controller in _CONTROLLERS:
        base = _base(controller)
        if base is not None:
            remove_stale_cgroups(base)
    found = v2_bases()
    for v2base in found[1] if found is not None else []:
        if v2base.usable:
            remove_stale_cgroups(v2base.path)
