"""The network policy of ``sequester build``: which targets a Dockerfile's ``RUN`` lines may reach.

``RUN`` lines are untrusted code. They run with no network of their own (only ``lo``) and
reach the outside only through the host's build proxy (:mod:`.build_proxy`), which asks
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
"""

from __future__ import annotations

import base64
import configparser
import errno
import ipaddress
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from ..errors import PolicyError

__all__ = ["BuildNetwork", "HostRule", "LocalAddresses", "MODES", "Upstream", "UpstreamProxy", "classify_address",
           "index_hosts", "normalize_host", "parse_build_network", "parse_host_rule", "refusal_for_address"]

log = logging.getLogger("sequester.net")

MODES = ("none", "public", "allowlist")
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# What may lift a refusal: NEVER nothing; LOOPBACK a configured index that names loopback
# itself; PRIVATE and OWN any configured index host:port.
NEVER, LOOPBACK, PRIVATE, OWN = "never", "loopback", "private", "own"

# Not ipaddress.is_private/is_global: those count the documentation ranges (TEST-NET
# 192.0.2/24, 198.51.100/24, 203.0.113/24, 2001:db8::/32) as private, and this machine's
# package indexes live in 203.0.113/24. What is refused is what reaches the host or its
# networks instead of the internet: an explicit table, first match wins.
_RANGES: tuple[tuple[IPNetwork, str, str], ...] = tuple((ipaddress.ip_network(n), c, w) for n, c, w in (
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
))
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


def _embedded(ip: IPAddress) -> IPAddress | None:
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
    inner = _embedded(address)
    both = (address,) if inner is None else (inner, address)
    shown = str(address) if inner is None else f"{address} (= {inner})"
    # A mapped address is its IPv4 address; NAT64 and 6to4 ones are judged both ways.
    for candidate in both[:1] if getattr(address, "ipv4_mapped", None) else both:
        for network, category, what in _RANGES:
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


# -- host rules: allowed_hosts entries and index hosts ---------------------------------

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
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


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


def _network(text: str) -> IPNetwork | None:
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        return None


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
        # An entry that is always refused is a mistake worth saying, not a silent no-op.
        for refused, _, what in _RANGES if net is not None else ():
            if refused.version == net.version and net.subnet_of(refused):  # type: ignore[arg-type]
                raise PolicyError(f"allowed_hosts[{i}]: {hosts[i]!r} is never reachable from a build: {what}")
    kept = tuple(dict.fromkeys(str(r) for r in rules)) if normalized == "allowlist" else ()
    return BuildNetwork(str(normalized), kept)


# -- the package indexes this machine is configured to use ------------------------------

_PIP_KEYS = ("index-url", "extra-index-url", "find-links")
_ENV_URLS = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS",
             "UV_INDEX_URL", "UV_DEFAULT_INDEX", "UV_EXTRA_INDEX_URL", "UV_INDEX", "UV_FIND_LINKS")


def pip_config_files(env: Mapping[str, str]) -> list[Path]:
    """Where pip looks: site-wide (XDG dirs, /etc/pip.conf), the user's, $PIP_CONFIG_FILE."""
    home = Path(env.get("HOME") or os.path.expanduser("~"))
    xdg_dirs = [Path(d) / "pip" / "pip.conf" for d in (env.get("XDG_CONFIG_DIRS") or "/etc/xdg").split(":") if d]
    named = env.get("PIP_CONFIG_FILE") or os.devnull
    return [*xdg_dirs, Path("/etc/pip.conf"), home / ".pip" / "pip.conf",
            Path(env.get("XDG_CONFIG_HOME") or home / ".config") / "pip" / "pip.conf",
            *([Path(named)] if named != os.devnull else [])]


def apt_source_files(root: Path = Path("/etc/apt")) -> list[Path]:
    parts = root / "sources.list.d"
    return [root / "sources.list", *sorted(parts.glob("*.list")), *sorted(parts.glob("*.sources"))]


def index_hosts(*, env: Mapping[str, str] | None = None, pip_files: Iterable[Path] | None = None,
                apt_files: Iterable[Path] | None = None) -> frozenset[str]:
    """``host:port`` of every http(s) package index configured for pip, uv and apt here
    (file:// and other schemes ignored; unreadable or malformed files skipped)."""
    env = os.environ if env is None else env
    urls: list[str] = []
    for path in pip_config_files(env) if pip_files is None else pip_files:
        urls += _pip_urls(Path(path))
    for key in _ENV_URLS:
        # UV_INDEX entries may be NAME=URL.
        urls += [u.split("=", 1)[1] if "=" in u.split("://", 1)[0] else u for u in env.get(key, "").split()]
    for path in apt_source_files() if apt_files is None else apt_files:
        urls += _apt_urls(Path(path))
    return frozenset(filter(None, map(_host_port, urls)))


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except (OSError, ValueError):  # missing, unreadable, a directory: no indexes from it
        return ""


def _pip_urls(path: Path) -> list[str]:
    parser = configparser.RawConfigParser()
    try:
        parser.read_string(_read(path), source=str(path))
    except configparser.Error as exc:
        log.debug("index hosts: %s is not a valid pip configuration: %s", path, exc)
        return []
    return [url for section in parser.sections() for key, value in parser.items(section)
            if key.replace("_", "-") in _PIP_KEYS for url in value.split()]


def _apt_urls(path: Path) -> list[str]:
    text = _read(path)
    if path.suffix != ".sources":  # one-line style: deb [options] URI suite [components]
        return [m.group(1) for line in text.splitlines()
                if (m := re.match(r"\s*deb(?:-src)?\s+(?:\[[^\]]*\]\s*)?(\S+)", line))]
    urls: list[str] = []
    for stanza in re.split(r"\n\s*\n", text):  # deb822: the URIs: field (continued on indented lines)
        stanza = "\n".join(line for line in stanza.splitlines() if not line.startswith("#"))
        if not re.search(r"(?im)^enabled:\s*no\s*$", stanza) and (
                found := re.search(r"(?im)^uris:(.*(?:\n[ \t].*)*)", stanza)):
            urls += found.group(1).split()
    return urls


def _host_port(url: str) -> str | None:
    try:
        parts = urlsplit(url.strip())
        host, port, scheme = parts.hostname, parts.port, parts.scheme.lower()
    except ValueError:
        return None
    if scheme not in ("http", "https") or not host:
        return None
    host = normalize_host(host)
    return f"{f'[{host}]' if ':' in host else host}:{port or (443 if scheme == 'https' else 80)}"


# -- the host's own upstream proxy ---------------------------------------------------------

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
        log.warning("build network: ignoring the upstream proxy %r (not an http:// or https:// URL)",
                    text.rsplit("@", 1)[-1])
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
        return cls(_proxy_url(first("http_proxy", "HTTP_PROXY") or every),
                   _proxy_url(first("https_proxy", "HTTPS_PROXY") or every),
                   tuple(e.strip().lower() for e in re.split(r"[,\s]+", first("no_proxy", "NO_PROXY")) if e.strip()))

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
