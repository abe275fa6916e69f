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

from collections.abc import Iterable
from dataclasses import dataclass

from sequester.errors import PolicyError
from sequester.net.addresses import (
    HOST_NAME,
    LOOPBACK,
    NEVER,
    OWN,
    PRIVATE,
    HostRule,
    IPAddress,
    IPNetwork,
    LocalAddresses,
    classify_address,
    literal,
    normalize_host,
    parse_host_rule,
    refusal_for_address,
)
from sequester.net.addresses import RANGES as _RANGES
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
