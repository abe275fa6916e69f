"""Name resolution in guard-only mode: the allowed names' addresses, looked up on the host.

A guard-only kernel shares the host's network namespace, and its filter refuses every
socket but TCP (:mod:`.seccomp`: Landlock limits TCP only, so a UDP datagram could go
anywhere), which leaves the C library's resolver without its transport. The host
resolves the policy's names when it starts the kernel; here ``socket.getaddrinfo`` (and
``gethostbyname``/``gethostbyname_ex``) answer from that table for those names and take
numeric addresses as they are; any other name is unknown. A cell that restores the
originals resolves nothing at all: the filter, not this table, is the boundary.
"""

from __future__ import annotations

TYPE_CHECKING = False  # not ``typing``: the kernel imports this module at start-up
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any

__all__ = ["install_resolver"]


def install_resolver(table: dict[str, list[str]]) -> None:
    """Answer name lookups from ``table`` (lower-case name -> addresses)."""
    import socket

    real = socket.getaddrinfo
    known = {name.lower(): list(addresses) for name, addresses in table.items()}
    numeric = socket.AI_NUMERICHOST

    def getaddrinfo(host: Any, port: Any, family: int = 0, type: int = 0, proto: int = 0, flags: int = 0) -> list:
        name = host.decode("ascii", "replace") if isinstance(host, bytes) else host
        if name is None or not isinstance(name, str):
            return real(host, port, family, type, proto, flags)
        addresses = known.get(name.lower().rstrip("."))
        if addresses is None:  # a numeric address, or unknown: never a query
            return real(host, port, family, type, proto, flags | numeric)
        out: list = []
        for address in addresses:
            try:
                out += real(address, port, family, type, proto, flags | numeric)
            except socket.gaierror:
                continue  # another family than the one asked for
        if not out:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return out

    def gethostbyname(host: str) -> str:
        return str(getaddrinfo(host, None, socket.AF_INET)[0][4][0])

    def gethostbyname_ex(host: str) -> tuple[str, list[str], list[str]]:
        found = getaddrinfo(host, None, socket.AF_INET)
        return host, [], list(dict.fromkeys(str(info[4][0]) for info in found))

    socket.getaddrinfo = getaddrinfo
    socket.gethostbyname = gethostbyname
    socket.gethostbyname_ex = gethostbyname_ex
