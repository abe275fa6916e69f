"""Byte-level edits of ELF files for the verifier's runner, and the libraries one needs. Pure.

The runner's programs must load nothing the agent could have written. Their interpreter
and library search path are set with patchelf (see :mod:`.tree`); what is left are the
absolute paths compiled into the dynamic loader and the C library, which they read at
run time whatever the search path says:

* the loader reads ``/etc/ld.so.preload`` (libraries to inject into every program) and
  ``/etc/ld.so.cache`` (where to find a library), and falls back to the system folders
  (``/lib/x86_64-linux-gnu/`` ...) for anything its search path lacks;
* the C library loads character-set converters (``gconv`` modules: native code) and
  locale data from ``/usr/lib/...``.

In the agent's view all of these are the agent's to write (``/etc`` and ``/usr`` are
writable overlays in root mode, and so is the root folder itself). :func:`redirect_paths`
rewrites each such string in place, same length, to a path below ``/proc`` that cannot
exist (procfs has no such entries, and nobody can create any: the verifier mounts a
fresh one). Strings too short for that become ``/`` followed by NUL: the root folder,
which the loader cannot read as a library. So the runner's loader preloads nothing,
reads no cache, and stops with an error for a library missing from the tree instead of
taking one from the view; its C library loads no converter and no locale from the view.
An empty string would not do: code that appends ``/name`` to it would look at the
agent-writable root folder.
"""

from __future__ import annotations

import re
import struct

__all__ = [
    "ELF_MAGIC",
    "LOADER_PATHS",
    "LIBC_PATHS",
    "redirect_paths",
    "replacement",
    "is_elf",
    "view_paths_in",
    "dynamic_names",
]

ELF_MAGIC = b"\x7fELF"

# Read by glibc's dynamic loader (rtld) at every program start, and its built-in search
# folders (the fallback after the search path).
LOADER_PATHS = (
    b"/etc/ld.so.preload",
    b"/etc/ld.so.cache",
    b"/lib/x86_64-linux-gnu/",
    b"/usr/lib/x86_64-linux-gnu/",
    b"/lib64/",
    b"/usr/lib64/",
    b"/lib/aarch64-linux-gnu/",
    b"/usr/lib/aarch64-linux-gnu/",
    b"/lib/",
    b"/usr/lib/",
)
# Code and parsed data glibc's C library loads by absolute path.
LIBC_PATHS = (
    b"/usr/lib/x86_64-linux-gnu/gconv/gconv-modules.cache",
    b"/usr/lib/x86_64-linux-gnu/gconv",
    b"/usr/lib/aarch64-linux-gnu/gconv/gconv-modules.cache",
    b"/usr/lib/aarch64-linux-gnu/gconv",
    b"/usr/lib64/gconv/gconv-modules.cache",
    b"/usr/lib64/gconv",
    b"/usr/lib/locale/locale-archive",
    b"/usr/lib/locale",
    # Which modules the user, group and host lookups load (``passwd: evil`` makes it open
    # libnss_evil.so.2, by a relative path if the name has a slash). Without the file glibc
    # uses its built-in defaults, whose modules (files, dns) are part of the C library.
    b"/etc/nsswitch.conf",
)
_PROC = b"/proc/"
# Where a library's compiled-in configuration and plugin paths point (OpenSSL's
# openssl.cnf and provider modules, p11-kit's modules, krb5's and sasl's plugins,
# terminfo, inputrc, ...): all of it is the agent's to write in its view.
_VIEW_PREFIXES = (b"/etc/", b"/usr/", b"/lib/", b"/lib64/", b"/var/", b"/opt/")
_C_STRING = re.compile(rb"(?<=\0)/[\x21-\x7e]{2,4095}(?=\0)")


def is_elf(head: bytes) -> bool:
    return head[:4] == ELF_MAGIC


def view_paths_in(data: bytes) -> tuple[bytes, ...]:
    """Every whole C string in ``data`` that is an absolute path into the view's system
    folders: what a library (other than the C library, whose data files such as
    ``/etc/passwd`` stay readable: :data:`LIBC_PATHS` lists what it must not load) would
    read its configuration and plugins from."""
    return tuple(sorted({m.group() for m in _C_STRING.finditer(data) if m.group().startswith(_VIEW_PREFIXES)}))


def replacement(path: bytes) -> bytes:
    """The same-length stand-in for ``path``: ``/proc/////`` for a folder (what is
    appended lands in /proc), ``/proc/xxxx`` for a file, ``/`` + NULs when too short."""
    if len(path) <= len(_PROC):
        return b"/" + b"\0" * (len(path) - 1)
    fill = b"/" if path.endswith(b"/") or b"." not in path.rsplit(b"/", 1)[-1] else b"x"
    return _PROC + fill * (len(path) - len(_PROC))


