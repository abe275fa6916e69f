"""Which ids an episode's user namespace maps: the caller as root, and 65,535 subordinate
ids for the image's other users (``_apt``, ``www-data``, a ``useradd``-ed ``app``), as a
container engine maps a container.

    inside 0            -> the caller (host root for a root caller, else the user itself)
    inside 1 .. 65535   -> the caller's subordinate range, base .. base + 65534

The range is the caller's own: an ordinary user's from ``/etc/subuid`` and ``/etc/subgid``
(``useradd`` gives every new user one), written by the field's setuid helpers
``newuidmap``/``newgidmap`` (Debian's ``uidmap``); root's from ``[episodes] id_range`` or
the ``root`` entry of those files, which ``sequester setup ids`` adds (never made silently).
Without one, the namespace maps the caller alone, as before, and the episode says so: then
``apt-get`` cannot drop to ``_apt``, ``chown`` to another user fails, ``su`` has no one to
become.

Pure but for reading the two files and writing the map (:func:`write_id_map`).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from sequester.errors import PolicyError, SandboxError

__all__ = [
    "IDS",
    "IdMap",
    "caller_id_map",
    "configured_id_map",
    "check_unused",
    "covered",
    "free_range",
    "used_ids",
    "parse_proc_map",
    "root_range_argv",
    "parse_id_range",
    "parse_subid_file",
    "write_id_map",
]

IDS = 65536  # ids an episode sees: 0 (the caller) and 1 .. 65535 (the subordinate range)
SUBUID, SUBGID = Path("/etc/subuid"), Path("/etc/subgid")


@dataclass(frozen=True)
class IdMap:
    """The caller's ``uid``/``gid`` as the namespace's root, and the first host id of the
    subordinate ranges (``sub_uid``, ``sub_gid``) for inside ids 1 .. ``IDS - 1``."""

    uid: int
    gid: int
    sub_uid: int
    sub_gid: int

    def host_uid(self, inside: int) -> int:
        """The host uid of ``inside`` (0 .. 65535; anything else is a ValueError, never a
        host id outside the range)."""
        _check_inside(inside)
        return self.uid if inside == 0 else self.sub_uid + inside - 1

    def host_gid(self, inside: int) -> int:
        _check_inside(inside)
        return self.gid if inside == 0 else self.sub_gid + inside - 1

    def inside_uid(self, host: int) -> int | None:
        """Who host uid ``host`` is inside (None: unmapped, shown as nobody)."""
        if host == self.uid:
            return 0
        return host - self.sub_uid + 1 if self.sub_uid <= host < self.sub_uid + IDS - 1 else None

    def inside_gid(self, host: int) -> int | None:
        if host == self.gid:
            return 0
        return host - self.sub_gid + 1 if self.sub_gid <= host < self.sub_gid + IDS - 1 else None

    def uid_map(self) -> str:
        """``/proc/PID/uid_map``'s text."""
        return f"0 {self.uid} 1\n1 {self.sub_uid} {IDS - 1}\n"

    def gid_map(self) -> str:
        return f"0 {self.gid} 1\n1 {self.sub_gid} {IDS - 1}\n"

    def describe(self) -> str:
        return f"uids 0 -> {self.uid}, 1-{IDS - 1} -> {self.sub_uid}-{self.sub_uid + IDS - 2}"


def _check_inside(inside: int) -> None:
    if not 0 <= inside < IDS:
        raise ValueError(f"id {inside} is not one an episode maps (0 .. {IDS - 1})")


def parse_subid_file(text: str, user: str, uid: int) -> list[tuple[int, int]]:
    """The ``(start, count)`` ranges of ``user`` (by name or uid) in ``/etc/subuid``-style
    ``text``, in file order; malformed lines are skipped (the setuid helpers do the same)."""
    found = []
    for line in text.splitlines():
        parts = line.strip().split(":")
        if len(parts) != 3 or parts[0] not in (user, str(uid)):
            continue
        try:
            start, count = int(parts[1]), int(parts[2])
        except ValueError:
            continue
        if start >= 0 and count > 0:
            found.append((start, count))
    return found


