"""The host's own IPv4 networks, as its kernel lists them: what an episode must never reach
besides the fixed ranges (:data:`sequester.net.addresses.RANGES`).

* every address the host owns (the ``LOCAL`` entries of ``/proc/net/fib_trie``: each
  interface's, each alias, a container runtime's bridge), and the broadcast addresses of
  its networks;
* the networks it is directly connected to (its LAN: the neighbours, the router's admin
  page), and its gateways (``/proc/net/route``).

Read when an episode's network starts, in the namespace of the process that starts it (the
one whose addresses the user-mode stack's connections come from). Parsers pure, readers
thin. IPv6 is not routed out of an episode at all, so only IPv4 is listed.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["HostNetworks", "parse_fib_trie", "parse_route", "read_host_networks"]

_NODE = re.compile(r"^\s*\|--\s+(\d+\.\d+\.\d+\.\d+)\s*$")
_LEAF = re.compile(r"^\s*/(\d+)\s+(\w+)\s+(\w+)\s*$")


@dataclass(frozen=True)
class HostNetworks:
    own: tuple[ipaddress.IPv4Network, ...] = ()  # addresses (and local ranges, 127/8) of the host
    broadcast: tuple[ipaddress.IPv4Address, ...] = ()
    connected: tuple[ipaddress.IPv4Network, ...] = ()  # directly attached networks
    gateways: tuple[ipaddress.IPv4Address, ...] = ()

    def refused(self) -> list[ipaddress.IPv4Network]:
        """All of them, as networks (for the router's refused set)."""
        found = [*self.own, *self.connected]
        found += [ipaddress.IPv4Network(a) for a in (*self.broadcast, *self.gateways)]
        return list(ipaddress.collapse_addresses(found))


def parse_fib_trie(text: str) -> HostNetworks:
    """``/proc/net/fib_trie``: ``|-- ADDRESS`` lines, each followed by ``/PREFIX SCOPE TYPE``
    leaves: ``host LOCAL`` is an address of the host, ``link BROADCAST`` a broadcast
    address, ``link UNICAST`` a connected network."""
    own: set[ipaddress.IPv4Network] = set()
    broadcast: set[ipaddress.IPv4Address] = set()
    connected: set[ipaddress.IPv4Network] = set()
    current: str | None = None
    for line in text.splitlines():
        node = _NODE.match(line)
        if node:
            current = node.group(1)
            continue
        leaf = _LEAF.match(line)
        if not leaf or current is None:
            continue
        prefix, scope, kind = int(leaf.group(1)), leaf.group(2), leaf.group(3)
        try:
            network = ipaddress.IPv4Network(f"{current}/{prefix}", strict=False)
        except ValueError:
            continue
        if kind == "LOCAL":
            own.add(network)
        elif kind == "BROADCAST":
            broadcast.add(ipaddress.IPv4Address(current))
        elif kind == "UNICAST" and scope == "link" and prefix > 0:
            connected.add(network)
    return HostNetworks(tuple(sorted(own)), tuple(sorted(broadcast)), tuple(sorted(connected)))


def parse_route(text: str) -> tuple[ipaddress.IPv4Address, ...]:
    """``/proc/net/route``: the gateways (a non-zero ``Gateway``, little-endian hex)."""
    found = set()
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 3:
            continue
        try:
            gateway = int(fields[2], 16)
        except ValueError:
            continue
        if gateway:
            found.add(ipaddress.IPv4Address(gateway.to_bytes(4, "little")))
    return tuple(sorted(found))


def read_host_networks(proc: Path = Path("/proc/net")) -> HostNetworks:
    """This process's network namespace's networks (nothing readable: none)."""
    try:
        found = parse_fib_trie((proc / "fib_trie").read_text())
    except OSError:
        found = HostNetworks()
    try:
        gateways = parse_route((proc / "route").read_text())
    except OSError:
        gateways = ()
    return HostNetworks(found.own, found.broadcast, found.connected, gateways)
