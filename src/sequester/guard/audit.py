"""A PEP 578 audit hook: the tripwire that turns blocked attempts into clear Python errors.

It is not the boundary. PEP 578 says so itself, and there are routes it never sees
(``_posixsubprocess.fork_exec`` raises no event; ``ctypes.memmove`` through a prebuilt
function pointer raises none). The boundary is the seccomp filter and the namespaces;
the hook exists so that ``subprocess.run(...)`` fails with
``PermissionError: process creation is blocked by the sandbox policy`` rather than a bare
``EPERM``, and so that ctypes, which could rewrite the interpreter's memory, cannot be
imported at all.

Hardening of the tripwire itself: the hook keeps its configuration in immutable
containers captured at install time, refuses to have its own attributes replaced,
refuses ``gc`` introspection (the usual way to find and edit a hook's state) and is
referenced by nothing but the interpreter once installed.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # not ``typing``: this module is imported by every kernel at start-up
if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Iterable

__all__ = ["PROCESS_EVENTS", "BLOCKED_IMPORTS", "PROCESS_MESSAGE", "install_audit_hook"]

PROCESS_MESSAGE = "process creation is blocked by the sandbox policy"

PROCESS_EVENTS = frozenset(
    {
        "subprocess.Popen",
        "os.system",
        "os.posix_spawn",
        "os.spawn",
        "os.fork",
        "os.forkpty",
        "os.exec",
        "pty.spawn",
        "os.startfile",
        "_posixsubprocess.fork_exec",
    }
)

# Foreign-function interfaces and interpreter-poking test modules. ctypes is already in
# the kernel's memory (the bootstrap used it); the import event still fires once the
# bootstrap has removed it from sys.modules.
BLOCKED_IMPORTS = frozenset(
    {
        "ctypes",
        "_ctypes",
        "cffi",
        "_cffi_backend",
        "pyseccomp",
        "_testcapi",
        "_testinternalcapi",
    }
)

_GC_EVENTS = frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents"})
_RESOLVE_EVENTS = frozenset({"socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyname_ex"})


def install_audit_hook(
    *,
    blocked_imports: Iterable[str] = BLOCKED_IMPORTS,
    allowed_names: Iterable[str] | None = None,
    allowed_connects: Iterable[tuple[str, int]] | None = None,
) -> None:
    """Install the hook. Irreversible for the life of the process.

    ``allowed_names``/``allowed_connects`` turn on the network checks (guard-only mode,
    where no namespace enforces the allowlist): name resolution only of those names (and
    numeric addresses), connections only to those ``(address, port)`` pairs, to the
    addresses allowed names resolved to on their ports among them (the host resolves the
    names for the kernel, see :mod:`.resolver`).
    """
    blocked = frozenset(blocked_imports)
    check_network = allowed_names is not None or allowed_connects is not None
    names = frozenset(n.lower() for n in (allowed_names or ()))
    connects = frozenset((str(h), int(p)) for h, p in (allowed_connects or ()))
    # Bound now, before the hook is live (a module looked up later could be a cell's
    # stand-in); imported only when the checks are on (guard-only mode).
    ip_address = _ip_address() if check_network else None

    def hook(event: str, args: tuple) -> None:
        if event in PROCESS_EVENTS:
            raise PermissionError(PROCESS_MESSAGE)
        if event.startswith("ctypes."):
            raise PermissionError("ctypes is blocked by the sandbox policy")
        if event == "import":
            name = args[0]
            if type(name) is not str or name.partition(".")[0] in blocked:
                raise ImportError(f"import of {name!s} is blocked by the sandbox policy")
            return
        if event in _GC_EVENTS:
            raise PermissionError(f"{event} is blocked by the sandbox policy")
        if event == "object.__setattr__" and args[0] is hook:
            raise PermissionError("the sandbox's audit hook cannot be changed")
        if check_network:
            if event in _RESOLVE_EVENTS:
                host = args[0]
                if type(host) is bytes:
                    host = host.decode("ascii", "replace")
                if type(host) is not str:
                    raise PermissionError("name resolution of a non-string host is blocked by the sandbox policy")
                if host.lower() not in names and not _numeric(host):
                    raise PermissionError(f"name resolution of {host!r} is blocked by the sandbox policy")
                return
            if event in ("socket.connect", "socket.sendto", "socket.sendmsg"):
                address = args[1]
                if address is None:  # sendmsg on a connected socket
                    return
                if type(address) is not tuple or len(address) < 2 or type(address[0]) is not str:
                    raise PermissionError("this socket address is blocked by the sandbox policy")
                host, port = address[0], address[1]
                if (host, port) in connects:
                    return
                raise PermissionError(f"connection to {host}:{port} is blocked by the sandbox policy")

    def _numeric(host: str) -> bool:
        try:
            ip_address(host)  # type: ignore[misc]
        except ValueError:
            return False
        return True

    sys.addaudithook(hook)


def _ip_address():
    import ipaddress

    return ipaddress.ip_address