def parse_id_range(text: str, where: str = "episodes.id_range") -> tuple[int, int]:
    """``"BASE:COUNT"`` (or ``"BASE"``, 65,536 ids) of a configured range, checked: at least
    65,535 ids, above every id a system account uses (1,000 and below), within 32 bits."""
    base_text, _, count_text = str(text).partition(":")
    try:
        base, count = int(base_text), int(count_text or IDS)
    except ValueError:
        raise PolicyError(f"{where}: {text!r} is not BASE:COUNT (for example 100000:65536)") from None
    if count < IDS - 1:
        raise PolicyError(f"{where}: {text!r} has {count} ids; an episode needs {IDS - 1} beside the caller's")
    if base <= 1000 or base + count > 2**32 - 2:
        raise PolicyError(f"{where}: {text!r} is not a range of unused ids (above 1000, below 2^32 - 1)")
    return base, count


def parse_proc_map(text: str) -> list[tuple[int, int, int]]:
    """``/proc/PID/uid_map``'s lines as ``(inside, outside, count)``."""
    out = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 3 and all(f.isdigit() for f in fields):
            out.append((int(fields[0]), int(fields[1]), int(fields[2])))
    return out


def covered(ranges: list[tuple[int, int, int]], start: int, count: int) -> bool:
    """Whether ids ``start .. start + count - 1`` are all mapped by ``ranges`` (as seen from
    inside: the ``inside`` column)."""
    end = start + count
    while start < end:
        hit = next(((i, n) for i, _, n in ranges if i <= start < i + n), None)
        if hit is None:
            return False
        start = hit[0] + hit[1]
    return True


def _unmapped_here(ids: IdMap) -> str | None:
    """Why ``ids`` cannot be mapped by this process (its own namespace lacks them: sequester
    run inside a container, or a test's one-id namespace), or None."""
    for name, own, sub in (("uid_map", ids.uid, ids.sub_uid), ("gid_map", ids.gid, ids.sub_gid)):
        try:
            ranges = parse_proc_map(Path(f"/proc/self/{name}").read_text())
        except OSError:
            continue
        if not covered(ranges, own, 1) or not covered(ranges, sub, IDS - 1):
            return f"ids {sub}-{sub + IDS - 2} are not mapped in sequester's own user namespace ({name})"
    return None


def caller_id_map(configured: tuple[int, int] | None = None) -> tuple[IdMap | None, str | None]:
    """This process's map, or ``(None, why)`` when it has no range to map: ``configured``
    (``[episodes] id_range``, root only) wins, else the subordinate files."""
    uid, gid = os.getuid(), os.getgid()
    if configured is not None:
        if uid != 0:
            return None, "[episodes] id_range is root's: an ordinary user's range comes from /etc/subuid"
        check_unused(*configured)
        ids = IdMap(uid, gid, configured[0], configured[0])
        why = _unmapped_here(ids)
        return (None, f"the episode maps one id: {why}") if why else (ids, None)
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = str(uid)
    try:
        subuid = parse_subid_file(SUBUID.read_text(), name, uid)
        subgid = parse_subid_file(SUBGID.read_text(), name, uid)
    except OSError:
        subuid = subgid = []
    start_uid = next((s for s, c in subuid if c >= IDS - 1), None)
    start_gid = next((s for s, c in subgid if c >= IDS - 1), None)
    if start_uid is None or start_gid is None:
        fix = (
            "run `sequester setup ids` (root)"
            if uid == 0
            else f"add a range of {IDS} ids to /etc/subuid and /etc/subgid"
        )

        return None, (
            f"the episode maps one id ({name} as root): {name} has no range of {IDS - 1} subordinate ids "
            f"in /etc/subuid and /etc/subgid ({fix})"
        )
    if uid != 0 and (shutil.which("newuidmap") is None or shutil.which("newgidmap") is None):
        return None, "the episode maps one id: newuidmap/newgidmap (Debian's uidmap) are missing"
    ids = IdMap(uid, gid, start_uid, start_gid)
    why = _unmapped_here(ids) if uid == 0 else None  # (newuidmap checks an ordinary user's)
    return (None, f"the episode maps one id: {why}") if why else (ids, None)


