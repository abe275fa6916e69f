"""The pure parts of an episode's network (sequester.net.episode): the policy from a task
and the operator, the router's rules, the stack's command line, the DNS responder's
decisions, the host's networks and the traffic record; and the operator's options."""

from __future__ import annotations

import ipaddress
import json
import struct
import subprocess
import sys

import pytest

from sequester.errors import PolicyError
from sequester.net.addresses import LocalAddresses
from sequester.net.episode import dns
from sequester.net.episode.answers import MIN_TTL, Answers, special_name
from sequester.net.episode.hostnet import parse_fib_trie, parse_route
from sequester.net.episode.layout import DNS_ADDRESS, resolv_conf
from sequester.net.episode.policy import episode_policy, parse_operator_hosts, parse_run_network
from sequester.net.episode.records import traffic_record
from sequester.net.episode.ruleset import (
    Grant,
    agent_phase_commands,
    grant_commands,
    ruleset,
    verifier_phase_commands,
)
from sequester.net.episode.stack import slirp_argv
from sequester.net.episode.upstream import parse_resolv_conf, parse_server


# -- policy ------------------------------------------------------------------------------------

def test_the_task_decides_unless_the_operator_narrows():
    assert episode_policy("public").mode == "public" and episode_policy("public").decided_by == "task"
    assert episode_policy("no-network").mode == "none" and not episode_policy("no-network").has_network
    narrowed = episode_policy("public", run_network="allowlist")
    assert narrowed.mode == "allowlist" and not narrowed.has_network  # an empty allowlist is no network
    assert narrowed.decided_by == "operator (--network allowlist)"
    kept = episode_policy("allowlist", ["pypi.org"], run_network="allowlist")
    assert kept.mode == "allowlist" and [str(r) for r in kept.allowed] == ["pypi.org"]
    assert episode_policy("allowlist", ["pypi.org"], run_network="none").mode == "none"


def test_the_operators_hosts_are_for_the_agents_phase_in_every_mode():
    hosts = parse_operator_hosts(["api.example.com", "localhost:8080"])
    p = episode_policy("no-network", agent_hosts=hosts)
    assert p.mode == "none" and p.agent_mode == "allowlist" and p.has_network
    assert [str(r) for r in p.relayed] == ["localhost:8080"] and [str(r) for r in p.routed_agent] == ["api.example.com"]
    assert p.to_record()["agent_hosts"] == ["api.example.com", "localhost:8080"]


@pytest.mark.parametrize("bad", ["10.1.2.3", "localhost", "127.0.0.1", "169.254.169.254", "192.168.0.0/16",
                                 "224.0.0.1:80", "myhost.localhost:80", "http://pypi.org", "", "a b"])
def test_an_operator_host_that_would_open_the_host_or_its_networks_is_refused(bad):
    with pytest.raises(PolicyError, match="--allow-host"):
        parse_operator_hosts([bad], field="--allow-host")


def test_only_the_operator_opens_a_private_service_and_only_one_port():
    assert [str(r) for r in parse_operator_hosts(["10.1.2.3:3141", "127.0.0.1:8080"])] == ["10.1.2.3:3141",
                                                                                           "127.0.0.1:8080"]
    p = episode_policy("allowlist", ["10.1.2.3", "pypi.org"])
    assert any("never reachable" in n for n in p.notes())  # a task's private entry is said, never opened


def test_run_network_spelling():
    assert parse_run_network(" NONE ") == "none"
    with pytest.raises(PolicyError, match="--network"):
        parse_run_network("public", field="--network")


# -- ruleset -----------------------------------------------------------------------------------

