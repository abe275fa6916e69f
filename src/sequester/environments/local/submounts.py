"""Top-level folders with other mounts below them: container storage under
``/var/lib/docker``, ``/var/lib/containers``, ``/var/lib/kubelet``, anything bound below
``/opt`` or ``/usr``.

What the kernel needs. bwrap makes the view in a new user namespace, so every mount it
inherits from the host is *locked* to its parent there. overlayfs takes each lower folder
as a private clone of the one mount holding it (``clone_private_mount``), which refuses
(EINVAL, "overlayfs: failed to clone lowerpath") when that mount has a locked mount
anywhere below the folder: ``/var`` cannot be a lower folder while ``/var/lib/x`` is a
mount point, as root or not (a locked mount cannot be unmounted either, and a
non-recursive bind of such a folder fails the same way). Its *parts* that hold no mount
can: ``/var/cache``, ``/var/lib/dpkg``, ...

So such a folder ``T`` is composed, and only such a folder (without mounts below it, ``T``
is still the one overlay of :mod:`.view`):

* the *spine*: ``T`` and the folders on the way from it to each mount point. It is an
  overlay too, whose lower folder is a *skeleton* on the host: the spine's folders (the
  host's modes), its symlinks (the same targets), copies of its small world-readable files,
  and an empty placeholder for every other entry. Being read-only, it is shared by every
  episode while the host's folders stay the same (``<state_dir>/skeleton-T-<digest of its
  content>``, made once). Its upper folder is ``<episode>/new/T``: what the agent writes directly in
  a spine folder lands there (on disk, scanned by the tampering report);
* every other folder of the spine's is a *part*: the host's folder beneath its own upper
  folder ``<episode>/upper/T/<path>``: exactly where staging puts the environment's files
  and where the tampering report looks, so both work as for a plain overlay. (The parts'
  uppers are not below another overlay's upper or work folder: overlayfs would warn in the
  kernel log for each.) Other files of the spine are bound read-only;
* every **mount point below T is hidden**: an empty placeholder (folder or file), writable
  through the spine's overlay. They are other programs' data (container storage, a
  kubelet's secrets) and not part of the operating system; what is mounted there is never
  shown;
* entries the environment's files were staged to at a spine folder's level (a ``COPY`` to
  ``/opt/app`` while ``/opt`` is a spine) are bound writable from their staging folder.

A spine that would need more than :data:`MAX_PARTS` part overlays (a Docker host's
``/var/lib/docker/overlay2`` has one folder per layer) is cut short: its deepest folders
are hidden whole instead, until it fits (``T``'s own entries are always parts).

:func:`plan_composite` is pure; :func:`gather_submounts`, :func:`staged_names` and
:func:`make_skeleton` touch the filesystem.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from sequester.environments.local.state import EpisodeDirs
from sequester.sandbox.mounts import MountKind, MountOp

__all__ = [
    "Entry",
    "Submounts",
    "Composite",
    "SkeletonItem",
    "MAX_PARTS",
    "parse_mountinfo",
    "mounts_below",
    "gather_submounts",
    "staged_names",
    "plan_composite",
    "make_skeleton",
    "describe_mounts_below",
]

MAX_PARTS = 64  # part overlays per composed folder (~0.25 ms of bwrap's time each, measured)
COPY_LIMIT = 256 * 1024  # a spine's regular files up to this size are copied into the skeleton
_LIST_LIMIT = 4096  # a spine folder with more entries is hidden whole, never listed further


@dataclass(frozen=True)
class Entry:
    """One entry of a spine folder: ``kind`` is ``dir``, ``link``, ``file`` (regular) or ``other``."""

    name: str
    kind: str
    target: str | None = None
    mode: int = 0o755
    uid: int = 0
    gid: int = 0
    copyable: bool = False  # a regular file everyone may read, at most COPY_LIMIT bytes
    stamp: tuple[int, int] = (0, 0)  # (size, mtime_ns): a copy in a cached skeleton is as fresh as this


@dataclass(frozen=True)
class Submounts:
    """The facts of one top-level folder with mounts below it. Paths are relative to
    ``top`` (``"lib/docker"``; ``""`` is ``top`` itself)."""

    top: Path
    points: tuple[str, ...]  # the top-most mount points below top
    listings: Mapping[str, tuple[Entry, ...]] = field(default_factory=dict)  # every spine folder's entries
    attrs: Mapping[str, tuple[int, int, int]] = field(default_factory=dict)  # spine folder: (mode, uid, gid)
    unlisted: frozenset[str] = frozenset()  # spine folders that could not be listed (or too big)
    point_is_dir: Mapping[str, bool] = field(default_factory=dict)


@dataclass(frozen=True)
class SkeletonItem:
    """One thing to make on the host before bwrap starts: ``dir`` (mode, uid, gid), ``link``
    (target), ``copy`` (from source), ``file`` (an empty placeholder), or ``upper``: an upper
    folder, made with the host folder's mode and owner (the overlay's root shows them)."""

    kind: str
    path: Path
    mode: int = 0o755
    uid: int = 0
    gid: int = 0
    target: str | None = None
    source: Path | None = None


@dataclass(frozen=True)
class Composite:
    top: Path
    ops: tuple[tuple[MountOp, int], ...]  # (op, rank), for the view's ordering
    skeleton: tuple[SkeletonItem, ...]  # below skeleton_root, made once and shared (a lower folder is read-only)
    hidden: tuple[Path, ...]  # the view's paths hidden as empty placeholders
    skeleton_root: Path = Path()
    uppers: tuple[SkeletonItem, ...] = ()  # the episode's own: the spine's and the parts' upper folders


# -- facts ------------------------------------------------------------------------------------


def _unescape(field_text: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as ``\\ooo``."""
    out, i = [], 0
    while i < len(field_text):
        c = field_text[i]
        if c == "\\" and i + 3 < len(field_text) and field_text[i + 1 : i + 4].isdigit():
            out.append(chr(int(field_text[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(c)
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[tuple[str, str, str]]:
    """``(mount point, filesystem type, source)`` of each line of ``/proc/self/mountinfo``."""
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if not sep or len(fields) < 5 or not rest:
            continue
        out.append((_unescape(fields[4]), _unescape(rest[0]), _unescape(rest[1]) if len(rest) > 1 else ""))
    return out


def mounts_below(top: PurePosixPath, mounts: Iterable[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """The mounts strictly below ``top``, shallowest first (the same point may repeat)."""
    found = [m for m in mounts if PurePosixPath(m[0]).is_relative_to(top) and PurePosixPath(m[0]) != top]
    return sorted(found, key=lambda m: (len(PurePosixPath(m[0]).parts), m[0]))


def _read_mountinfo() -> list[tuple[str, str, str]]:
    try:
        with open("/proc/self/mountinfo") as f:
            return parse_mountinfo(f.read())
    except OSError:
        return []


def _topmost(points: Iterable[str]) -> tuple[str, ...]:
    kept: list[PurePosixPath] = []
    for p in sorted({PurePosixPath(p) for p in points}, key=lambda p: (len(p.parts), str(p))):
        if not any(p.is_relative_to(k) for k in kept):
            kept.append(p)
    return tuple(str(p) for p in kept)


def _entry(folder: Path, name: str) -> Entry | None:
    try:
        st = os.lstat(folder / name)
    except OSError:
        return None
    perm = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        try:
            return Entry(name, "link", target=os.readlink(folder / name))
        except OSError:
            return None
    if stat.S_ISDIR(st.st_mode):
        return Entry(name, "dir", mode=perm, uid=st.st_uid, gid=st.st_gid)
    if stat.S_ISREG(st.st_mode):
        copyable = bool(perm & 0o004) and st.st_size <= COPY_LIMIT and not perm & 0o6000
        return Entry(
            name, "file", mode=perm, uid=st.st_uid, gid=st.st_gid, copyable=copyable, stamp=(st.st_size, st.st_mtime_ns)
        )
    return Entry(name, "other", mode=perm, uid=st.st_uid, gid=st.st_gid)


def gather_submounts(
    tops: Iterable[Path], mountinfo: list[tuple[str, str, str]] | None = None
) -> dict[Path, Submounts]:
    """For each of ``tops`` that has mounts below it: its facts (one read of
    ``/proc/self/mountinfo``; the spine folders are listed). Tops without any are left out."""
    mounts = _read_mountinfo() if mountinfo is None else mountinfo
    out: dict[Path, Submounts] = {}
    for top in tops:
        below = mounts_below(PurePosixPath(top), mounts)
        if not below:
            continue
        points = _topmost(str(PurePosixPath(m[0]).relative_to(top)) for m in below)
        spine = {""} | {
            str(PurePosixPath(*PurePosixPath(p).parts[:n]))
            for p in points
            for n in range(1, len(PurePosixPath(p).parts))
        }
        listings: dict[str, tuple[Entry, ...]] = {}
        attrs: dict[str, tuple[int, int, int]] = {}
        unlisted: set[str] = set()
        for rel in sorted(spine, key=lambda r: (r.count("/"), r)):
            folder = top / rel if rel else top
            try:
                st = os.stat(folder, follow_symlinks=False)
                names = sorted(os.listdir(folder))
            except OSError:
                unlisted.add(rel)
                continue
            if not stat.S_ISDIR(st.st_mode) or len(names) > _LIST_LIMIT:
                unlisted.add(rel)
                continue
            attrs[rel] = (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
            listings[rel] = tuple(e for e in (_entry(folder, n) for n in names) if e is not None)
        point_is_dir = {p: _is_plain_dir(top / p) for p in points}
        out[top] = Submounts(top, points, listings, attrs, frozenset(unlisted), point_is_dir)
    return out


def _is_plain_dir(path: Path) -> bool:
    """A mount point's kind; one this caller may not even look at (below root's 0700
    ``/var/lib/containers``, for an ordinary user) is taken for a folder, what mount points
    nearly always are: it becomes an empty placeholder either way."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return True


def staged_names(sub: Submounts, dirs: EpisodeDirs) -> dict[str, frozenset[str]]:
    """The names staging put into each spine folder's level of ``upper/T`` (after staging)."""
    out = {}
    for rel in sub.listings:
        folder = dirs.upper(sub.top.name) / rel if rel else dirs.upper(sub.top.name)
        try:
            out[rel] = frozenset(os.listdir(folder))
        except OSError:
            continue
    return out


# -- the plan (pure) --------------------------------------------------------------------------


def _parts_needed(sub: Submounts, spine: set[str], hidden: set[str]) -> int:
    n = 0
    for rel in spine:
        for e in sub.listings.get(rel, ()):
            child = f"{rel}/{e.name}" if rel else e.name
            if e.kind == "dir" and child not in spine and child not in hidden:
                n += 1
    return n


def _spine_and_hidden(sub: Submounts, max_parts: int) -> tuple[set[str], set[str]]:
    hidden = set(sub.points)
    spine: set[str] = {""}
    for p in sub.points:
        parts = PurePosixPath(p).parts
        spine.update(str(PurePosixPath(*parts[:n])) for n in range(1, len(parts)))

    def cut(rel: str) -> None:  # hide rel whole: it and everything below leave the spine
        spine.difference_update({s for s in spine if s == rel or s.startswith(rel + "/")})
        hidden.difference_update({h for h in hidden if h.startswith(rel + "/")})
        hidden.add(rel)

    for rel in sorted(sub.unlisted, key=lambda r: -r.count("/")):
        if rel and rel in spine:
            cut(rel)
    while _parts_needed(sub, spine, hidden) > max_parts:
        deeper = [s for s in spine if s]
        if not deeper:
            break
        # the deepest first; among those the one with the most entries
        cut(max(deeper, key=lambda s: (s.count("/"), len(sub.listings.get(s, ())), s)))
    return spine, hidden


def plan_composite(
    sub: Submounts,
    dirs: EpisodeDirs,
    *,
    covered: Iterable[Path] = (),
    staged: Mapping[str, frozenset[str]] | None = None,
    max_parts: int = MAX_PARTS,
    is_root: bool = True,
) -> Composite:
    """The mounts and the skeleton that stand for ``sub.top`` (see the module's docstring).
    ``covered``: view paths the rest of the view mounts over anyway (``/var/tmp``, hidden
    folders): no part overlay for them; ``staged``: :func:`staged_names`."""
    covered_text = tuple(str(c) for c in covered)
    staged = staged or {}

    def under_cover(view: Path) -> bool:  # the rest of the view mounts over it (or a parent)
        v = str(view)
        return any(v == c or v.startswith(c + "/") for c in covered_text)

    top, name = sub.top, sub.top.name
    skel = Path("/skeleton") / name  # placeholder root; relocated below once the content is known
    spine, hidden = _spine_and_hidden(sub, max_parts)
    ops: list[tuple[MountOp, int]] = [
        (MountOp(MountKind.OVERLAY, top, source=skel, upper=dirs.new(name), work=dirs.work(name)), 0)
    ]
    mode, uid, gid = sub.attrs.get("", (0o755, 0, 0))
    items: list[SkeletonItem] = [SkeletonItem("dir", skel, mode, uid, gid)]
    uppers: list[SkeletonItem] = [SkeletonItem("upper", dirs.new(name), mode, uid, gid)]
    hidden_paths: list[Path] = []
    n_part = 0
    for rel in sorted(spine, key=lambda r: (r.count("/"), r)):
        here_view = top / rel if rel else top
        here_skel = skel / rel if rel else skel
        for e in sub.listings.get(rel, ()):
            child = f"{rel}/{e.name}" if rel else e.name
            view, at = here_view / e.name, here_skel / e.name
            if (
                e.name in staged.get(rel, frozenset())
                and child not in spine
                and not (e.kind == "dir" and child not in hidden)
            ):
                # staging put something where the host has a file, link or hidden point: it wins
                items.append(SkeletonItem("dir" if e.kind == "dir" else "file", at, e.mode, e.uid, e.gid))
                if not under_cover(view):
                    ops.append((MountOp(MountKind.BIND, view, source=dirs.upper(name) / child), 1))
                continue  # (a staged entry of another kind than the host's fails the start, with bwrap's message)
            if child in spine:
                a_mode, a_uid, a_gid = sub.attrs.get(child, (e.mode, e.uid, e.gid))
                items.append(SkeletonItem("dir", at, a_mode, a_uid, a_gid))
            elif child in hidden:
                items.append(SkeletonItem("dir" if e.kind == "dir" else "file", at, e.mode, e.uid, e.gid))
                hidden_paths.append(view)
            elif e.kind == "link":
                items.append(SkeletonItem("link", at, target=e.target))
            elif e.kind == "dir":
                items.append(SkeletonItem("dir", at, e.mode, e.uid, e.gid))
                if not under_cover(view):
                    upper = dirs.upper(name) / child
                    uppers.append(SkeletonItem("upper", upper, e.mode, e.uid, e.gid))
                    work = dirs.root / "partwork" / name / str(n_part)
                    n_part += 1
                    ops.append((MountOp(MountKind.OVERLAY, view, source=view, upper=upper, work=work), 0))
            elif e.kind == "file" and e.copyable:
                items.append(SkeletonItem("copy", at, e.mode, e.uid, e.gid, source=view, target=repr(e.stamp)))
            else:
                items.append(SkeletonItem("file", at, 0o644, e.uid, e.gid))
                if not under_cover(view):
                    ops.append((MountOp(MountKind.READONLY, view, source=view), 0))
        # entries only staging has (a COPY to a new folder at the spine's level): bound writable
        host_names = {e.name for e in sub.listings.get(rel, ())}
        for new in sorted(staged.get(rel, frozenset()) - host_names):
            child = f"{rel}/{new}" if rel else new
            source = dirs.upper(name) / child
            if under_cover(here_view / new):
                continue
            ops.append((MountOp(MountKind.BIND, here_view / new, source=source), 1))  # bwrap makes its mount point
    if not is_root:
        items, uppers = [_own(i) for i in items], [_own(i) for i in uppers]
    # The skeleton is the same for every episode while the host's folders are: shared, in
    # the state folder, named after its content (made once; see make_skeleton).
    digest = hashlib.sha256(
        repr([(str(i.path), i.kind, i.mode, i.uid, i.gid, i.target, str(i.source)) for i in items]).encode()
    ).hexdigest()[:16]
    root = dirs.root.parent / f"skeleton-{name}-{digest}"
    items = [
        dataclasses.replace(
            i, path=root / i.path.relative_to(Path("/skeleton")), target=None if i.kind == "copy" else i.target
        )
        for i in items
    ]
    ops = [(dataclasses.replace(op, source=root / name) if op.dest == top else op, rank) for op, rank in ops]
    return Composite(top, tuple(ops), tuple(items), tuple(hidden_paths), root, tuple(uppers))


def _own(item: SkeletonItem) -> SkeletonItem:
    """An ordinary user cannot give files away: its skeleton is its own."""
    return SkeletonItem(item.kind, item.path, item.mode, -1, -1, item.target, item.source)


# -- making it --------------------------------------------------------------------------------


def make_skeleton(composite: Composite) -> None:
    """Make the composite's shared skeleton if it is not there yet (built aside, then renamed
    into place: episodes starting together never see half of one), then the episode's
    upper folders, with the host folders' modes (and owners, for root)."""
    root = composite.skeleton_root
    if not root.is_dir():
        root.parent.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(prefix=".building-", dir=root.parent))
        try:
            _make_items(composite.skeleton, root, building)
            os.rename(building, root)
        except OSError:
            if not root.is_dir():
                raise
        finally:
            if building.exists():
                shutil.rmtree(building, ignore_errors=True)
    else:
        try:
            os.utime(root)  # in use: stale-state removal takes only skeletons untouched for a day
        except OSError:
            pass
    _make_items(composite.uppers, None, None)


def _make_items(items: Iterable[SkeletonItem], root: Path | None, building: Path | None) -> None:
    for item in items:
        p = building / item.path.relative_to(root) if root is not None and building is not None else item.path
        if item.kind in ("dir", "upper"):
            p.mkdir(parents=item.kind == "upper", exist_ok=True)
            _attrs(p, item)
        elif item.kind == "link":
            os.symlink(item.target or "", p)
        elif item.kind == "copy":
            assert item.source is not None  # every "copy" item is made with its source
            try:
                shutil.copyfile(item.source, p, follow_symlinks=False)
            except OSError:  # gone or changed meanwhile: an empty file stands in for it
                p.touch()
            _attrs(p, item)
        elif item.kind == "file":
            p.touch()
            _attrs(p, item)


def _attrs(p: Path, item: SkeletonItem) -> None:
    if item.uid >= 0:
        try:
            os.chown(p, item.uid, item.gid, follow_symlinks=False)
        except OSError:
            pass
    try:
        os.chmod(p, item.mode)
    except OSError:
        pass


def describe_mounts_below(tops: Iterable[Path], limit: int = 8) -> str:
    """``"/var/lib/x (tmpfs), ..."``: the mounts below ``tops`` right now, for error messages."""
    mounts = _read_mountinfo()
    found = [m for top in tops for m in mounts_below(PurePosixPath(top), mounts)]
    shown = [
        f"{point} ({fstype}{', ' + source if source and source != fstype else ''})"
        for point, fstype, source in found[:limit]
    ]
    if len(found) > limit:
        shown.append(f"and {len(found) - limit} more")
    return ", ".join(shown)
