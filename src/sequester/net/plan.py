"""How the allowlist looks from inside a sandbox. Pure.

The sandbox has an empty network namespace (only ``lo``). Inside it, the kernel's bridge
listens on loopback addresses that stand for the allowed services, and on one HTTP proxy
port; every connection it accepts is handed to the host over a socket the sandbox was
born with, and the host-side broker decides (see :mod:`.broker`). So:

* an allowed loopback service (``127.0.0.1:8000``) is reachable at its own address;
* an allowed name gets a loopback address of its own in ``/etc/hosts``
  (``api.example.com -> 127.0.1.1``), so it resolves and connects as usual, and any
  other name does not resolve (no DNS server is reachable);
* anything else reaches the host only through the proxy (``HTTP(S)_PROXY``), which
  refuses what is not allowed with ``403``;
* an allowed IP literal that is not loopback is reachable through the proxy only (the
  namespace has no route to it).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

from sequester.policy import Endpoint

__all__ = ["Listener", "NetworkPlan", "plan_network", "is_allowed", "PROXY_PORTS"]

# First free one of these becomes the in-sandbox proxy port.
PROXY_PORTS = (3128, 3129, 8118, 18080, 28080)
_NAME_NET = ipaddress.IPv4Network("127.0.1.0/24")


@dataclass(frozen=True)
class Listener:
    """A loopback address:port inside the sandbox that stands for ``target``.

    ``target`` is ``None`` for the proxy listener: its clients speak the proxy protocol.
    """

    address: str
    port: int
    target: Endpoint | None


@dataclass(frozen=True)
class NetworkPlan:
    listeners: tuple[Listener, ...]
    proxy_port: int
    hosts_file: str
    env: tuple[tuple[str, str], ...]

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"


def _loopback(host: str) -> str | None:
    """The in-sandbox address of a loopback target, or None if it is not loopback."""
    if host == "localhost":
        return "127.0.0.1"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    return str(ip) if ip.is_loopback else None


def plan_network(allow: Iterable[Endpoint]) -> NetworkPlan:
    return _plan(tuple(dict.fromkeys(allow)))


@lru_cache(maxsize=64)
def _plan(allow: tuple[Endpoint, ...]) -> NetworkPlan:
    listeners: list[Listener] = []
    name_addresses: dict[str, str] = {}
    for endpoint in allow:
        address = _loopback(endpoint.host)
        if address is None and not endpoint.is_ip:
            if endpoint.host not in name_addresses:
                if len(name_addresses) >= _NAME_NET.num_addresses - 2:
                    raise ValueError("too many allowed host names (at most 253)")
                name_addresses[endpoint.host] = str(_NAME_NET[len(name_addresses) + 1])
            address = name_addresses[endpoint.host]
        if address is not None:
            listeners.append(Listener(address, endpoint.port, endpoint))
    listeners = _one_per_address(listeners)
    taken = {listener.port for listener in listeners if listener.address == "127.0.0.1"}
    proxy_port = next((p for p in PROXY_PORTS if p not in taken), None)
    if proxy_port is None:  # pragma: no cover - would need five allowed ports on 127.0.0.1
        raise ValueError("no free in-sandbox proxy port")
    listeners.append(Listener("127.0.0.1", proxy_port, None))
    hosts = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
    hosts += [f"{address} {name}" for name, address in name_addresses.items()]
    proxy = f"http://127.0.0.1:{proxy_port}"
    env = tuple((k, proxy) for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"))
    env += (("NO_PROXY", ""), ("no_proxy", ""))
    return NetworkPlan(tuple(listeners), proxy_port, "\n".join(hosts) + "\n", env)


def _one_per_address(listeners: list[Listener]) -> list[Listener]:
    """One listener per in-sandbox ``address:port``.

    ``localhost:P`` and ``127.0.0.1:P`` both stand at ``127.0.0.1:P`` inside; binding it
    twice would fail the kernel's start (EADDRINUSE). The IP literal wins: it names the
    exact host service (on the host, ``localhost`` may resolve to ``::1`` first).
    """
    chosen: dict[tuple[str, int], Listener] = {}
    for listener in listeners:
        key = (listener.address, listener.port)
        held = chosen.get(key)
        if held is None or (
            held.target is not None and listener.target is not None and not held.target.is_ip and listener.target.is_ip
        ):
            chosen[key] = listener
    return list(chosen.values())


def is_allowed(allow: Iterable[Endpoint], host: str, port: int) -> bool:
    """Whether ``host:port`` is in the allowlist: exact host (case-insensitive), exact port."""
    try:
        wanted = Endpoint(host, port)
    except ValueError:
        return False
    return wanted in set(allow)
