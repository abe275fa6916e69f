"""The one ``execve`` a kernel may make: from its confining first stage into the cell runner.

Why two stages. Confining a process needs system calls Python's standard library does
not offer (``prctl``, ``capset``, ``seccomp``, ``mount``, Landlock). In a sandbox the
first stage is native (``kernel/stage0.c``: no interpreter at all, and the handoff below
is its last step); otherwise it is Python (:mod:`sequester.kernel.boot`), using ctypes.
But once ``_ctypes`` is loaded into a process it can never be taken out again: its types stay reachable through
``object.__subclasses__()`` and CPython's extension cache hands the module back to
``_imp.create_dynamic`` without reading the file. A cell that switches the audit hook
off (it can: the hook's frame is in the traceback of any refusal) would then have ctypes
again. So the cells run in a *fresh image* that never had ctypes: the first stage
confines itself, loads the seccomp filter and replaces itself with
the cell runner (``sequester.kernel.server``), where ``_ctypes`` is not in the view at all.

Why the filter still refuses ``execve`` to the cell runner. The filter cannot read the
path an ``execve`` names, but it can compare the path's *address*: it allows ``execve``
only when its first argument is exactly :data:`HANDOFF_ADDRESS`. The first stage maps a
page at that fixed address, writes the interpreter's path there and calls ``execve``.
The new image starts with nothing mapped there, and Python code cannot choose where
memory is mapped (``mmap.mmap`` takes no address), while ``RLIMIT_AS`` keeps the heap
and the top-down mappings terabytes away from it. Every other ``execve`` (and every
``execveat``) is refused, as before. What this does not stop: native code in the cell
runner (CPython does not check bytecode, see the README's residual risks) can map that
page itself and replay the handoff, into another program under the same filter,
namespaces, limits and write lock.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # not ``typing``: this module is imported by every kernel at start-up
if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Mapping, Sequence

__all__ = ["HANDOFF_ADDRESS", "Handoff"]

# 48 TiB: page-aligned, below where x86-64 and 48-bit arm64 place shared mappings
# (~127 TiB, growing down) and far above where the program and its heap live (a PIE
# at ~85 TiB grows up; a non-PIE binary starts near 4 MiB).
HANDOFF_ADDRESS = 0x3000_0000_0000

_PAGE = 4096
_PROT_READ, _PROT_WRITE = 1, 2
_MAP_PRIVATE, _MAP_ANONYMOUS, _MAP_FIXED_NOREPLACE = 0x02, 0x20, 0x100000


class Handoff:
    """An ``execve`` prepared in advance, so that nothing but the call itself happens
    after the seccomp filter is loaded."""

    def __init__(self, executable: str, argv: Sequence[str], env: Mapping[str, str]):
        import ctypes

        path = os.fsencode(executable) + b"\0"
        if len(path) > _PAGE:
            raise ValueError("the interpreter's path is longer than a page")
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        where = libc.mmap(
            HANDOFF_ADDRESS,
            _PAGE,
            _PROT_READ | _PROT_WRITE,
            _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED_NOREPLACE,
            -1,
            0,
        )
        if where != HANDOFF_ADDRESS:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot map the handoff page at {HANDOFF_ADDRESS:#x}: {os.strerror(err)}")
        ctypes.memmove(HANDOFF_ADDRESS, path, len(path))
        self._argv = (ctypes.c_char_p * (len(argv) + 1))(*[os.fsencode(a) for a in argv], None)
        pairs = [os.fsencode(k) + b"=" + os.fsencode(v) for k, v in env.items()]
        self._envp = (ctypes.c_char_p * (len(pairs) + 1))(*pairs, None)
        self._libc = libc
        self._ctypes = ctypes

    def execute(self) -> None:
        """Replace this process. Returns only by raising ``OSError``."""
        ctypes = self._ctypes
        self._libc.execve(ctypes.c_void_p(HANDOFF_ADDRESS), self._argv, self._envp)
        err = ctypes.get_errno()
        raise OSError(err, f"execve of the cell runner failed: {os.strerror(err)}")