def used_ids(subuid: str, subgid: str, owner: str = "root") -> list[tuple[int, int, str]]:
    """Ids the host already gives someone: ``(first, end, who)`` for every user's and
    group's own id and every subordinate range but ``owner``'s."""
    import grp

    used = [(p.pw_uid, p.pw_uid + 1, f"user {p.pw_name}") for p in pwd.getpwall()]
    used += [(g.gr_gid, g.gr_gid + 1, f"group {g.gr_name}") for g in grp.getgrall()]
    for name, text in (("/etc/subuid", subuid), ("/etc/subgid", subgid)):
        for line in text.splitlines():
            parts = line.strip().split(":")
            if len(parts) == 3 and parts[0] != owner and parts[1].isdigit() and parts[2].isdigit():
                used.append((int(parts[1]), int(parts[1]) + int(parts[2]), f"{parts[0]}'s range in {name}"))
    return used


def check_unused(base: int, count: int, where: str = "episodes.id_range") -> None:
    """Refuse a configured range any of whose ids the host gives someone else: an agent's
    ``chown`` (or an image's owners) would make files of that user (red team)."""
    texts = []
    for path in (SUBUID, SUBGID):
        try:
            texts.append(path.read_text())
        except OSError:
            texts.append("")
    clash = next(((f, e, who) for f, e, who in used_ids(*texts) if f < base + count and base < e), None)
    if clash is not None:
        raise PolicyError(
            f"{where}: {base}:{count} overlaps ids the host gives {clash[2]} ({clash[0]}-{clash[1] - 1}); "
            "choose unused ids (`sequester setup ids --dry-run` names a free range)"
        )


def write_id_map(pid: int, ids: IdMap) -> None:
    """Write ``ids`` as the user namespace map of ``pid`` (a process just made in a new
    user namespace, waiting for its map): root writes the files, an ordinary user runs
    the setuid helpers, which check the range against /etc/subuid and /etc/subgid.
    ``setgroups`` stays allowed (``apt`` and ``su`` call it)."""
    if os.geteuid() == 0:
        for name, text in (("uid_map", ids.uid_map()), ("gid_map", ids.gid_map())):
            with open(f"/proc/{pid}/{name}", "w") as f:
                f.write(text)
        return
    for tool, own, sub in (("newuidmap", ids.uid, ids.sub_uid), ("newgidmap", ids.gid, ids.sub_gid)):
        argv = [tool, str(pid), "0", str(own), "1", "1", str(sub), str(IDS - 1)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise SandboxError(f"{tool} could not map the episode's ids: {done.stderr.strip() or done.returncode}")


def configured_id_map(id_range: str | None) -> IdMap | None:
    """:func:`caller_id_map` for a configured ``[episodes] id_range`` (or none): the map
    alone (the reason there is none goes in an episode's notes, not a build's)."""
    return caller_id_map(parse_id_range(id_range) if id_range else None)[0]


def free_range(subuid: str, subgid: str, count: int = IDS, floor: int = 100000) -> int:
    """The first id at or above ``floor``, on a multiple of ``count``, from which ``count``
    ids are free in both files (what ``useradd`` would hand the next user is after all of
    them): where ``sequester setup ids`` puts root's range."""
    taken: list[tuple[int, int]] = []
    for text in (subuid, subgid):
        for line in text.splitlines():
            parts = line.strip().split(":")
            if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
                taken.append((int(parts[1]), int(parts[1]) + int(parts[2])))
    start = -(-floor // count) * count
    while True:
        clash = [end for first, end in taken if first < start + count and start < end]
        if not clash:
            return start
        start = -(-max(clash) // count) * count  # the next multiple of count past them


def root_range_argv(start: int, count: int = IDS) -> list[str]:
    """The ``usermod`` command that gives root ``count`` subordinate uids and gids from ``start``."""
    last = start + count - 1
    return ["usermod", "--add-subuids", f"{start}-{last}", "--add-subgids", f"{start}-{last}", "root"]
