"""Landlock: the filesystem (and TCP port) boundary of guard-only mode.

Where no mount namespace can be made, the kernel restricts itself with Landlock, an LSM
any process may apply to itself: read access only beneath the paths it lists, write
access only beneath the workspace, TCP connections only to the allowed ports (ABI 4+),
and no signals or abstract unix sockets beyond its own domain (ABI 6+). Hidden paths are
not listed, so they cannot be opened at all (``EACCES``) rather than appearing empty.

:func:`readable_roots` (host side, pure given a ``listdir``) works out which folders to
grant so that hidden ones stay out; :func:`restrict_self` (kernel side) applies a ruleset.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

__all__ = ["abi_version", "carve_files", "readable_roots", "restrict_self", "write_rights", "seal_special_files"]

_SYS_CREATE, _SYS_ADD_RULE, _SYS_RESTRICT = 444, 445, 446  # same on every architecture
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH, _RULE_NET_PORT = 1, 2

EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
REMOVE_DIR, REMOVE_FILE, MAKE_CHAR, MAKE_DIR, MAKE_REG = 1 << 4, 1 << 5, 1 << 6, 1 << 7, 1 << 8
MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM, REFER, TRUNCATE, IOCTL_DEV = (
    1 << 9,
    1 << 10,
    1 << 11,
    1 << 12,
    1 << 13,
    1 << 14,
    1 << 15,
)
_NET_BIND, _NET_CONNECT = 1 << 0, 1 << 1
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1 << 0, 1 << 1

_READ = EXECUTE | READ_FILE | READ_DIR


def _fs_rights(abi: int) -> int:
    rights = (1 << 13) - 1  # ABI 1: bits 0..12
    if abi >= 2:
        rights |= REFER
    if abi >= 3:
        rights |= TRUNCATE
    if abi >= 5:
        rights |= IOCTL_DEV
    return rights


def _libc():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _add_rule(libc, ruleset: int, rule_type: int, rule, what: str) -> None:  # noqa: ANN001 - ctypes objects
    """``landlock_add_rule(ruleset, rule_type, &rule, 0)``; OSError naming ``what`` on failure."""
    import ctypes

    if (
        libc.syscall(
            ctypes.c_long(_SYS_ADD_RULE),
            ctypes.c_int(ruleset),
            ctypes.c_int(rule_type),
            ctypes.byref(rule),
            ctypes.c_uint32(0),
        )
        != 0
    ):
        raise OSError(ctypes.get_errno(), f"landlock_add_rule({what}) failed")


def _add_path_rule(libc, ruleset: int, fd: int, access: int, path: str) -> None:  # noqa: ANN001 - a ctypes CDLL
    """Grant ``access`` beneath the file or folder open at ``fd`` in ``ruleset``."""
    import ctypes

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    _add_rule(libc, ruleset, _RULE_PATH_BENEATH, PathBeneath(access, fd), path)


def abi_version() -> int:
    """The Landlock ABI this kernel offers; 0 when Landlock is unavailable or disabled."""
    import ctypes

    res = _libc().syscall(
        ctypes.c_long(_SYS_CREATE), None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION)
    )
    return max(int(res), 0)


def readable_roots(
    visible: Iterable[Path], hidden: Iterable[Path], listdir: Callable[[Path], Sequence[str]] = os.listdir
) -> tuple[Path, ...]:
    """Folders to grant read access beneath, so that everything in ``visible`` is
    readable except what lies beneath ``hidden``.

    A visible root with a hidden path inside it is split into its children, recursively,
    leaving out the hidden one. Landlock can only grant, never carve out.
    """
    hidden = tuple(hidden)
    out: list[Path] = []

    def grant(root: Path) -> None:
        if any(root == h or root.is_relative_to(h) for h in hidden):
            return
        if not any(h.is_relative_to(root) for h in hidden):
            out.append(root)
            return
        try:
            names = listdir(root)
        except OSError:
            return
        for name in sorted(names):
            grant(root / name)

    for root in visible:
        grant(Path(root))
    return tuple(dict.fromkeys(out))


def carve_files(
    roots: Iterable[Path], files: Iterable[Path], listdir: Callable[[Path], Sequence[str]] = os.listdir
) -> tuple[tuple[Path, ...], tuple[Path, ...]]:
    """``(read, listable)``: grants covering ``roots`` except the files in ``files``, and
    the folders split on the way, which keep only the right to be listed.

    For files that must not be *loaded* (the FFI libraries), not secrets: their names stay
    visible, since a folder the import system cannot list (the standard library's, say)
    would break every import from it.
    """
    files = tuple(files)
    read: list[Path] = []
    listable: list[Path] = []

    def grant(root: Path) -> None:
        if root in files:
            return
        if not any(f.is_relative_to(root) for f in files):
            read.append(root)
            return
        listable.append(root)
        try:
            names = listdir(root)
        except OSError:
            return
        for name in sorted(names):
            grant(root / name)

    for root in roots:
        grant(Path(root))
    return tuple(dict.fromkeys(read)), tuple(dict.fromkeys(listable))


def write_rights(abi: int) -> int:
    """Every right that changes the filesystem, at ``abi`` (a sandboxed kernel's write lock)."""
    return _fs_rights(abi) & ~(EXECUTE | READ_FILE | READ_DIR | IOCTL_DEV)


def restrict_self(
    *,
    read: Iterable[str],
    write: Iterable[str],
    connect_ports: Iterable[int] | None,
    list_only: Iterable[str] = (),
    handled_fs: int | None = None,
    scoped: bool = True,
) -> int:
    """Apply a ruleset to this process (and its future threads). Irreversible.

    Returns the ABI used. ``connect_ports=None`` leaves TCP unrestricted. ``list_only``
    folders may be listed, and nothing more (see :func:`carve_files`). Needs
    ``no_new_privs`` (set by the seccomp loader) or CAP_SYS_ADMIN. ``handled_fs``: the
    rights the ruleset restricts (default: all of this ABI's); ``scoped``: signals and
    abstract unix sockets kept to the domain (ABI 6+).
    """
    import ctypes

    class RulesetAttr(ctypes.Structure):
        _fields_ = [
            ("handled_access_fs", ctypes.c_uint64),
            ("handled_access_net", ctypes.c_uint64),
            ("scoped", ctypes.c_uint64),
        ]

    class NetPort(ctypes.Structure):
        _fields_ = [("allowed_access", ctypes.c_uint64), ("port", ctypes.c_uint64)]

    abi = abi_version()
    if abi < 1:
        raise OSError("Landlock is not available on this kernel")
    libc = _libc()
    fs = _fs_rights(abi) if handled_fs is None else handled_fs & _fs_rights(abi)
    net = (_NET_BIND | _NET_CONNECT) if abi >= 4 and connect_ports is not None else 0
    scopes = (_SCOPE_ABSTRACT_UNIX | _SCOPE_SIGNAL) if abi >= 6 and scoped else 0
    attr = RulesetAttr(fs, net, scopes)
    size = ctypes.sizeof(RulesetAttr) if abi >= 6 else (16 if abi >= 4 else 8)
    ruleset = libc.syscall(ctypes.c_long(_SYS_CREATE), ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:

        def add_path(path: str, access: int) -> None:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                return  # gone since it was listed; nothing to grant
            try:
                mode = os.fstat(fd).st_mode
                if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
                    return  # Landlock rules take files and folders only (/dev/stderr may be a pipe)
                if not stat.S_ISDIR(mode):
                    access &= EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV
                _add_path_rule(libc, ruleset, fd, access & fs, path)
            finally:
                os.close(fd)

        for path in read:
            add_path(path, _READ)
        for path in list_only:
            add_path(path, READ_DIR)
        for path in write:
            # Everything but making device nodes.
            add_path(path, fs & ~(MAKE_CHAR | MAKE_BLOCK))
        if net:
            for port in connect_ports or ():
                _add_rule(libc, ruleset, _RULE_NET_PORT, NetPort(_NET_CONNECT, port), f"port {port}")
        if libc.syscall(ctypes.c_long(_SYS_RESTRICT), ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(ruleset)
    return abi


# What the tests' programs must not make in the verdict's folder: a FIFO or socket at
# reward.txt blocks the script's own write of it, a symlink leads it elsewhere, device
# nodes; and nothing is moved or linked in from another folder (REFER).
SPECIAL_FILES = MAKE_FIFO | MAKE_SOCK | MAKE_SYM | MAKE_CHAR | MAKE_BLOCK | REFER


def seal_special_files(sealed: str, *, root: str = "/") -> int:
    """Landlock for this process and everything it starts: no FIFO, socket, symlink or
    device node made beneath ``sealed`` (a top-level folder: ``/logs``), and nothing linked
    or renamed into it from another folder; the same stays allowed everywhere else (each
    other top-level entry of ``root``). The ABI used; 0 (nothing applied) without Landlock
    or without REFER (ABI 2)."""
    abi = abi_version()
    if abi < 2:
        return 0
    top = sealed.strip("/").split("/")[0]
    others = [os.path.join(root, name) for name in sorted(os.listdir(root)) if name != top]
    import ctypes

    class RulesetAttr(ctypes.Structure):
        _fields_ = [("handled_access_fs", ctypes.c_uint64)]

    libc = _libc()
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS: what an unprivileged caller needs for Landlock
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    attr = RulesetAttr(SPECIAL_FILES)
    ruleset = libc.syscall(ctypes.c_long(_SYS_CREATE), ctypes.byref(attr), ctypes.c_size_t(8), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        for path in others:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    continue  # (a top-level link or file: nothing is made beneath it)
                _add_path_rule(libc, ruleset, fd, SPECIAL_FILES, path)
            finally:
                os.close(fd)
        if libc.syscall(ctypes.c_long(_SYS_RESTRICT), ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(ruleset)
    return abi
