"""List what the agent's writable layers change in the folders a verifier trusts.

Input: the episode's layer folders on the host; output: a stream of :class:`~.tamper.Change`
and a :class:`Scan` saying whether it saw everything. Whatever the layers hold, the scan
does not raise, recurse, follow a symlink, open anything but folders, or run unbounded:

* it walks with a :class:`~sequester.sandbox.fdwalk.Cursor` (one descriptor, no paths built, ``O_NOFOLLOW``):
  a chain 10,000 folders deep is walked like any other (``os.walk`` raised
  ``RecursionError`` at ~1,000);
* every entry is only ``lstat``-ed: fifos, sockets and devices are never opened; overlay
  whiteouts (char 0:0) are reported as deletions;
* a budget in entries and seconds (:class:`Budget`) bounds time and memory against
  millions of files; hitting it, a folder it cannot read (mode 000, as a non-root host
  user) or a tree moving under it marks the scan incomplete, with the reason;
* "replaced or added" asks the host whether ``/<path>`` exists with ``lstat``, and any error
  (``EACCES`` on ``/root/...`` as an ordinary user, ``ENAMETOOLONG``) is "unknown", never an
  exception; below a folder the host lacks, nothing is asked at all.

What is scanned (:func:`episode_layers`): every overlay layer (the operating system's
folders, :data:`~sequester.sandbox.mounts.SYSTEM_DIRS`), fresh folders with a system name, and the
start-up/configuration part of home folders (``/root`` and each ``/home/*``: every entry
whose name starts with a dot, with all below it). The agent's own work (``/app``, ``/srv``)
is not: no verifier trusts it.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePath

from sequester.environments.local.state import EpisodeDirs
from sequester.environments.local.tamper import ELIDED_MARK, LIMIT, Change, ChangeSummary, printable
from sequester.errors import SandboxError
from sequester.sandbox.fdwalk import Cursor, OtherFilesystem, open_root, show_path
from sequester.sandbox.idmap import IdMap
from sequester.sandbox.idspace import run_in_id_space
from sequester.sandbox.mounts import SYSTEM_DIRS

__all__ = [
    "Budget",
    "Layer",
    "Scan",
    "episode_layers",
    "report_episode",
    "view_points",
    "OPAQUE_XATTRS",
    "REDIRECT_XATTRS",
]

# overlayfs marks a folder the agent deleted and made again "opaque" (the host's content
# is hidden); trusted.* as host root, user.* for an unprivileged mount (``userxattr``).
OPAQUE_XATTRS = ("trusted.overlay.opaque", "user.overlay.opaque")
REDIRECT_XATTRS = ("trusted.overlay.redirect", "user.overlay.redirect")
_MAX_PROBLEMS = 10
# Paths below ``/`` are kept whole up to PATH_MAX; a deeper entry (only an agent's chain
# makes one) gets an elided path, so a 10,000-deep chain costs O(depth), not O(depth**2).
_PATH_LIMIT = 4096

# What the host has at a folder's path (for the entries below it).
_HOST_DIR, _HOST_NONE, _HOST_UNKNOWN = "dir", "none", "unknown"


@dataclass(frozen=True)
class Budget:
    """How much one scan may read: entries listed (all layers together) and seconds."""

    entries: int = 500_000
    seconds: float = 15.0


@dataclass(frozen=True)
class Layer:
    """A layer folder on the host: ``top`` is the top-level folder it holds the agent's
    writes for; ``overlay`` when it lies over the host's ``/<top>`` (whiteouts, lower
    lookups), else a fresh folder; ``homes``: ``"root"`` for a home folder, ``"parent"`` for
    a folder of homes (``/home``), ``""`` for a system folder scanned whole."""

    top: str
    path: Path
    overlay: bool
    homes: str = ""


def episode_layers(dirs: EpisodeDirs, *, image: bool = False, sealed: Sequence[Path] = ()) -> list[Layer]:
    """The layers of an episode that a verifier trusts (see the module's docstring). On an
    image (``image``) the episode has one writable layer for its whole tree: its system
    folders and homes are scanned, the rest (``/app``, ``/tmp``) is the agent's own; and
    so are the ``sealed`` layers of its checkpoints (:mod:`.checkpoint`), lowest first (a
    path changed in more than one counts in each)."""
    if image:
        return [
            layer
            for root in (*sealed, dirs.upper_root)
            for name in _names(root)
            if (layer := _layer(name, root / name, overlay=True)) is not None
            and os.path.isdir(layer.path)
            and not os.path.islink(layer.path)
        ]
    layers = []
    for kind in ("upper", "new"):
        folder = dirs.root / kind
        for name in _names(folder):
            path = folder / name
            if kind == "upper":
                layers.append(Layer(name, path, overlay=True))
            elif (layer := _layer(name, path, overlay=False)) is not None:
                layers.append(layer)
    return layers


def _names(folder: Path) -> list[str]:
    try:
        return sorted(os.listdir(folder))
    except OSError:
        return []


def _layer(name: str, path: Path, *, overlay: bool) -> Layer | None:
    if name in SYSTEM_DIRS:
        return Layer(name, path, overlay=overlay)
    if name == "root":
        return Layer(name, path, overlay=overlay, homes="root")
    if name == "home":
        return Layer(name, path, overlay=overlay, homes="parent")
    return None


@dataclass
class _Dir:
    """Walker state of one folder: its path below ``/``, what the host has there, names
    still to look at (reversed), and which names count (a home keeps only dotfiles)."""

    rel: str | None  # None below _PATH_LIMIT: the path is elided from the cursor's names
    host: str
    names: list[str]
    homes: str = ""


@dataclass
class Scan:
    """One bounded scan over some layers. Iterate :meth:`changes`; afterwards
    :attr:`complete` tells whether every entry was seen, :attr:`problems` why not."""

    budget: Budget = field(default_factory=Budget)
    known: frozenset[str] = frozenset()  # see :func:`view_points`: not reported
    entries: int = 0
    problems: list[str] = field(default_factory=list)
    n_problems: int = 0
    denied: bool = False  # a folder or entry this user may not read (see :func:`report_episode`)
    started: float = field(default_factory=time.monotonic)
    _stopped: bool = False
    _full: bool = False
    _ticks: int = 0

    @property
    def complete(self) -> bool:
        return self.n_problems == 0

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started

    def problem(self, text: str) -> None:
        self.n_problems += 1
        if len(self.problems) < _MAX_PROBLEMS:
            self.problems.append(text)

    def _time_up(self) -> bool:
        """The seconds are spent: stop everything (checked every 256 calls: cheap)."""
        if self._stopped:
            return True
        self._ticks += 1
        if self._ticks % 256 == 0 and self.seconds > self.budget.seconds:
            self.problem(f"stopped after {self.budget.seconds:g} s (the scan's budget), {self.entries:,} entries read")
            self._stopped = True
        return self._stopped

    def _may_list(self) -> bool:
        """One more entry may be read. Once the entries are spent, nothing more is listed,
        but what was listed is still looked at (each entry once: still bounded)."""
        if self.entries < self.budget.entries:
            return not self._time_up()
        if not self._full:
            self._full = True
            self.problem(f"stopped after {self.entries:,} entries (the scan's budget)")
        return False

    def changes(self, layers: Iterable[Layer]) -> Iterator[Change]:
        """Every change in ``layers``, folder by folder in name order, until the budget ends."""
        for layer in layers:
            if self._time_up():
                return
            try:
                root_fd = open_root(layer.path)
            except OSError as exc:
                self.problem(f"cannot open the layer of /{layer.top}: {exc.strerror}")
                continue
            try:
                yield from self._walk(layer, root_fd)
            finally:
                os.close(root_fd)

    def _list(self, fd: int, rel: str, homes: str) -> list[str] | None:
        """The names of the folder at ``fd`` to look at, counted against the budget (a home
        keeps only its dot-entries). None when it cannot be read."""
        names = []
        try:
            with os.scandir(fd) as entries:
                for entry in entries:
                    if not self._may_list():
                        break
                    self.entries += 1
                    if homes != "root" or entry.name.startswith("."):
                        names.append(entry.name)
        except OSError as exc:
            self.denied |= exc.errno in (errno.EACCES, errno.EPERM)
            self.problem(f"cannot list /{printable(_short(rel))}: {exc.strerror}")
            return None
        names.sort(reverse=True)  # popped from the end: name order
        return names

    def _walk(self, layer: Layer, root_fd: int) -> Iterator[Change]:
        names = self._list(root_fd, layer.top, layer.homes)
        if names is None:
            return
        top = _Dir(layer.top, _HOST_DIR if layer.overlay else _HOST_NONE, names, layer.homes)
        cursor = Cursor(root_fd, top)
        try:
            while True:
                here: _Dir = cursor.top.data
                if here.names and not self._time_up():
                    change = self._entry(layer, cursor, here, here.names.pop())
                    if change is not None:
                        yield change
                elif cursor.depth == 0:
                    return
                elif not cursor.leave():
                    where = show_path([layer.top, *cursor.names()])
                    self.problem(f"the layer changed during the scan (folders moved) under /{printable(where)}")
        finally:
            cursor.close()

    def _entry(self, layer: Layer, cursor: Cursor, here: _Dir, name: str) -> Change | None:
        """Look at one entry of the cursor's folder (entering it when a folder)."""
        if here.rel is not None and len(here.rel) + len(name) < _PATH_LIMIT:
            rel, full = f"{here.rel}/{name}", True
        else:
            rel, full = _elided(layer.top, cursor, name), False
        try:
            st = os.stat(name, dir_fd=cursor.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None  # removed meanwhile (a running agent)
        except OSError as exc:
            self.denied |= exc.errno in (errno.EACCES, errno.EPERM)
            self.problem(f"cannot stat /{printable(_short(rel))}: {exc.strerror}")
            return Change(rel, "changed", "cannot be examined")
        mode = st.st_mode
        if layer.overlay and stat.S_ISCHR(mode) and st.st_rdev == 0:
            return Change(rel, "deleted")  # an overlay whiteout: the host's path is gone in the view
        host = _host_kind(rel, here.host) if full else (_HOST_UNKNOWN if here.host == _HOST_DIR else here.host)
        known = full and rel in self.known  # a mount point of the view: sequester's, not the agent's
        if not stat.S_ISDIR(mode):
            # a file in /home itself is in no home
            return Change(rel, _kind(host), _detail(mode)) if here.homes != "parent" and not known else None
        # /home/<user>: a home folder, not itself a change that matters; its dot-entries are
        homes, report = ("root", False) if here.homes == "parent" else ("", not known)
        return self._enter(cursor, name, rel if full else None, rel, host, homes=homes, report=report)

    def _enter(
        self, cursor: Cursor, name: str, keep: str | None, rel: str, host: str, *, homes: str, report: bool
    ) -> Change | None:
        """Enter the folder ``name`` and list it; the change it is itself, if any."""
        try:
            cursor.enter(name)
        except OtherFilesystem:
            self.problem(f"/{printable(_short(rel))} is a mount point: not examined")
            return Change(rel, _kind(host), "folder, a mount point: not examined")
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                return None  # replaced meanwhile by a running agent; the new entry is not seen
            # mode 000 as an ordinary host user: we never chmod the agent's files to look
            self.denied |= exc.errno in (errno.EACCES, errno.EPERM)
            self.problem(f"cannot enter /{printable(_short(rel))}: {exc.strerror}")
            return Change(rel, _kind(host), "folder, unreadable: not examined")
        opaque, redirect = _overlay_marks(cursor.fd)
        # Below a folder the host has as a file (or lacks), everything is added.
        below = {_HOST_DIR: _HOST_DIR, _HOST_UNKNOWN: _HOST_UNKNOWN}.get(host, _HOST_NONE)
        change = None
        if redirect:
            below = _HOST_UNKNOWN
            change = Change(rel, "replaced", "folder, moved here from elsewhere")
        elif host == _HOST_DIR and opaque:
            below = _HOST_NONE
            change = Change(rel, "replaced", "folder, the host's content hidden")
        elif host != _HOST_DIR and report:
            change = Change(rel, _kind(host), "folder")
        names = self._list(cursor.fd, rel, homes)
        cursor.top.data = _Dir(keep, below, names or [], homes)
        return change


def _host_kind(rel: str, parent: str) -> str:
    """What the host has at ``/rel``: ``dir``, ``none``, ``file`` or ``unknown``; never raises
    (an ordinary user cannot stat below ``/root``; a deep path is over PATH_MAX)."""
    if parent != _HOST_DIR:
        return parent
    try:
        st = os.lstat("/" + rel)
    except (FileNotFoundError, NotADirectoryError):
        return _HOST_NONE
    except (OSError, ValueError):
        return _HOST_UNKNOWN
    return _HOST_DIR if stat.S_ISDIR(st.st_mode) else "file"


def _kind(host: str) -> str:
    return {_HOST_NONE: "added", _HOST_UNKNOWN: "changed"}.get(host, "replaced")


def _detail(mode: int) -> str:
    """The kind of a non-folder entry, for the reader (a regular file says nothing)."""
    if stat.S_ISREG(mode) and not mode & 0o6000:
        return ""
    kinds = (
        (stat.S_ISLNK, "symlink"),
        (stat.S_ISFIFO, "fifo"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    )
    text = next((label for test, label in kinds if test(mode)), "")
    flags = [label for bit, label in ((stat.S_ISUID, "setuid"), (stat.S_ISGID, "setgid")) if mode & bit]
    return ", ".join(filter(None, [text, *flags]))


def _overlay_marks(fd: int) -> tuple[bool, bool]:
    try:
        names = os.listxattr(fd)
    except OSError:
        return False, False
    return any(n in names for n in OPAQUE_XATTRS), any(n in names for n in REDIRECT_XATTRS)


def _elided(top: str, cursor: Cursor, name: str) -> str:
    """The path of ``name`` in the cursor's folder with its middle elided, in O(1) of the depth."""
    frames = cursor.frames
    head = [f.name for f in frames[1:9]]
    tail = [f.name for f in frames[max(9, len(frames) - 8) :]]
    skipped = len(frames) - 1 - len(head) - len(tail)
    return "/".join([top, *head, f"...[{skipped}{ELIDED_MARK}", *tail, name])


def _short(rel: str) -> str:
    return show_path(rel.split("/")) if len(rel) > 240 else rel


def view_points(paths: Iterable[str | PurePath]) -> frozenset[str]:
    """The view's mount points (``op.dest`` of every mount) and their parents, relative to
    ``/``: bwrap creates them in the layers (``/opt/sequester-verifier``, the host Python's
    folders under ``/root``), so they are no change of the agent's."""
    out: set[str] = set()
    for path in paths:
        parts = Path(path).parts[1:]
        out.update("/".join(parts[:n]) for n in range(2, len(parts) + 1))
    return frozenset(out)


def report_episode(
    dirs: EpisodeDirs,
    budget: Budget | None = None,
    limit: int = LIMIT,
    known: frozenset[str] = frozenset(),
    ids: IdMap | None = None,
    image: bool = False,
    sealed: Sequence[Path] = (),
) -> list[str]:
    """The tampering report of an episode's layers (:func:`~.tamper.tampering_report`
    lines), from one bounded scan; never raises for anything the agent left. ``known``:
    :func:`view_points` of the episode's mounts.

    An ordinary caller cannot read what the agent made unreadable (mode 000, a folder of
    one of the episode's other users); when the scan met such an entry and the episode
    maps ``ids``, it is made again as root of a namespace that maps them, which reads
    everything the episode owns (never changing a mode to look)."""
    scan = Scan(budget or Budget(), known)
    summary = ChangeSummary(limit, host_has=_host_has)
    for change in scan.changes(episode_layers(dirs, image=image, sealed=sealed)):
        summary.add(change)
    lines = summary.lines(scan.problems, scan.n_problems)
    if scan.denied and ids is not None and os.getuid() != 0:
        try:
            again = run_in_id_space(
                ids,
                __name__,
                "report_episode_at",
                str(dirs.root),
                sorted(known),
                limit,
                (budget or Budget()).entries,
                image,
                [str(p) for p in sealed],
            )
        except SandboxError as exc:
            return [*lines, f"the scan could not be made again as the episode's root: {printable(str(exc))}"]
        if isinstance(again, list) and all(isinstance(line, str) for line in again):
            return again
    return lines


def report_episode_at(
    root: str, known: list[str], limit: int, entries: int, image: bool, sealed: list[str] | None = None
) -> list[str]:
    """:func:`report_episode` of the episode folder ``root`` (the id-space worker's entry)."""
    return report_episode(
        EpisodeDirs(Path(root)),
        Budget(entries=entries),
        limit,
        frozenset(known),
        image=image,
        sealed=tuple(Path(p) for p in sealed or ()),
    )


def _host_has(rel: str) -> bool:
    try:
        os.lstat("/" + rel)
    except (OSError, ValueError):
        return False
    return True