def test_public_ruleset_refuses_the_ranges_and_the_hosts_networks_before_allowing():
    text = ruleset(episode_policy("public"), [ipaddress.IPv4Network("198.51.100.0/24")])
    decide = text[text.index("chain decide"):text.index("chain forward")]
    assert decide.index("@refused jump refuse") < decide.index("jump counted")
    refused = text[text.index("set refused"):].split("}")[0]
    for network in ("10.0.0.0/8", "169.254.0.0/16", "100.64.0.0/10", "127.0.0.0/8", "198.51.100.0/24"):
        assert network in refused, network
    assert "policy drop" in text and "meta nfproto != ipv4 jump refuse" in text  # no IPv6 leaves
    assert 'oifname "tap0" masquerade' in text


def test_allowlist_ruleset_refuses_what_no_answer_granted():
    text = ruleset(episode_policy("allowlist", ["pypi.org", "203.0.113.7"]))
    decide = text[text.index("chain decide"):text.index("chain forward")]
    assert decide.strip().splitlines()[-2].strip() == "jump refuse"  # the last word
    assert "203.0.113.7" in text  # a literal entry is granted for good
    with pytest.raises(ValueError):
        ruleset(episode_policy("no-network"))


def test_grants_replace_an_element_and_the_verifier_phase_cuts_the_operators_flows():
    commands = grant_commands([Grant("task_any", ipaddress.IPv4Address("203.0.113.7"), None, 60)])
    assert commands == [("delete element inet sequester task_any { 203.0.113.7 }", True),
                        ("add element inet sequester task_any { 203.0.113.7 timeout 60s }", False)]
    operator = episode_policy("allowlist", ["pypi.org"], agent_hosts=parse_operator_hosts(["10.1.2.3:3141"]))
    assert any("ct mark" in c and "jump refuse" in c for c in verifier_phase_commands(operator))
    assert any("agent_hosts" in c for c in agent_phase_commands(operator))


def test_without_operator_hosts_both_phases_are_the_same_rules():
    """No host of the operator's: nothing can carry the agent's mark, so an evaluation
    changes no rule (and pays no round trip to the helper for it)."""
    for policy in (episode_policy("public"), episode_policy("allowlist", ["pypi.org"])):
        assert verifier_phase_commands(policy) == [] and agent_phase_commands(policy) == []
        assert "agent_ports" in ruleset(policy)  # (the agent's chains match empty sets)


def test_nft_accepts_the_ruleset(tmp_path):
    nft = subprocess.run(["sh", "-c", "command -v nft"], capture_output=True, text=True).stdout.strip()
    if not nft:
        pytest.skip("nft is not installed")
    rules = tmp_path / "rules.nft"
    rules.write_text(ruleset(episode_policy("allowlist", ["pypi.org", "203.0.113.0/24"],
                                            agent_hosts=parse_operator_hosts(["10.1.2.3:3141"]))))
    done = subprocess.run([nft, "-c", "-f", str(rules)], capture_output=True, text=True)
    if "Operation not permitted" in done.stderr:
        pytest.skip("nft -c needs CAP_NET_ADMIN here")
    assert done.returncode == 0, done.stderr


# -- the stack -----------------------------------------------------------------------------------

def test_slirp4netns_runs_without_host_loopback_dns_or_api():
    argv = slirp_argv("/usr/bin/slirp4netns", holder=42, ready=3, exit=4)
    assert {"--disable-host-loopback", "--disable-dns", "--enable-sandbox", "--enable-seccomp"} <= set(argv)
    assert not any(a.startswith("--api-socket") for a in argv)
    assert argv[-2:] == ["42", "tap0"] and "--userns-path=/proc/42/ns/user" in argv


# -- DNS ------------------------------------------------------------------------------------------

def _answer(question: bytes, *addresses: str, ttl: int = 300) -> bytes:
    msg = dns.parse_message(question)
    head = struct.pack("!HHHHHH", msg.id, 0x8180, 1, len(addresses), 0, 0)
    body = question[12:]
    for a in addresses:
        body += struct.pack("!HHHIH", 0xC00C, 1, 1, ttl, 4) + ipaddress.IPv4Address(a).packed
    return head + body


