"""What the agent's writable layers change that a verifier running on its system trusts.

Information only (the verdict does not depend on it). A verifier that runs in the agent's
environment runs the agent's ``bash``, loader, Python and shell start-up files; every
change to them sits in the episode's layers on the host, where the agent cannot hide it.
:mod:`.layers` lists **every** change in the trusted folders (no pattern decides what is
reported); this module summarizes them, bounded whatever their number:

* counts per top-level folder and kind (``added``, ``replaced``, ``deleted``, ``changed`` =
  present in the layer, but whether the host has the path could not be told);
* the first :data:`LIMIT` paths, the well-known dangerous categories first (commands on the
  verifier's PATH, loader configuration, Python start-up hooks, shell start-up files,
  libraries), replacements before additions;
* a line saying when the list is truncated or the scan incomplete.

Every path is shown escaped (:func:`printable`): names with newlines, terminal escapes or
invalid UTF-8 cannot forge lines of the report. Pure: it works on :class:`Change` values.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = [
    "Change",
    "ChangeSummary",
    "tampering_report",
    "category",
    "printable",
    "CATEGORIES",
    "PATH_DIRS",
    "LIMIT",
    "ELIDED_MARK",
]

# The verifier's PATH, without the toolchain (mounted read-only, out of reach).
PATH_DIRS = ("usr/local/sbin", "usr/local/bin", "usr/sbin", "usr/bin", "sbin", "bin")
LIMIT = 50  # paths listed by name
ELIDED_MARK = " more levels]"  # in a path whose middle :mod:`.layers` elided (deeper than PATH_MAX)

# (name, what it is to a verifier), most dangerous first: the order of the report.
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("PATH command", "a command on the verifier's PATH"),
    ("loader", "read by the dynamic loader of every program"),
    ("Python start-up", "run or read by Python, pytest, pip or uv at start"),
    ("shell start-up", "read by shells at start"),
    ("library", "a native library or Python's standard library"),
    ("Python package", "importable by the verifier's Python"),
    ("home config", "configuration in a home folder"),
    ("other", ""),
)
_KIND_RANK = {"replaced": 0, "deleted": 1, "changed": 2, "added": 3}

_LOADER = {"etc/ld.so.preload", "etc/ld.so.conf", "etc/ld.so.cache", "etc/ld.so.conf.d"}
_SHELL_ETC = {
    "etc/profile",
    "etc/profile.d",
    "etc/bash.bashrc",
    "etc/bashrc",
    "etc/environment",
    "etc/zshenv",
    "etc/zprofile",
    "etc/zshrc",
    "etc/zsh",
    "etc/shells",
    "etc/inputrc",
}
_SHELL_DOTFILES = {
    ".bashrc",
    ".profile",
    ".bash_profile",
    ".bash_login",
    ".bash_logout",
    ".zshrc",
    ".zshenv",
    ".zprofile",
    ".zlogin",
    ".shrc",
    ".kshrc",
    ".cshrc",
    ".tcshrc",
    ".login",
    ".inputrc",
    ".bash_env",
}
_PY_CONFIG = ("etc/pip.conf", "etc/uv", "etc/xdg/uv", "etc/xdg/pip", "etc/python")
_PY_HOME_CONFIG = (".config/uv", ".config/pip", ".pip", ".pydistutils.cfg", ".pypirc", ".pythonrc", ".pythonrc.py")
_PY_CONFIG_UNDER = tuple(c + "/" for c in _PY_CONFIG)
_PY_HOME_CONFIG_UNDER = tuple(c + "/" for c in _PY_HOME_CONFIG)
# Python start-up: site hooks anywhere, .pth files, entry points (pytest11 plugins) and
# pytest/pluggy themselves in any site-/dist-packages.
_PY_HOOK = re.compile(
    r"(?:^|/)(?:sitecustomize\.|usercustomize\.|conftest\.py$)"
    r"|-packages/(?:[^/]+/)*(?:[^/]*\.pth$|entry_points\.txt$|(?:_pytest|pytest|pluggy)(?:/|$))"
)
_IN_PACKAGES = re.compile(r"-packages(?:/|$)")
_STDLIB = re.compile(r"^(?:usr|lib|lib64|opt)/(?:[^/]+/)*python3[^/]*/")
_SHARED_OBJECT = re.compile(r"\.so(?:\.[0-9][^/]*)?$")
_PATH_SET = frozenset(PATH_DIRS)


@dataclass(frozen=True)
class Change:
    """One path the agent's layers hold. ``path`` is relative to ``/`` (undecodable bytes
    as surrogate escapes, :func:`os.fsdecode`); ``kind`` is ``added``, ``replaced`` (the
    host has the path), ``deleted`` (an overlay whiteout) or ``changed`` (unknown which);
    ``detail`` the entry's type when not a regular file (``folder``, ``symlink``, ``fifo``,
    ``setuid`` ...)."""

    path: str
    kind: str
    detail: str = ""


def printable(text: str) -> str:
    """``text`` with every byte that is not printable UTF-8 escaped (``\\n``, ``\\x1b``,
    ``\\xff`` for an invalid byte, ``\\u202e``), and ``\\`` doubled: one line, no forgery."""
    out = []
    for ch in text:
        if ch == "\\":
            out.append("\\\\")
        elif "\udc80" <= ch <= "\udcff":  # an undecodable byte, kept by surrogateescape
            out.append(f"\\x{ord(ch) - 0xDC00:02x}")
        elif ch.isprintable():
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape").decode("ascii"))
    return "".join(out)


def _home_rest(path: str) -> str | None:
    """The path inside a home folder (``root/...`` or ``home/<user>/...``), or None."""
    if path.startswith("root/"):
        return path[5:]
    if path.startswith("home/"):
        rest = path[5:].partition("/")[2]
        return rest or None
    return None


def category(path: str) -> int:
    """Index in :data:`CATEGORIES` of what ``path`` (relative to ``/``) is to a verifier."""
    directory, _, name = path.rpartition("/")
    if directory in _PATH_SET or path in _PATH_SET:
        return 0
    if path in _LOADER or directory == "etc/ld.so.conf.d":
        return 1
    home = _home_rest(path)
    if (
        _PY_HOOK.search(path)
        or path in _PY_CONFIG
        or path.startswith(_PY_CONFIG_UNDER)
        or (home is not None and (home in _PY_HOME_CONFIG or home.startswith(_PY_HOME_CONFIG_UNDER)))
    ):
        return 2
    if (
        path in _SHELL_ETC
        or directory in ("etc/profile.d", "etc/zsh")
        or (home is not None and home.partition("/")[0] in _SHELL_DOTFILES)
    ):
        return 3
    if home is not None:
        return 6
    in_packages = _IN_PACKAGES.search(path) is not None
    if _SHARED_OBJECT.search(name) or (not in_packages and _STDLIB.match(path)):
        return 4
    return 5 if in_packages else 7


class ChangeSummary:
    """Counts every change it is given and keeps the :data:`LIMIT` most useful to read;
    memory is bounded by the limit, whatever the number of changes. ``host_has(path)``
    (optional, may raise: treated as no) tells whether the host has ``/path``: an added
    command that shadows one later on the verifier's PATH is then named and listed first."""

    def __init__(self, limit: int = LIMIT, host_has: Callable[[str], bool] | None = None):
        self.limit = limit
        self.host_has = host_has
        self.total = 0
        self.counts: dict[str, dict[str, int]] = {}
        self._kept: list[tuple[tuple[int, int, int, str], Change, str]] = []
        self._worst: tuple[int, int, int, str] | None = None  # the last kept key, once the list is full

    def add(self, change: Change) -> None:
        self.total += 1
        top = change.path.split("/", 1)[0]
        per_top = self.counts.setdefault(top, {})
        per_top[change.kind] = per_top.get(change.kind, 0) + 1
        cat = category(change.path)
        note = self._shadows(change) if cat == 0 and change.kind == "added" else ""
        # shallow paths first within a kind: an elided path (a deep chain) sorts last
        depth = 10**6 if ELIDED_MARK in change.path else change.path.count("/")
        key = (cat, -1 if note else _KIND_RANK.get(change.kind, 2), depth, change.path)
        if self._worst is not None and key >= self._worst:
            return  # cannot make the list: skip the work
        self._kept.append((key, change, note))
        if len(self._kept) >= 2 * self.limit:
            self._trim()

    def _trim(self) -> None:
        self._kept.sort(key=lambda item: item[0])
        del self._kept[self.limit :]
        if len(self._kept) >= self.limit:
            self._worst = self._kept[-1][0]

    def _shadows(self, change: Change) -> str:
        if self.host_has is None:
            return ""
        directory, _, name = change.path.rpartition("/")
        if directory not in PATH_DIRS:
            return ""
        for later in PATH_DIRS[PATH_DIRS.index(directory) + 1 :]:
            try:
                if self.host_has(f"{later}/{name}"):
                    return f"/{later}/{name}"
            except Exception:  # noqa: BLE001 - a host path we cannot stat is not known to exist
                continue
        return ""

    def lines(self, problems: Iterable[str] = (), n_problems: int | None = None) -> list[str]:
        """The report: [] when nothing changed and the scan was complete."""
        problems = list(problems)
        n_problems = len(problems) if n_problems is None else n_problems
        if not self.total and not n_problems:
            return []
        self._trim()
        tops = ", ".join(
            f"/{printable(top)} {sum(kinds.values()):,} ("
            + ", ".join(f"{n:,} {kind}" for kind, n in sorted(kinds.items(), key=lambda kv: _KIND_RANK.get(kv[0], 9)))
            + ")"
            for top, kinds in sorted(self.counts.items())
        )
        out = [
            f"{self.total:,} change{'' if self.total == 1 else 's'} in the agent's layers under paths the "
            "verifier trusts" + (f": {tops}" if tops else "")
        ]
        for (cat, *_), change, shadowed in self._kept:
            detail = f" ({change.detail})" if change.detail else ""
            if shadowed:
                what = f", which shadows {shadowed} on the verifier's PATH"
            else:
                what = f": {CATEGORIES[cat][1]}" if CATEGORIES[cat][1] else ""
            out.append(f"{change.kind} /{printable(change.path)}{detail}{what}")
        if self.total > len(self._kept):
            out.append(
                f"... and {self.total - len(self._kept):,} more changes not listed "
                f"(the first {len(self._kept)} shown, the most dangerous kinds first)"
            )
        if n_problems:
            more = f"; and {n_problems - len(problems)} more problems" if n_problems > len(problems) else ""
            out.append(
                "the scan is incomplete, so there may be more changes: "
                + "; ".join(printable(p) for p in problems)
                + more
            )
        return out


def tampering_report(
    changes: Iterable[Change],
    problems: Iterable[str] = (),
    *,
    limit: int = LIMIT,
    host_has: Callable[[str], bool] | None = None,
) -> list[str]:
    """The bounded report of ``changes`` (any number, consumed once); ``problems`` are why
    the scan that produced them is incomplete (none: it is complete)."""
    summary = ChangeSummary(limit, host_has)
    for change in changes:
        summary.add(change)
    return summary.lines(problems)
