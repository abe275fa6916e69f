"""The host's own upstream proxy (``http_proxy``, ``https_proxy``, ``no_proxy``), for builds.

With the host's proxy variables set, :mod:`.proxy` sends allowed targets through that
proxy by name, as the host's own programs do; :class:`Upstream` reads the variables and
says, per target, which proxy to use or none (``no_proxy``). Kept apart from the policy
(:mod:`.network`): it decides the route of a connection, never whether one is allowed.
The credentials of a proxy URL become a ``Proxy-Authorization`` value and never reach a log.
"""

from __future__ import annotations

import base64
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from sequester.net.addresses import literal
from sequester.net.addresses import network_of as _network

__all__ = ["Upstream", "UpstreamProxy"]

log = logging.getLogger("sequester.net")


@dataclass(frozen=True)
class UpstreamProxy:
    host: str
    port: int
    tls: bool = False
    authorization: str | None = None  # a Proxy-Authorization value, from the URL's user:password

    def __str__(self) -> str:  # never the credentials: this goes to logs
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"


def _proxy_url(text: str) -> UpstreamProxy | None:
    if not text.strip():
        return None
    try:
        parts = urlsplit(text.strip() if "://" in text else f"http://{text.strip()}")
        host, port, scheme = parts.hostname, parts.port, parts.scheme.lower()
    except ValueError:
        host = None
    if host is None or scheme not in ("http", "https"):
        log.warning(
            "build network: ignoring the upstream proxy %r (not an http:// or https:// URL)", text.rsplit("@", 1)[-1]
        )
        return None
    auth = None
    if parts.username is not None:
        token = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
        auth = "Basic " + base64.b64encode(token).decode("ascii")
    return UpstreamProxy(host, port or (443 if scheme == "https" else 80), scheme == "https", auth)


@dataclass(frozen=True)
class Upstream:
    """The host's proxy variables: builds then go out through the host's proxy, as the
    host's own programs do. ``Upstream()``: none, connect directly."""

    http: UpstreamProxy | None = None
    https: UpstreamProxy | None = None
    no_proxy: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Upstream:
        env = os.environ if env is None else env

        def first(*keys: str) -> str:
            return next((env[k] for k in keys if env.get(k, "").strip()), "")

        every = first("all_proxy", "ALL_PROXY")
        return cls(
            _proxy_url(first("http_proxy", "HTTP_PROXY") or every),
            _proxy_url(first("https_proxy", "HTTPS_PROXY") or every),
            tuple(e.strip().lower() for e in re.split(r"[,\s]+", first("no_proxy", "NO_PROXY")) if e.strip()),
        )

    def for_target(self, host: str, port: int, *, tunnel: bool) -> UpstreamProxy | None:
        """The proxy to go through for ``host:port``, or None for a direct connection."""
        proxy = self.https if tunnel else self.http
        return None if proxy is None or self._bypassed(host, port) else proxy

    def _bypassed(self, host: str, port: int) -> bool:
        address = literal(host)
        for entry in self.no_proxy:
            if entry == "*":
                return True
            name, sep, port_text = entry.rpartition(":") if entry.count(":") == 1 else (entry, "", "")
            if sep and port_text != str(port):
                continue
            name = name.lstrip("*").lstrip(".")
            network = _network(name.strip("[]")) if address is not None else None
            if (address in network) if network is not None else (host == name or host.endswith("." + name)):
                return True
        return False