class _NotLocal(LocalAddresses):
    def __contains__(self, ip: object) -> bool:
        return str(ip) == "198.51.100.7"


def test_answers_pointing_at_refused_addresses_are_refused_whole():
    answers = Answers(episode_policy("public"), local=_NotLocal())
    q = dns.query(7, "rebind.example.com", dns.A)
    question = dns.parse_message(q).questions[0]
    for address in ("10.0.0.5", "169.254.169.254", "127.0.0.1", "100.64.0.1", "198.51.100.7"):
        verdict = answers.answer(question, dns.parse_message(_answer(q, "203.0.113.9", address)))
        assert verdict.refused is not None, address
    assert answers.answer(question, dns.parse_message(_answer(q, "203.0.113.9"))).refused is None


def test_allowlist_answers_grant_their_addresses_for_at_least_the_minimum_ttl():
    answers = Answers(episode_policy("allowlist", ["pypi.org"]), local=_NotLocal())
    assert answers.question(dns.parse_message(dns.query(1, "deb.debian.org", dns.A))) is not None
    q = dns.query(2, "pypi.org", dns.A)
    verdict = answers.answer(dns.parse_message(q).questions[0], dns.parse_message(_answer(q, "203.0.113.9", ttl=5)))
    assert verdict.grants == (Grant("task_any", ipaddress.IPv4Address("203.0.113.9"), None, MIN_TTL),)
    assert verdict.ttl_cap == MIN_TTL


def test_local_names_zone_transfers_and_reverse_names_of_refused_ranges_are_never_asked():
    answers = Answers(episode_policy("public"), local=_NotLocal())
    for name, qtype in (("localhost", dns.A), ("printer.local", dns.A), ("x.internal", dns.A), ("intranet", dns.A),
                        ("example.com", 252), ("5.0.0.10.in-addr.arpa", dns.PTR)):
        assert answers.question(dns.parse_message(dns.query(3, name, qtype))) is not None, name
    assert special_name("pypi.org") is None


def test_a_compression_loop_is_malformed_not_a_hang():
    loop = struct.pack("!HHHHHH", 1, 0, 1, 0, 0, 0) + b"\xc0\x0c" + struct.pack("!HH", 1, 1)
    with pytest.raises(dns.DnsError):
        dns.parse_message(loop)


def test_resolvers_and_resolv_conf():
    assert parse_resolv_conf("nameserver 10.255.255.53\nnameserver ::1\nsearch x\n") == [("10.255.255.53", 53),
                                                                                         ("::1", 53)]
    assert parse_server("127.0.0.1:5353") == ("127.0.0.1", 5353) and parse_server("[::1]:53") == ("::1", 53)
    assert f"nameserver {DNS_ADDRESS}" in resolv_conf()


# -- the host's networks, the record ---------------------------------------------------------------

FIB = """Main:
  +-- 0.0.0.0/0 3 0 5
     |-- 0.0.0.0
        /0 universe UNICAST
     +-- 192.0.2.0/24 2 0 2
        |-- 192.0.2.0
           /24 link UNICAST
        |-- 192.0.2.2
           /32 host LOCAL
        |-- 192.0.2.255
           /32 link BROADCAST
"""


def test_host_networks_from_the_kernels_tables():
    found = parse_fib_trie(FIB)
    assert found.own == (ipaddress.IPv4Network("192.0.2.2/32"),)
    assert found.connected == (ipaddress.IPv4Network("192.0.2.0/24"),)
    route = "Iface\tDestination\tGateway\tFlags\neth0\t00000000\t010200C0\t0003\n"
    assert parse_route(route) == (ipaddress.IPv4Address("192.0.2.1"),)


