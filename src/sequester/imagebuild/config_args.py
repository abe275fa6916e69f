"""The arguments of the config-only instructions Docker validates: EXPOSE, VOLUME,
STOPSIGNAL, HEALTHCHECK. Pure; each raises :class:`ValueError` with a message the planner
prefixes with ``file:line: INSTRUCTION:``.
"""

from __future__ import annotations

import re

from sequester.tasks.dockerfile_parse import exec_form

__all__ = ["exposed_ports", "volumes", "check_stop_signal", "healthcheck_test"]

_PORT = re.compile(r"^(\d{1,5})(?:-(\d{1,5}))?(?:/([A-Za-z]+))?$")
_PROTOCOLS = ("tcp", "udp", "sctp")
# Linux's signal names (Docker's signal.SignalMap), with or without "SIG", any case.
_SIGNALS = frozenset(
    {
        "ABRT",
        "ALRM",
        "BUS",
        "CHLD",
        "CLD",
        "CONT",
        "FPE",
        "HUP",
        "ILL",
        "INT",
        "IO",
        "IOT",
        "KILL",
        "PIPE",
        "POLL",
        "PROF",
        "PWR",
        "QUIT",
        "SEGV",
        "STKFLT",
        "STOP",
        "SYS",
        "TERM",
        "TRAP",
        "TSTP",
        "TTIN",
        "TTOU",
        "UNUSED",
        "URG",
        "USR1",
        "USR2",
        "VTALRM",
        "WINCH",
        "XCPU",
        "XFSZ",
        "RTMIN",
        "RTMAX",
    }
)
_REALTIME = re.compile(r"^(RTMIN\+(\d+)|RTMAX-(\d+))$")


def exposed_ports(words: list[str]) -> list[str]:
    """``80 53/udp 8000-8002`` as ``["80/tcp", "53/udp", "8000/tcp", "8001/tcp", "8002/tcp"]``
    (Docker's nat.ParsePortSpecs: the protocol defaults to tcp, a range is every port)."""
    out: dict[str, None] = {}  # ordered, and a range of 60000 ports stays fast
    for word in words:
        match = _PORT.match(word)
        if not match:
            raise ValueError(f"{word!r} is not a port (80, 53/udp, 8000-8010)")
        start, end = int(match[1]), int(match[2] or match[1])
        protocol = (match[3] or "tcp").lower()
        if protocol not in _PROTOCOLS:
            raise ValueError(f"{word!r}: the protocol is not tcp, udp or sctp")
        if end > 65535 or start > end:
            raise ValueError(f"{word!r} is not a port or range of ports (0-65535)")
        out.update(dict.fromkeys(f"{port}/{protocol}" for port in range(start, end + 1)))
    if not out:
        raise ValueError("names no port")
    return list(out)


def volumes(items: list[str]) -> list[str]:
    """VOLUME's paths (JSON or words, already expanded): none may be empty, as in Docker."""
    if not items:
        raise ValueError("needs at least one path")
    for item in items:
        if not item.strip():
            raise ValueError("a volume path is empty")
    return items


def check_stop_signal(signal: str) -> None:
    """Refuse what Docker's signal.ParseSignal refuses: a signal number or a known name."""
    if signal.isdigit() and 0 < int(signal) < 65:
        return
    name = signal.upper().removeprefix("SIG")
    if name in _SIGNALS:
        return
    realtime = _REALTIME.match(name)
    if realtime and int(realtime[2] or realtime[3]) <= 30:
        return
    raise ValueError(f"{signal!r} is not a signal (a number, or a name such as SIGTERM or SIGRTMIN+3)")


def healthcheck_test(rest: str, has_flags: bool) -> tuple[str, ...]:
    """HEALTHCHECK's Test list: ``("NONE",)``, ``("CMD", *argv)`` or ``("CMD-SHELL", text)``.

    The shell form is not wrapped in SHELL: ``CMD-SHELL`` means the runtime's default
    shell, as in Docker. The --interval etc. flags are checked by the parser and kept only
    in the cache key (the config records just the test).
    """
    kind, *tail = rest.split(None, 1) or [""]
    command = tail[0].strip() if tail else ""
    if kind.upper() == "NONE":
        if command or has_flags:
            raise ValueError("HEALTHCHECK NONE takes no arguments or flags")
        return ("NONE",)
    if kind.upper() != "CMD":
        raise ValueError(f"expected NONE or CMD, got {kind!r}")
    if not command:
        raise ValueError("CMD needs a command")
    argv = exec_form(command)
    if argv is None:
        return ("CMD-SHELL", command)
    if not argv:
        raise ValueError("CMD needs a command")
    return ("CMD", *argv)
