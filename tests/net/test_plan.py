"""How the allowlist looks from inside a sandbox (:mod:`sequester.net.plan`, pure): loopback
listeners, names in the hosts file, the proxy port, and exact matching."""

from sequester import Endpoint
from sequester.net.plan import is_allowed, plan_network


def test_loopback_targets_listen_on_their_own_address():
    plan = plan_network([Endpoint("127.0.0.1", 8000), Endpoint("localhost", 9000), Endpoint("::1", 7000)])
    targets = {(l.address, l.port): l.target for l in plan.listeners if l.target}
    assert targets[("127.0.0.1", 8000)] == Endpoint("127.0.0.1", 8000)
    assert targets[("127.0.0.1", 9000)] == Endpoint("localhost", 9000)
    assert targets[("::1", 7000)] == Endpoint("::1", 7000)


def test_names_get_loopback_addresses_in_the_hosts_file():
    plan = plan_network([Endpoint("api.example.com", 443), Endpoint("api.example.com", 80), Endpoint("b.test", 443)])
    by_name = {l.target.host: l.address for l in plan.listeners if l.target}
    assert by_name["api.example.com"] == "127.0.1.1" and by_name["b.test"] == "127.0.1.2"
    assert "127.0.1.1 api.example.com" in plan.hosts_file
    assert "127.0.1.2 b.test" in plan.hosts_file


def test_non_loopback_ip_is_proxy_only():
    plan = plan_network([Endpoint("10.0.0.5", 8000)])
    assert [l for l in plan.listeners if l.target] == []


def test_proxy_port_avoids_allowed_ports():
    plan = plan_network([Endpoint("127.0.0.1", 3128)])
    assert plan.proxy_port != 3128
    assert ("HTTPS_PROXY", plan.proxy_url) in plan.env
    assert [l for l in plan.listeners if l.target is None] == [
        next(l for l in plan.listeners if l.port == plan.proxy_port)]


def test_is_allowed_is_exact():
    allow = [Endpoint("api.example.com", 443), Endpoint("127.0.0.1", 8000)]
    assert is_allowed(allow, "API.example.com", 443)
    assert not is_allowed(allow, "api.example.com", 80)
    assert not is_allowed(allow, "evil.api.example.com", 443)
    assert not is_allowed(allow, "127.0.0.1", 8001)
    assert not is_allowed(allow, "not a host", 443)


def test_the_same_loopback_endpoint_twice_gets_one_listener():
    plan = plan_network([Endpoint("localhost", 8000), Endpoint("127.0.0.1", 8000), Endpoint("localhost", 8001)])
    bound = [(l.address, l.port) for l in plan.listeners]
    assert len(bound) == len(set(bound))
    targets = {(l.address, l.port): l.target for l in plan.listeners if l.target}
    assert targets[("127.0.0.1", 8000)] == Endpoint("127.0.0.1", 8000)  # the IP literal wins
    assert targets[("127.0.0.1", 8001)] == Endpoint("localhost", 8001)
