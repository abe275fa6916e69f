"""What a kernel may see and do, as plain frozen data.

A :class:`Policy` is built from a TOML file (:func:`sequester.config.load_policy`), from CLI flags
(:meth:`Policy.with_overrides`) or directly in Python; every other module only reads it.
Each way in validates the same way and names the key or value it rejects.

TOML layout (``configs/default.toml`` is the reference)::

    [runtime]
    isolation = "auto"          # true | "auto" | false | {hide = [...]} | {mode = "auto", hide = [...]}
    readonly = ["src"]          # mounted back read-only (relative paths: from the file's folder)
    allow = ["127.0.0.1:8000", "https://api.example.com"]
    env = ["OPENAI_API_KEY"]    # names of variables (API keys) passed through

    [limits]
    cell_timeout = 60           # seconds per cell
    kernel_timeout = 3600       # seconds per kernel
    memory_mb = 1024
    max_threads = 64
    output_bytes = 1000000      # stdout + stderr per cell
    workspace_mb = 256          # size of /tmp (and the workspace in it)
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

from sequester.errors import PolicyError

__all__ = [
    "ENV_NAME",
    "Isolation",
    "Endpoint",
    "Limits",
    "Policy",
    "endpoint_at",
    "existing_path",
    "parse_endpoint",
    "parse_isolation",
]


class Isolation(enum.Enum):
    """How a kernel is contained.

    ``SANDBOX``: namespaces + seccomp + audit hook; an error where namespaces are unavailable.
    ``AUTO``: ``SANDBOX`` where user namespaces work, else ``GUARD`` with a warning.
    ``GUARD``: seccomp + audit hook + Landlock only (what ``AUTO`` falls back to).
    ``OFF``: nothing at all; for debugging, with a loud warning.
    """

    SANDBOX = "sandbox"
    AUTO = "auto"
    GUARD = "guard"
    OFF = "off"


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?(?:\.[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?)*\.?$"
)


@dataclass(frozen=True, order=True)
class Endpoint:
    """One service a kernel may connect to: a host name or IP literal and a TCP port."""

    host: str
    port: int

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 1 <= self.port <= 65535:
            raise PolicyError(f"port {self.port!r} is not in 1..65535")
        host = self.host.lower().rstrip(".")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if not (_is_ip(host) or _HOSTNAME.match(host)):
            raise PolicyError(f"{self.host!r} is not a host name or IP address")
        object.__setattr__(self, "host", host)

    @property
    def is_ip(self) -> bool:
        return _is_ip(self.host)

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def parse_endpoint(text: str) -> Endpoint:
    """Parse ``host:port``, ``[v6]:port`` or a URL (``https://host[:port]/...``).

    A URL's path is accepted and ignored: the allowlist works at the connection level.
    """
    if not isinstance(text, str) or not text.strip():
        raise PolicyError(f"{text!r} is not HOST:PORT or a URL")
    value = text.strip()
    if "://" in value:
        parts = urlsplit(value)
        scheme = parts.scheme.lower()
        try:
            port = parts.port or _DEFAULT_PORTS.get(scheme)
        except ValueError:
            port = None
        if not parts.hostname or port is None:
            raise PolicyError(f"{text!r} is not a URL with a host and a known or explicit port")
        return Endpoint(parts.hostname, port)
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise PolicyError(f"{text!r} is not HOST:PORT or a URL")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise PolicyError(f"{text!r}: write an IPv6 address in brackets, e.g. [::1]:8080")
    return Endpoint(host, int(port_text))


@dataclass(frozen=True)
class Limits:
    """Resource limits of one kernel. A runaway program gets a clear error; the host does not."""

    cell_timeout: float = 60.0
    kernel_timeout: float = 3600.0
    memory_mb: int = 1024
    max_threads: int = 64
    output_bytes: int = 1_000_000
    workspace_mb: int = 256

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise PolicyError(f"limits.{f.name}: {value!r} is not a positive number")
            if f.type == "int" and not isinstance(value, int):
                raise PolicyError(f"limits.{f.name}: {value!r} is not a whole number")


@dataclass(frozen=True)
class Policy:
    """Everything that decides what a kernel sees. Plain, frozen, comparable data.

    Paths are absolute and resolved; ``readonly`` and ``hide`` paths must exist.
    """

    isolation: Isolation = Isolation.SANDBOX
    hide: tuple[Path, ...] = ()
    readonly: tuple[Path, ...] = ()
    allow: tuple[Endpoint, ...] = ()
    env: tuple[str, ...] = ()
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        isolation, hide = parse_isolation(self.isolation, "isolation")
        object.__setattr__(self, "isolation", isolation)
        object.__setattr__(self, "hide", _paths((*hide, *self.hide), "hide"))
        object.__setattr__(self, "readonly", _paths(self.readonly, "readonly"))
        allow = tuple(e if isinstance(e, Endpoint) else endpoint_at(e, f"allow[{i}]") for i, e in enumerate(self.allow))
        object.__setattr__(self, "allow", tuple(dict.fromkeys(allow)))
        for i, name in enumerate(self.env):
            if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
                raise PolicyError(f"env[{i}]: {name!r} is not an environment variable name")
        object.__setattr__(self, "env", tuple(self.env))
        if not isinstance(self.limits, Limits):
            raise PolicyError(f"limits: expected a Limits, got {type(self.limits).__name__}")
        both = set(self.hide) & set(self.readonly)
        if both:
            raise PolicyError(f"{sorted(map(str, both))[0]!r} is both hidden and read-only")

    def with_overrides(
        self,
        *,
        allow: Iterable[str | Endpoint] = (),
        readonly: Iterable[str | Path] = (),
        hide: Iterable[str | Path] = (),
        isolation: Any = None,
        base_dir: Path | None = None,
    ) -> Policy:
        """Return a copy with more allowed endpoints, read-only and hidden paths (CLI flags)."""
        base = base_dir or Path.cwd()
        return dataclasses.replace(
            self,
            isolation=self.isolation if isolation is None else isolation,
            # str entries are parsed into Endpoint-s by __post_init__
            allow=cast("tuple[Endpoint, ...]", (*self.allow, *allow)),
            readonly=(*self.readonly, *(existing_path(base / p, "--readonly") for p in readonly)),
            hide=(*self.hide, *(existing_path(base / p, "--hide") for p in hide)),
        )


def parse_isolation(value: Any, key: str) -> tuple[Isolation, tuple[Any, ...]]:
    if isinstance(value, Isolation):
        return value, ()
    if value is True:
        return Isolation.SANDBOX, ()
    if value is False:
        return Isolation.OFF, ()
    if isinstance(value, str):
        names = {
            "auto": Isolation.AUTO,
            "true": Isolation.SANDBOX,
            "sandbox": Isolation.SANDBOX,
            "false": Isolation.OFF,
            "off": Isolation.OFF,
            "guard": Isolation.GUARD,
        }
        if value.lower() in names:
            return names[value.lower()], ()
    if isinstance(value, Mapping):
        unknown = set(value) - {"mode", "hide"}
        if unknown:
            raise PolicyError(f"{key}: unknown key {sorted(unknown)[0]!r} (expected 'mode' and 'hide')")
        mode, _ = parse_isolation(value.get("mode", True), f"{key}.mode")
        if mode is Isolation.OFF:
            raise PolicyError(f"{key}: hiding paths needs isolation, but mode is false")
        hide = value.get("hide", [])
        if not isinstance(hide, (list, tuple)):
            raise PolicyError(f"{key}.hide: expected a list of paths, got {hide!r}")
        return mode, tuple(hide)
    raise PolicyError(f'{key}: {value!r} is not true, "auto", false or {{hide = [...]}}')


def _paths(values: Iterable[Any], key: str) -> tuple[Path, ...]:
    out: list[Path] = []
    for i, value in enumerate(values):
        if not isinstance(value, (str, os.PathLike)) or not str(value):
            raise PolicyError(f"{key}[{i}]: {value!r} is not a path")
        path = Path(value)
        if not path.is_absolute():
            raise PolicyError(f"{key}[{i}]: {str(value)!r} is not an absolute path")
        out.append(existing_path(path, f"{key}[{i}]"))
    return tuple(dict.fromkeys(out))


def existing_path(path: Path, key: str) -> Path:
    try:
        return Path(path).resolve(strict=True)
    except (FileNotFoundError, NotADirectoryError):
        raise PolicyError(f"{key}: {str(path)!r} does not exist") from None
    except OSError as exc:
        raise PolicyError(f"{key}: {str(path)!r} cannot be resolved: {exc.strerror}") from None


def endpoint_at(value: Any, key: str) -> Endpoint:
    try:
        return parse_endpoint(value)
    except PolicyError as exc:
        raise PolicyError(f"{key}: {exc}") from None
