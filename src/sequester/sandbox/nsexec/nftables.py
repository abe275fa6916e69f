"""nftables through libnftables (Debian's ``libnftables1``, which the ``nft`` command is
built on), in the namespace helper: a command costs a library call in the worker already
in the router's namespace, not a fork and exec of ``nft`` (measured: 1.2 ms to load an
episode's ruleset, 0.3 ms to add an element, against 14-30 ms for ``nft`` itself).

Loaded when the helper starts, like everything it runs; where the library is missing,
:data:`UNAVAILABLE` says why and every command fails with that."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno

__all__ = ["UNAVAILABLE", "run_commands"]

_JSON = 1 << 4  # NFT_CTX_OUTPUT_JSON


def _load() -> tuple[ctypes.CDLL | None, str | None]:
    for name in ("libnftables.so.1", ctypes.util.find_library("nftables")):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
        lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
        lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
        return lib, None
    return None, "libnftables (Debian's libnftables1, with nftables) is not installed"


_LIB, UNAVAILABLE = _load()


def run_commands(commands: list[str], *, json: bool = False, tolerate: bool | list[bool] = False) -> list[str]:
    """Run each of ``commands`` (nft's language, one batch each) in this process's network
    namespace; their outputs. The first that fails raises :class:`OSError` with nft's
    message, unless it is tolerated (``tolerate``: all, or one flag per command): then its
    output is ``""``."""
    tolerated = tolerate if isinstance(tolerate, list) else [tolerate] * len(commands)
    if _LIB is None:
        raise OSError(errno.ENOSYS, UNAVAILABLE)
    ctx = _LIB.nft_ctx_new(0)
    if not ctx:
        raise OSError(errno.ENOMEM, "nft_ctx_new failed")
    try:
        _LIB.nft_ctx_buffer_output(ctx)
        _LIB.nft_ctx_buffer_error(ctx)
        if json:
            _LIB.nft_ctx_output_set_flags(ctx, _JSON)
        outputs = []
        for command, ok_to_fail in zip(commands, tolerated, strict=True):
            if _LIB.nft_run_cmd_from_buffer(ctx, command.encode()) != 0:
                said = (_LIB.nft_ctx_get_error_buffer(ctx) or b"").decode(errors="replace").strip()
                if ok_to_fail:
                    outputs.append("")
                    continue
                raise OSError(errno.EINVAL, f"nft: {said or 'failed'} (in: {command[:200]})")
            outputs.append((_LIB.nft_ctx_get_output_buffer(ctx) or b"").decode(errors="replace"))
        return outputs
    finally:
        _LIB.nft_ctx_free(ctx)
