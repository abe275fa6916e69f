"""The addresses a sandbox's network may never reach, and the spelling of hosts: shared
by the build network (:mod:`sequester.net.build`) and the episode network
(:mod:`sequester.net.episode`).

One table of refused ranges (:data:`RANGES`, first match wins) and the host's own
addresses (:class:`LocalAddresses`), read by the build policy (an ``allowed_hosts`` entry
that is always refused is an error), the build proxy (every address it would connect to),
the build's upstream proxy (``no_proxy`` networks), and an episode's firewall and DNS
responder. The host spellings here (:func:`normalize_host`, :func:`literal`,
:func:`parse_host_rule`: ``HOST``, ``HOST:PORT``, ``*.DOMAIN``, IP or CIDR) are the one form
names and addresses are written and compared in, by all of them.
"""

from __future__ import annotations

import errno
import ipaddress
import re
import socket
import threading
import time
from dataclasses import dataclass

from sequester.errors import PolicyError

__all__ = [
    "HOST_NAME",
    "HostRule",
    "IPAddress",
    "IPNetwork",
    "LOOPBACK",
    "NEVER",
    "OWN",
    "PRIVATE",
    "RANGES",
    "LocalAddresses",
    "classify_address",
    "embedded",
    "literal",
    "network_of",
    "normalize_host",
    "parse_host_rule",
    "refusal_for_address",
]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# What may lift a refusal: NEVER nothing; LOOPBACK a configured index that names loopback
# itself; PRIVATE and OWN any configured index host:port.
NEVER, LOOPBACK, PRIVATE, OWN = "never", "loopback", "private", "own"

# Not ipaddress.is_private/is_global: those count the documentation ranges (TEST-NET
# 192.0.2/24, 198.51.100/24, 203.0.113/24, 2001:db8::/32) as private, and this machine's
# package indexes live in 203.0.113/24. What is refused is what reaches the host or its
# networks instead of the internet: an explicit table, first match wins.
RANGES: tuple[tuple[IPNetwork, str, str], ...] = tuple(
    (ipaddress.ip_network(n), c, w)
    for n, c, w in (
        ("0.0.0.0/8", NEVER, "'this network' (0/8: 0.0.0.0 reaches the host itself)"),
        ("127.0.0.0/8", LOOPBACK, "loopback (the host's own services)"),
        ("10.0.0.0/8", PRIVATE, "private (RFC 1918)"),
        ("172.16.0.0/12", PRIVATE, "private (RFC 1918)"),
        ("192.168.0.0/16", PRIVATE, "private (RFC 1918)"),
        ("100.64.0.0/10", PRIVATE, "carrier-grade NAT space (RFC 6598)"),
        ("169.254.0.0/16", PRIVATE, "link-local (cloud metadata: 169.254.169.254)"),
        ("192.0.0.0/24", PRIVATE, "IETF protocol assignments (not routable)"),
        ("198.18.0.0/15", PRIVATE, "benchmarking space (RFC 2544; internal and fake-IP networks)"),
        ("224.0.0.0/4", NEVER, "multicast"),
        ("240.0.0.0/4", NEVER, "reserved (240/4, with the broadcast 255.255.255.255)"),
        ("::1/128", LOOPBACK, "loopback (the host's own services)"),
        ("::/128", NEVER, "unspecified (::)"),
        ("::/96", NEVER, "IPv4-compatible (deprecated)"),
        ("::ffff:0:0:0/96", NEVER, "IPv4-translated (SIIT)"),
        ("100::/64", NEVER, "discard-only (RFC 6666)"),
        ("64:ff9b:1::/48", PRIVATE, "local-use NAT64 (RFC 8215)"),
        ("fc00::/7", PRIVATE, "unique local (cloud metadata: fd00:ec2::254)"),
        ("fe80::/10", PRIVATE, "link-local"),
        ("fec0::/10", PRIVATE, "site-local (deprecated)"),
        ("ff00::/8", NEVER, "multicast"),
    )
)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_CACHE_SECONDS = 5.0