def redirect_paths(
    data: bytes, paths: tuple[bytes, ...], instead: dict[bytes, bytes] | None = None
) -> tuple[bytes, list[bytes]]:
    """``data`` with every NUL-terminated occurrence of each of ``paths`` that starts a
    string replaced by :func:`replacement`: the byte before it is not a printable one
    (NUL, the start, or a length or flag byte of a table: glibc's loader keeps a copy of
    its system folders after a ``\x01``; red team), and the one after it NUL, so
    ``/lib/`` inside ``/usr/lib/`` is left alone. ``instead``: a path's own replacement (the
    same length), for some of ``paths``. Returns the new bytes and the paths found."""
    out = bytearray(data)
    found: list[bytes] = []
    for path in paths:
        new = (instead or {}).get(path) or replacement(path)
        if len(new) != len(path):
            raise ValueError(f"{new!r} is not as long as {path!r}")
        needle = path + b"\0"
        start = 0
        while (i := out.find(needle, start)) >= 0:
            if i == 0 or not 0x21 <= out[i - 1] <= 0x7E:
                out[i : i + len(path)] = new
                if path not in found:
                    found.append(path)
            start = i + 1
    return bytes(out), found


_PT_LOAD, _PT_DYNAMIC = 1, 2
_DT_NULL, _DT_NEEDED, _DT_STRTAB, _DT_RPATH, _DT_RUNPATH = 0, 1, 5, 15, 29
_MAX_SEGMENTS = 256
_MAX_ENTRIES = 4096


def dynamic_names(data: bytes) -> tuple[list[str], list[str]] | None:
    """What ``data`` (a whole ELF file) names for the loader: its ``DT_NEEDED`` entries and
    the folders of its ``DT_RUNPATH`` and ``DT_RPATH`` (split on ``:``, as written:
    ``$ORIGIN`` unexpanded); None for what is not a well-formed ELF file. Never raises."""
    try:
        return _dynamic(data)
    except (struct.error, IndexError, ValueError, UnicodeDecodeError):
        return None


def _dynamic(data: bytes) -> tuple[list[str], list[str]] | None:
    if not is_elf(data) or len(data) < 52 or data[4] not in (1, 2) or data[5] not in (1, 2):
        return None
    wide, order = data[4] == 2, "<" if data[5] == 1 else ">"
    # e_phoff, then e_phentsize and e_phnum: at 32 and 54 (64-bit), 28 and 42 (32-bit)
    (phoff,) = struct.unpack_from(order + ("Q" if wide else "I"), data, 32 if wide else 28)
    phentsize, phnum = struct.unpack_from(order + "HH", data, 54 if wide else 42)
    segment, entry = (order + "IIQQQQQQ", order + "qQ") if wide else (order + "IIIIIIII", order + "iI")
    loads: list[tuple[int, int, int]] = []  # (vaddr, file offset, file size)
    dynamic: tuple[int, int] | None = None
    for i in range(min(phnum, _MAX_SEGMENTS)):
        fields = struct.unpack_from(segment, data, phoff + i * phentsize)
        if wide:
            kind, _, offset, vaddr, _, filesz = fields[:6]
        else:
            kind, offset, vaddr, _, filesz = fields[:5]
        if kind == _PT_LOAD:
            loads.append((vaddr, offset, filesz))
        elif kind == _PT_DYNAMIC:
            dynamic = (offset, filesz)
    if dynamic is None:
        return [], []
    size = struct.calcsize(entry)
    needed: list[int] = []
    paths: list[int] = []
    strtab: int | None = None
    for i in range(min(dynamic[1] // size, _MAX_ENTRIES)):
        tag, value = struct.unpack_from(entry, data, dynamic[0] + i * size)
        if tag == _DT_NULL:
            break
        if tag == _DT_NEEDED:
            needed.append(value)
        elif tag in (_DT_RPATH, _DT_RUNPATH):
            paths.append(value)
        elif tag == _DT_STRTAB:
            strtab = value
    if strtab is None:
        return None if needed or paths else ([], [])
    base = next((off + strtab - va for va, off, sz in loads if va <= strtab < va + sz), None)
    if base is None:
        return None

    def string(offset: int) -> str:
        end = data.index(b"\0", base + offset)
        return data[base + offset : end].decode()

    return [string(o) for o in needed], [f for o in paths for f in string(o).split(":")]
