"""The build network's policy (:mod:`sequester.net.build.network`): refused addresses,
``allowed_hosts`` rules, the host's package indexes and upstream proxy (pure, or this
host's own addresses and files).

The proxy itself, on real sockets and in a real bwrap sandbox: tests/net/test_build_proxy.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from services import own_address

from sequester.errors import PolicyError
from sequester.net.build.network import (BuildNetwork, LocalAddresses, Upstream, UpstreamProxy, index_hosts,
                                         parse_build_network, refusal_for_address)
from sequester.net.build.proxy import proxy_env

LOCAL = LocalAddresses()


# -- policy ---------------------------------------------------------------------------

@pytest.mark.parametrize("ip, why", [
    ("127.0.0.1", "loopback"), ("127.9.8.7", "loopback"), ("::1", "loopback"), ("::ffff:127.0.0.1", "loopback"),
    ("0.0.0.0", "this network"), ("0.1.2.3", "this network"), ("::", "unspecified"),
    ("10.1.2.3", "RFC 1918"), ("172.16.0.1", "RFC 1918"), ("172.31.255.254", "RFC 1918"),
    ("192.168.1.1", "RFC 1918"), ("::ffff:10.0.0.1", "RFC 1918"), ("64:ff9b::a01:203", "RFC 1918"),
    ("169.254.169.254", "metadata"), ("fe80::1", "link-local"), ("100.64.0.1", "carrier-grade"),
    ("fd00:ec2::254", "unique local"), ("fc00::1", "unique local"), ("224.0.0.1", "multicast"),
    ("ff02::1", "multicast"), ("255.255.255.255", "broadcast"), ("2002:7f00:1::", "loopback"),
    ("not-an-ip", "not an IP"),
])
def test_refused_addresses(ip, why):
    reason = refusal_for_address(ip, local=LOCAL)
    assert reason is not None and why in reason


@pytest.mark.parametrize("ip", ["203.0.113.80", "198.51.100.7", "192.0.2.77", "8.8.8.8", "172.32.0.1",
                                "100.128.0.1", "11.0.0.1", "2606:4700::1111", "2001:db8::5", "::ffff:8.8.8.8",
                                "64:ff9b::808:808"])
def test_public_and_test_net_addresses_allowed(ip):
    # TEST-NET ranges are allowed on purpose: this machine's package indexes live there.
    assert ip != own_address()
    assert refusal_for_address(ip, local=LOCAL) is None


def test_own_address_refused():
    ip = own_address()
    if ip is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    assert "an address of this host" in refusal_for_address(ip, local=LOCAL)


def test_parse_build_network():
    assert parse_build_network("public") == parse_build_network(" Public ")
    policy = parse_build_network("allowlist", ["PyPI.org.", "deb.debian.org:80", "*.Example.com", "203.0.113.0/24",
                                               "[2001:db8::1]:443", "198.51.100.7"])
    assert policy.allowed_hosts == ("pypi.org", "deb.debian.org:80", "*.example.com", "203.0.113.0/24",
                                    "[2001:db8::1]:443", "198.51.100.7")
    assert policy.rules[2].matches_name("a.example.com", 1) and not policy.rules[2].matches_name("example.com", 1)
    with pytest.raises(PolicyError, match="--build-network: 'open'"):
        parse_build_network("open")
    with pytest.raises(PolicyError, match=r"allowed_hosts\[1\]: 'https://x.org/'"):
        parse_build_network("allowlist", ["ok.org", "https://x.org/"])
    for bad in ("host:0", "host:99999", "bad host", "", "a..b", "10.0.0.0/8:80"):
        with pytest.raises(PolicyError, match=r"allowed_hosts\[0\]"):
            parse_build_network("allowlist", [bad])
    with pytest.raises(PolicyError, match=r"allowed_hosts\[0\].*never reachable.*RFC 1918"):
        parse_build_network("allowlist", ["10.2.0.0/16"])
    assert parse_build_network("public", ["pypi.org"]) == BuildNetwork("public")  # checked, then not used
    with pytest.raises(PolicyError, match=r"allowed_hosts\[0\]"):
        parse_build_network("none", ["https://pypi.org/"])
    with pytest.raises(PolicyError, match="'None' is not one of"):
        BuildNetwork("None")  # a misspelt mode must not act as public
    assert proxy_env(3128)["https_proxy"] == "http://127.0.0.1:3128" and proxy_env(1)["no_proxy"] == \
        "localhost,127.0.0.1,::1"


def test_index_hosts_from_files_and_env(tmp_path):
    pip = tmp_path / "pip.conf"
    pip.write_text("[global]\nindex-url = https://user:secret@Mirror.Corp:8443/simple\n"
                   "extra-index-url =\n    http://10.9.8.7/simple\n    file:///srv/wheels\n"
                   "[install]\nfind_links = https://wheels.example/\n")
    (tmp_path / "broken.conf").write_text("not [an ini")
    lst = tmp_path / "sources.list"
    lst.write_text("# deb http://commented.example/ x\ndeb [arch=amd64 signed-by=/k.gpg] http://apt.corp/debian "
                   "bookworm main\ndeb-src https://src.corp/debian bookworm main\ndeb file:/srv/repo ./\n")
    sources = tmp_path / "x.sources"
    sources.write_text("Types: deb\nURIs: http://one.corp/debian\n https://two.corp/debian\nSuites: s\n\n"
                       "Types: deb\nEnabled: no\nURIs: http://disabled.corp/\n")
    env = {"PIP_INDEX_URL": "http://[fd00::5]:3141/root/pypi", "UV_INDEX": "corp=https://uv.corp/simple",
           "UV_DEFAULT_INDEX": "https://uvd.corp/", "UV_EXTRA_INDEX_URL": "ftp://nope.corp/"}
    got = index_hosts(env=env, pip_files=[pip, tmp_path / "broken.conf", tmp_path / "missing.conf"],
                      apt_files=[lst, sources])
    assert got == {"mirror.corp:8443", "10.9.8.7:80", "wheels.example:443", "apt.corp:80", "src.corp:443",
                   "one.corp:80", "two.corp:443", "[fd00::5]:3141", "uv.corp:443", "uvd.corp:443"}


def test_index_hosts_default_files(tmp_path):
    conf = tmp_path / "custom.conf"
    conf.write_text("[global]\nindex-url = https://from-env-file.corp/simple\n")
    got = index_hosts(env={"HOME": str(tmp_path), "PIP_CONFIG_FILE": str(conf)})
    assert "from-env-file.corp:443" in got
    if Path("/etc/apt/sources.list.d/debian.sources").exists():
        assert "deb.debian.org:80" in got  # this machine's own apt configuration


def test_upstream_from_env():
    up = Upstream.from_env({"HTTPS_PROXY": "http://u:p%40ss@proxy.corp:3128", "http_proxy": "proxy2.corp:8080",
                            "NO_PROXY": "internal.corp, .svc,10.0.0.0/8,pinned.corp:443"})
    assert up.https == UpstreamProxy("proxy.corp", 3128, False, "Basic dTpwQHNz")
    assert str(up.https) == "http://proxy.corp:3128"  # no credentials in logs
    assert up.for_target("pypi.org", 443, tunnel=True) is up.https
    assert up.for_target("pypi.org", 80, tunnel=False) == UpstreamProxy("proxy2.corp", 8080)
    for host, port in [("internal.corp", 443), ("a.svc", 443), ("10.1.2.3", 443), ("pinned.corp", 443)]:
        assert up.for_target(host, port, tunnel=True) is None
    assert up.for_target("pinned.corp", 8443, tunnel=True) is up.https
    assert Upstream.from_env({"ALL_PROXY": "socks5://x:1080"}) == Upstream()