class LocalAddresses:
    """Whether an address is one of this host's own, by construction: the host can
    ``bind()`` exactly its own addresses (every interface, every alias, every address a
    container runtime or VPN added a second ago), so a throwaway bind is the test, cached
    for a few seconds. Stops: reaching the host's services through its LAN or public
    address (192.0.2.2:22) instead of 127.0.0.1. With ``net.ipv4.ip_nonlocal_bind=1``
    every bind succeeds and every address is refused: fail closed."""

    def __init__(self, ttl: float = _CACHE_SECONDS, max_entries: int = 1024):
        self.ttl, self.max_entries = ttl, max_entries
        self._cache: dict[IPAddress, tuple[bool, float]] = {}
        self._lock = threading.Lock()

    def __contains__(self, ip: object) -> bool:
        address = ipaddress.ip_address(ip) if isinstance(ip, str) else ip
        assert isinstance(address, (ipaddress.IPv4Address, ipaddress.IPv6Address)), ip
        now = time.monotonic()
        with self._lock:  # a bind() takes microseconds: no need to release the lock for it
            hit = self._cache.get(address)
            if hit is None or now - hit[1] >= self.ttl:
                if len(self._cache) >= self.max_entries:  # bounded, whatever the sandbox asks for
                    self._cache.clear()
                hit = self._cache[address] = (_bindable(address), now)
            return hit[0]


def _bindable(ip: IPAddress) -> bool:
    family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((str(ip), 0))
        return True
    except OSError as exc:
        # Anything but "not an address of this host" (EMFILE, no IPv6): cannot tell, so mine.
        return exc.errno != errno.EADDRNOTAVAIL


def embedded(ip: IPAddress) -> IPAddress | None:
    """The IPv4 address an IPv6 one stands for (mapped, NAT64, 6to4): ``::ffff:127.0.0.1``
    connects to 127.0.0.1, so it is judged as 127.0.0.1."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return None
    if ip.ipv4_mapped is not None or ip not in _NAT64:
        return ip.ipv4_mapped or ip.sixtofour
    return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)


def classify_address(ip: str | IPAddress, *, local: LocalAddresses) -> tuple[str, str] | None:
    """``(category, reason)`` if the address is refused, else None."""
    try:
        address = ipaddress.ip_address(ip) if isinstance(ip, str) else ip
    except ValueError:
        return NEVER, f"{ip!r} is not an IP address"
    inner = embedded(address)
    both = (address,) if inner is None else (inner, address)
    shown = str(address) if inner is None else f"{address} (= {inner})"
    # A mapped address is its IPv4 address; NAT64 and 6to4 ones are judged both ways.
    for candidate in both[:1] if getattr(address, "ipv4_mapped", None) else both:
        for network, category, what in RANGES:
            if candidate in network:
                return category, f"{shown} is {what}"
    if any(candidate in local for candidate in both):
        return OWN, f"{shown} is an address of this host"
    return None


def refusal_for_address(ip: str, *, local: LocalAddresses) -> str | None:
    """Why ``ip`` may not be reached from a build (loopback, private, link-local, CGNAT,
    ULA, multicast, broadcast, 0/8, the host's own), or None if it may."""
    found = classify_address(ip, local=local)
    return None if found is None else found[1]


# -- host spellings ------------------------------------------------------------------------

_LABEL = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
HOST_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")


def normalize_host(host: str) -> str:
    """Lowercase ASCII (IDNA), no trailing dot: the one spelling rules are compared in
    (stops ``PyPI.org.`` or a full-width ``ｌｏｃａｌｈｏｓｔ`` slipping past a rule)."""
    host = host.strip().rstrip(".")
    try:
        return host.encode("idna").decode("ascii").lower()
    except UnicodeError:
        return host.lower()


def literal(host: str) -> IPAddress | None:
    """The address ``host`` spells (``[::1]`` too), or None for a name."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def network_of(text: str) -> IPNetwork | None:
    """The network ``text`` names (an address: its /32 or /128), or None."""
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        return None


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
        inner = embedded(ip)
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
    if "://" in body or "/" in body and not network_of(body):
        raise bad("is a URL or path, not a host")
    match = re.fullmatch(r"\[([^\]]+)\](?::(\d+))?|([^:\[\]]+):(\d+)", body)
    if match:
        body, port_text = (match.group(1), match.group(2)) if match.group(1) else (match.group(3), match.group(4))
        port = None if port_text is None else int(port_text)
        if port is not None and not 1 <= port <= 65535:
            raise bad("has a port outside 1..65535")
    network = network_of(body)
    if network is not None:
        if port is not None and network.num_addresses != 1:
            raise bad("gives a port to a network")
        return HostRule(network=network, port=port)
    wildcard = body.startswith("*.")
    name = normalize_host(body[2:] if wildcard else body)
    if len(name) > 253 or not HOST_NAME.fullmatch(name):
        raise bad("is not a valid host name")
    return HostRule(name=f".{name}" if wildcard else name, port=port)
