"""The network policy of ``sequester build``: which targets a Dockerfile's ``RUN`` lines may reach.

``RUN`` lines are untrusted code. They run with no network of their own (only ``lo``) and
reach the outside only through the host's build proxy (:mod:`.proxy`), which asks
this module. Modes (``--build-network``):

* ``none``: nothing;
* ``public`` (the default): any host on the internet, as ``docker build`` allows, but
  never the host's loopback, private ranges, or the host's own addresses;
* ``allowlist``: only ``allowed_hosts`` (names, ``host:port``, ``*.suffix``, IP or CIDR),
  still never loopback or private.

Addresses are checked after the name was resolved on the host, and the proxy connects to
exactly the address it checked: a name whose DNS answer changes between check and use
(DNS rebinding) cannot steer it elsewhere.

The package indexes this machine is configured to use (:func:`index_hosts`) may be
private (an operator's mirror on 10.x): for exactly their ``host:port``, private and
host-own addresses are allowed; loopback only if the configured URL itself names loopback
(``http://localhost:3141/``), so a public name pointing at 127.0.0.1 never reaches the
host's services. A Dockerfile cannot add to that list: it comes from the host's files. In
``allowlist`` mode an index must still be listed: the exemption lifts only the range check.

With the host's proxy variables set (:class:`Upstream`), allowed targets go through that
proxy by name, as the host's own programs do. The proxy resolves them itself, so the check
here is: IP literals by the table; names by what they resolve to *here*, refused if any
answer is refused (``localhost``, ``127.1``, a name pointing at 10.x). Residual: a name that
resolves differently at the upstream (split-horizon DNS, rebinding between the two
lookups) is not checked at the upstream; guarding that is the upstream's own policy.

The parts live in modules of their own, re-exported here: the refused ranges and host
spellings in :mod:`.addresses`, the package-index discovery in :mod:`.indexes`,
the host's upstream proxy in :mod:`.upstream`. This module is the policy that joins them:
the modes, ``allowed_hosts`` rules, and their checks.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from sequester.errors import PolicyError
from sequester.net.build.addresses import (
    HOST_NAME,
    LOOPBACK,
    NEVER,
    OWN,
    PRIVATE,
    IPAddress,
    IPNetwork,
    LocalAddresses,
    classify_address,
    literal,
    normalize_host,
    refusal_for_address,
)
from sequester.net.build.addresses import RANGES as _RANGES
from sequester.net.build.addresses import embedded as _embedded
from sequester.net.build.addresses import network_of as _network
from sequester.net.build.indexes import apt_source_files, index_hosts, pip_config_files
from sequester.net.build.upstream import Upstream, UpstreamProxy

__all__ = [
    "BuildNetwork",
    "HostRule",
    "LocalAddresses",
    "MODES",
    "Upstream",
    "UpstreamProxy",
    "classify_address",
    "index_hosts",
    "normalize_host",
    "parse_build_network",
    "parse_host_rule",
    "refusal_for_address",
    # re-exported from the modules split off, still importable from here
    "HOST_NAME",
    "IPAddress",
    "IPNetwork",
    "LOOPBACK",
    "NEVER",
    "OWN",
    "PRIVATE",
    "apt_source_files",
    "literal",
    "pip_config_files",
]

MODES = ("none", "public", "allowlist")


# -- host rules: allowed_hosts entries and index hosts ---------------------------------


@dataclass(frozen=True)
class HostRule:
    """``name`` (``.example.com`` for ``*.example.com``) or ``network``; ``port`` None: any."""

    name: str | None = None
    network: IPNetwork | None = None
    port: int | None = None

    def matches_name(self, host: str, port: int) -> bool:
        if self.name is None or self.port not in (None, port):
            return False
        return host == self.name or (self.name.startswith(".") and host.endswith(self.name))

    def matches_address(self, ip: IPAddress, port: int) -> bool:
        if self.network is None or self.port not in (None, port):
            return False
        inner = _embedded(ip)
        return ip in self.network or (inner is not None and inner in self.network)

    @property
    def names_loopback(self) -> bool:
        """The rule itself names loopback (``localhost``, ``127.0.0.1``): not a name that
        happens to resolve there."""
        if self.network is not None:
            return self.network.num_addresses == 1 and self.network.network_address.is_loopback
        return self.name is not None and (self.name == "localhost" or self.name.endswith(".localhost"))

    def __str__(self) -> str:
        if self.network is not None:
            text = str(self.network.network_address) if self.network.num_addresses == 1 else str(self.network)
            text = f"[{text}]" if self.port is not None and ":" in text else text
        else:
            text = f"*{self.name}" if self.name and self.name.startswith(".") else str(self.name)
        return text if self.port is None else f"{text}:{self.port}"


def parse_host_rule(text: str, *, field: str = "allowed_hosts") -> HostRule:
    """``pypi.org``, ``pypi.org:443``, ``*.example.com``, ``203.0.113.7``, ``[2001:db8::1]:443``, ``203.0.113.0/24``."""

    def bad(why: str) -> PolicyError:
        return PolicyError(f"{field}: {text!r} {why} (expected HOST, HOST:PORT, *.DOMAIN, IP or CIDR)")

    if not isinstance(text, str) or not text.strip():
        raise bad("is not a host")
    body, port = text.strip(), None
    if "://" in body or "/" in body and not _network(body):
        raise bad("is a URL or path, not a host")
    match = re.fullmatch(r"\[([^\]]+)\](?::(\d+))?|([^:\[\]]+):(\d+)", body)
    if match:
        body, port_text = (match.group(1), match.group(2)) if match.group(1) else (match.group(3), match.group(4))
        port = None if port_text is None else int(port_text)
        if port is not None and not 1 <= port <= 65535:
            raise bad("has a port outside 1..65535")
    network = _network(body)
    if network is not None:
        if port is not None and network.num_addresses != 1:
            raise bad("gives a port to a network")
        return HostRule(network=network, port=port)
    wildcard = body.startswith("*.")
    name = normalize_host(body[2:] if wildcard else body)
    if len(name) > 253 or not HOST_NAME.fullmatch(name):
        raise bad("is not a valid host name")
    return HostRule(name=f".{name}" if wildcard else name, port=port)


@dataclass(frozen=True)
class BuildNetwork:
    mode: str = "public"
    allowed_hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:  # a misspelt mode must not act as "public"
        if self.mode not in MODES:
            raise PolicyError(f"--build-network: {self.mode!r} is not one of {', '.join(MODES)}")

    @property
    def rules(self) -> tuple[HostRule, ...]:
        return tuple(parse_host_rule(h, field=f"allowed_hosts[{i}]") for i, h in enumerate(self.allowed_hosts))


def parse_build_network(mode: str, allowed_hosts: Iterable[str] = ()) -> BuildNetwork:
    """Check and normalise; :class:`PolicyError` names the flag or entry at fault. The
    hosts are checked whatever the mode (a configuration's list stays valid when a flag
    picks another mode) and kept only for ``allowlist``, the one mode they apply to."""
    if isinstance(allowed_hosts, str):  # a lone string would be split into characters
        allowed_hosts = [allowed_hosts]
    normalized = mode.strip().lower() if isinstance(mode, str) else mode
    if normalized not in MODES:
        raise PolicyError(f"--build-network: {mode!r} is not one of {', '.join(MODES)}")
    hosts = list(allowed_hosts)
    rules = [parse_host_rule(h, field=f"allowed_hosts[{i}]") for i, h in enumerate(hosts)]
    for i, net in enumerate(rule.network for rule in rules):
        if net is None:
            continue
        # An entry that is always refused is a mistake worth saying, not a silent no-op.
        for refused, _, what in _RANGES:
            if refused.version == net.version and net.subnet_of(refused):  # type: ignore[arg-type]
                raise PolicyError(f"allowed_hosts[{i}]: {hosts[i]!r} is never reachable from a build: {what}")
    kept = tuple(dict.fromkeys(str(r) for r in rules)) if normalized == "allowlist" else ()
    return BuildNetwork(str(normalized), kept)
