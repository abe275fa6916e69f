"""Where the cgroup hierarchies are and which cgroup is ours in each: the one finder that
the freezer, the limits and the image builder use.

Read from ``/proc/self/mountinfo`` (every ``cgroup2`` mount, and each ``cgroup`` v1 mount
with the controllers it carries) and ``/proc/self/cgroup`` (our cgroup in each hierarchy:
``0::PATH`` for v2, ``N:CONTROLLERS:PATH`` for v1). Pure functions of those two texts
(:func:`parse_mounts`, :func:`parse_own`) with a reader around each, so that both v1 and
v2 machines are covered by unit tests whatever machine runs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CgroupMount",
    "cgroup_mounts",
    "find_v1",
    "find_v2",
    "own_cgroup",
    "parse_mounts",
    "parse_own",
    "unescape_mountinfo",
]


@dataclass(frozen=True)
class CgroupMount:
    """A mounted hierarchy: ``mount`` is where; ``root`` which cgroup it shows (``/``
    unless in a cgroup namespace); ``v2``; ``controllers``: a v1 mount's (empty for v2)."""

    mount: Path
    root: str
    v2: bool
    controllers: frozenset[str] = frozenset()


def unescape_mountinfo(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mounts(mountinfo: str) -> list[CgroupMount]:
    """Every cgroup mount in a ``mountinfo`` text, in its order."""
    found = []
    for line in mountinfo.splitlines():
        head, sep, tail = line.partition(" - ")
        if not sep:
            continue
        fields, rest = head.split(), tail.split()
        if len(fields) < 5 or len(rest) < 3 or rest[0] not in ("cgroup", "cgroup2"):
            continue
        v2 = rest[0] == "cgroup2"
        controllers = frozenset() if v2 else frozenset(rest[2].split(","))
        found.append(CgroupMount(Path(unescape_mountinfo(fields[4])), unescape_mountinfo(fields[3]), v2, controllers))
    return found


_parsed: tuple[str, list[CgroupMount]] = ("", [])


def cgroup_mounts() -> list[CgroupMount]:
    """Every cgroup mount this process sees (none when ``/proc`` cannot be read). The
    table is read each time; its parse is reused while the text is the same (an episode's
    start and evaluation ask a dozen times)."""
    global _parsed
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return []
    last_text, last = _parsed
    if text != last_text:
        last = parse_mounts(text)
        _parsed = (text, last)
    return list(last)


def find_v1(controller: str) -> CgroupMount | None:
    """The v1 hierarchy that carries ``controller`` (``memory``, ``pids``, ``freezer``, ...)."""
    return next((m for m in cgroup_mounts() if not m.v2 and controller in m.controllers), None)


def find_v2() -> CgroupMount | None:
    """The unified (v2) hierarchy, if mounted."""
    return next((m for m in cgroup_mounts() if m.v2), None)


def parse_own(proc_cgroup: str, *, controller: str | None) -> str | None:
    """Our cgroup's path in a ``/proc/PID/cgroup`` text: in the v1 hierarchy of
    ``controller``, or (``None``) in the v2 one."""
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if controller is None and hid == "0" and controllers == "":
            return path
        if controller is not None and (controllers == controller or controller in controllers.split(",")):
            return path
    return None


def own_cgroup(controller: str | None) -> str | None:
    """This process's cgroup (``/proc/self/cgroup``) in the v1 hierarchy of
    ``controller``, or in the v2 one for ``None``."""
    try:
        return parse_own(Path("/proc/self/cgroup").read_text(), controller=controller)
    except OSError:
        return None