def test_the_record_is_bounded_and_largest_first():
    def elements(name, items):
        return {"set": {"name": name, "elem": [{"elem": {"val": {"concat": [a, "tcp", 443]},
                                                          "counter": {"packets": 1, "bytes": b}}} for a, b in items]}}
    listing = json.dumps({"nftables": [elements("sent", [("203.0.113.1", 10), ("203.0.113.2", 500)]),
                                       elements("received", [("203.0.113.2", 9000)])]})
    record = traffic_record(listing, {"203.0.113.2": ["pypi.org"]})
    assert [d["address"] for d in record["destinations"]] == ["203.0.113.2", "203.0.113.1"]
    assert record["destinations"][0]["names"] == ["pypi.org"] and record["bytes_in"] == 9000
    assert traffic_record("not json")["complete"] is False


# -- the operator's options ---------------------------------------------------------------------

@pytest.mark.parametrize("args, said", [
    (["--network", "public"], "--network"),
    (["--allow-host", "10.0.0.1"], "--allow-host"),
    (["--allow-host", "localhost"], "--allow-host"),
])
def test_bad_network_options_are_exit_status_2_naming_the_option(tmp_path, args, said):
    for command in (["run", str(tmp_path), "--agent", "nop"], ["serve"]):
        done = subprocess.run([sys.executable, "-m", "sequester.cli", *command, *args], capture_output=True,
                              text=True, timeout=60, cwd=tmp_path)
        assert done.returncode == 2, (command, done.stderr)
        assert said in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_the_config_files_network_keys_are_checked(tmp_path):
    from sequester.config import load_config

    config = tmp_path / "c.toml"
    config.write_text('[episodes]\nnetwork = "allowlist"\nallowed_hosts = ["pypi.org", "localhost:8080"]\n')
    episodes = load_config(config).episodes
    assert episodes.network == "allowlist" and episodes.allowed_hosts == ("pypi.org", "localhost:8080")
    config.write_text('[episodes]\nallowed_hosts = ["169.254.169.254"]\n')
    with pytest.raises(PolicyError, match="episodes.allowed_hosts"):
        load_config(config)


def test_a_question_whose_labels_are_not_a_host_names_is_malformed():
    """Red team: the wire label ``allowed.test`` (one label holding a dot) was judged as the
    allowed name ``allowed.test``: labels are letters, digits, '-' and '_' only."""
    import struct

    from sequester.net.episode.dns import DnsError, parse_message

    def query(*labels: bytes) -> bytes:
        name = b"".join(bytes([len(label)]) + label for label in labels) + b"\x00"
        return struct.pack("!HHHHHH", 1, 0x0100, 1, 0, 0, 0) + name + struct.pack("!HH", 1, 1)

    assert parse_message(query(b"pypi", b"org")).questions[0].name == "pypi.org"
    assert parse_message(query(b"_http", b"_tcp", b"x-y", b"org")).questions[0].name == "_http._tcp.x-y.org"
    for labels in ((b"allowed.test",), (b"x", b"evil\x00", b"org"), (b"a b", b"org")):
        with pytest.raises(DnsError):
            parse_message(query(*labels))


def test_the_operators_own_host_port_may_be_a_local_name():
    """`--allow-host mirror.internal:3141` (docs/network.md) was refused as a local name
    before the operator's rules were read."""
    from sequester.net.episode.answers import Answers
    from sequester.net.episode.dns import parse_message
    from sequester.net.episode.policy import episode_policy, parse_operator_hosts
    import struct

    name = b"".join(bytes([len(p)]) + p for p in (b"mirror", b"internal")) + b"\x00"
    msg = parse_message(struct.pack("!HHHHHH", 1, 0x0100, 1, 0, 0, 0) + name + struct.pack("!HH", 1, 1))
    with_it = Answers(episode_policy("public", (), run_network="task",
                                     agent_hosts=parse_operator_hosts(["mirror.internal:3141"])))
    without = Answers(episode_policy("public", (), run_network="task", agent_hosts=()))
    assert with_it.question(msg) is None
    assert without.question(msg) is not None
