"""The router's nftables rules for an episode's policy, and the commands that change them
while it runs; pure (text in the ``nft`` language, loaded by the namespace helper through
libnftables in the router namespace the agent has no capability over).

Every packet of the agent's crosses the router's ``forward`` hook (whatever the agent
crafted: raw sockets and ``AF_PACKET`` frames reach the router's own IP stack, which parses
them like any other). Its order, which is the security argument:

1. ``phase``: in the verifier's phase, flows the agent's hosts were granted (marked) are cut;
2. replies of allowed flows pass (counted);
3. only what comes from the agent's link and goes out to the user-mode stack, IPv4, TCP,
   UDP or ICMP;
4. ``agent_explicit``: the operator's ``HOST:PORT`` entries (which alone may be private);
5. the refused ranges (:data:`sequester.net.addresses.RANGES`) and the host's own networks;
6. ``public``: the rest; ``allowlist``: the operator's hosts (``agent_hosts``), then the
   task's (addresses learned from DNS answers, with the answer's TTL), else refused.

Refused packets are rejected (``admin-prohibited``: a connection fails at once with "No
route to host") and counted per destination; allowed ones are counted per destination in
both directions. Every table is bounded (:data:`SET_SIZE`): when one is full, later
destinations pass or are refused as before, uncounted.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sequester.net.addresses import RANGES, HostRule
from sequester.net.episode.layout import DNS_ADDRESS, GATEWAY, ROUTER_IFNAME, TAP_IFNAME
from sequester.net.episode.policy import EpisodePolicy

__all__ = [
    "TABLE",
    "SET_SIZE",
    "AGENT_MARK",
    "Grant",
    "ruleset",
    "grant_commands",
    "verifier_phase_commands",
    "agent_phase_commands",
    "list_records_command",
    "static_grants",
]

TABLE = "sequester"
SET_SIZE = 4096  # elements of each set: granted addresses, counted and refused destinations
AGENT_MARK = 0x5E9A  # conntrack mark of flows granted to the operator's hosts (agent's phase only)
_ADDR_PORT = "ipv4_addr . inet_proto . inet_service"
_PROTOCOLS = ("tcp", "udp")


@dataclass(frozen=True)
class Grant:
    """One address let through: into ``set`` (``task_any``, ``task_ports``, ``agent_any``,
    ``agent_ports``), for ``port`` (TCP and UDP) or any, for ``timeout`` seconds or for good."""

    set: str
    address: ipaddress.IPv4Address
    port: int | None = None
    timeout: int | None = None

    def elements(self) -> list[str]:
        suffix = f" timeout {self.timeout}s" if self.timeout is not None else ""
        if self.port is None:
            return [f"{self.address}{suffix}"]
        return [f"{self.address} . {proto} . {self.port}{suffix}" for proto in _PROTOCOLS]


def _set(name: str, kind: str, *, flags: str, elements: Iterable[str] = (), extra: str = "") -> str:
    body = f"type {kind}; flags {flags};{extra}"
    listed = ", ".join(elements)
    if listed:
        body += f" elements = {{ {listed} }};"
    return f"    set {name} {{ {body} }}"


MAX_FLOWS = 4096  # connections (TCP, UDP, ICMP flows) an agent may have tracked at once


def refused_networks(host: Iterable[ipaddress.IPv4Network]) -> list[ipaddress.IPv4Network]:
    """The fixed refused IPv4 ranges and the host's own networks, merged."""
    fixed = [n for n, _c, _w in RANGES if isinstance(n, ipaddress.IPv4Network)]
    return list(ipaddress.collapse_addresses([*fixed, *host]))


def static_grants(rules: Sequence[HostRule], *, agent: bool) -> tuple[list[Grant], list[ipaddress.IPv4Network]]:
    """The literal IPv4 entries of ``rules``: single addresses (with or without a port) as
    grants for good, networks as intervals. Names are granted as DNS answers them."""
    grants: list[Grant] = []
    nets: list[ipaddress.IPv4Network] = []
    prefix = "agent" if agent else "task"
    for rule in rules:
        if not isinstance(rule.network, ipaddress.IPv4Network) or rule.names_loopback:
            continue
        if rule.port is not None:
            grants.append(Grant(f"{prefix}_ports", rule.network.network_address, rule.port))
        elif rule.network.num_addresses == 1:
            grants.append(Grant(f"{prefix}_any", rule.network.network_address))
        else:
            nets.append(rule.network)
    return grants, nets


def _agent_chains(policy: EpisodePolicy) -> tuple[list[str], list[str]]:
    """The rules of ``agent_explicit`` and ``agent_hosts``, as in the agent's phase."""
    mark = f"ct mark set {AGENT_MARK:#x}"
    explicit = [
        f"meta l4proto {{ tcp, udp }} ip daddr . meta l4proto . th dport @agent_ports {mark} jump counted",
    ]
    hosts = []
    if policy.agent_mode == "allowlist":
        hosts = [f"ip daddr @agent_any {mark} jump counted", f"ip daddr @agent_nets {mark} jump counted"]
    return explicit, hosts


def ruleset(policy: EpisodePolicy, host_networks: Iterable[ipaddress.IPv4Network] = ()) -> str:
    """The whole table for ``policy`` (in the agent's phase), for a router that has none yet."""
    mode = policy.agent_mode
    if mode not in ("public", "allowlist"):
        raise ValueError(f"no router for network mode {mode!r}")
    task_grants, task_nets = static_grants(policy.allowed, agent=False)
    agent_grants, agent_nets = static_grants(policy.routed_agent, agent=True)
    by_set: dict[str, list[str]] = {"task_any": [], "task_ports": [], "agent_any": [], "agent_ports": []}
    for grant in [*task_grants, *agent_grants]:
        by_set[grant.set] += grant.elements()
    refused = [str(n) for n in refused_networks(host_networks)]
    counted = f"flags dynamic; size {SET_SIZE}; counter;"
    explicit, hosts = _agent_chains(policy)
    lines = [  # (a fresh namespace: nothing to replace; "delete table" costs 10-25 ms)
        f"table inet {TABLE} {{",
        _set("refused", "ipv4_addr", flags="interval", elements=refused, extra=" auto-merge;"),
        _set("task_any", "ipv4_addr", flags="timeout", elements=by_set["task_any"], extra=f" size {SET_SIZE};"),
        _set("task_ports", _ADDR_PORT, flags="timeout", elements=by_set["task_ports"], extra=f" size {SET_SIZE};"),
        _set("task_nets", "ipv4_addr", flags="interval", elements=map(str, task_nets), extra=" auto-merge;"),
        _set("agent_any", "ipv4_addr", flags="timeout", elements=by_set["agent_any"], extra=f" size {SET_SIZE};"),
        _set("agent_ports", _ADDR_PORT, flags="timeout", elements=by_set["agent_ports"], extra=f" size {SET_SIZE};"),
        _set("agent_nets", "ipv4_addr", flags="interval", elements=map(str, agent_nets), extra=" auto-merge;"),
        f"    set sent {{ type {_ADDR_PORT}; {counted} }}",
        f"    set received {{ type {_ADDR_PORT}; {counted} }}",
        f"    set refused_hits {{ type {_ADDR_PORT}; {counted} }}",
        "    counter refused_packets { }",
        # the agent's connections tracked at once (red team: a UDP spray filled the host's
        # whole connection-tracking table, 64 MiB of kernel memory, in 3.5 s)
        "    set flows { type ipv4_addr; flags dynamic; size 16; }",
        "    counter flow_cap_packets { }",
        "    chain counted {",
        f'        iifname "{ROUTER_IFNAME}" meta l4proto {{ tcp, udp }} '
        "add @sent { ip daddr . meta l4proto . th dport }",
        f'        oifname "{ROUTER_IFNAME}" meta l4proto {{ tcp, udp }} '
        "add @received { ip saddr . meta l4proto . th sport }",
        "        accept",
        "    }",
        "    chain refuse {",
        f'        iifname "{ROUTER_IFNAME}" meta nfproto ipv4 meta l4proto {{ tcp, udp }} '
        "add @refused_hits { ip daddr . meta l4proto . th dport }",
        '        counter name "refused_packets"',
        "        reject with icmpx type admin-prohibited",
        "    }",
        "    chain phase {",
        "    }",
        "    chain agent_explicit {",
        *(f"        {r}" for r in explicit),
        "    }",
        "    chain agent_hosts {",
        *(f"        {r}" for r in hosts),
        "    }",
        "    chain decide {",
        "        jump agent_explicit",
        "        ip daddr @refused jump refuse",
        *(
            ["        jump counted"]
            if mode == "public"
            else [
                "        jump agent_hosts",
                "        meta l4proto { tcp, udp } ip daddr . meta l4proto . th dport @task_ports jump counted",
                "        ip daddr @task_any jump counted",
                "        ip daddr @task_nets jump counted",
                "        jump refuse",
            ]
        ),
        "    }",
        "    chain forward {",
        "        type filter hook forward priority filter; policy drop;",
        "        jump phase",
        "        ct state established,related jump counted",
        "        ct state invalid drop",
        f'        iifname != "{ROUTER_IFNAME}" drop',
        f'        ct state new add @flows {{ ip saddr ct count over {MAX_FLOWS} }} counter name "flow_cap_packets" '
        "reject with icmpx type admin-prohibited",
        f'        oifname != "{TAP_IFNAME}" jump refuse',
        "        meta nfproto != ipv4 jump refuse",
        "        meta l4proto != { tcp, udp, icmp } jump refuse",
        "        jump decide",
        "    }",
        "    chain input {",
        "        type filter hook input priority filter; policy drop;",
        '        iif "lo" accept',
        "        ct state established,related accept",
        f'        iifname "{ROUTER_IFNAME}" ip daddr {DNS_ADDRESS} meta l4proto {{ tcp, udp }} th dport 53 accept',
        f'        iifname "{ROUTER_IFNAME}" ip daddr {{ {GATEWAY}, {DNS_ADDRESS} }} icmp type echo-request accept',
        "    }",
        "    chain output {",
        "        type filter hook output priority filter; policy accept;",
        f'        oifname "{TAP_IFNAME}" drop',
        "    }",
        "    chain postrouting {",
        "        type nat hook postrouting priority srcnat; policy accept;",
        f'        oifname "{TAP_IFNAME}" masquerade',
        "    }",
        "}",
    ]
    return "\n".join(lines) + "\n"


def grant_commands(grants: Iterable[Grant]) -> list[tuple[str, bool]]:
    """Commands that let ``grants`` through, each with whether it may fail: an element
    already there is deleted first (a kernel before 6.10 keeps its old expiry on an add),
    and that deletion fails when there was none."""
    commands = []
    for grant in grants:
        for element in grant.elements():
            key = element.split(" timeout ")[0]
            commands.append((f"delete element inet {TABLE} {grant.set} {{ {key} }}", True))
            commands.append((f"add element inet {TABLE} {grant.set} {{ {element} }}", False))
    return commands


def verifier_phase_commands(policy: EpisodePolicy) -> list[str]:
    """The operator's hosts withdrawn: no new flow to them, and their flows cut. None when
    the policy gives the agent no host of the operator's: no address can then enter the
    agent's sets, no flow carries the agent's mark, and both phases are the same rules
    (an evaluation then pays no change of rules: two round trips to the helper)."""
    if not policy.agent:
        return []
    return [
        f"flush chain inet {TABLE} agent_explicit",
        f"flush chain inet {TABLE} agent_hosts",
        f"flush chain inet {TABLE} phase",
        f"add rule inet {TABLE} phase ct mark {AGENT_MARK:#x} jump refuse",
    ]


def agent_phase_commands(policy: EpisodePolicy) -> list[str]:
    """Back to the agent's phase: the operator's hosts as :func:`ruleset` made them (none
    to restore when :func:`verifier_phase_commands` withdrew none)."""
    if not policy.agent:
        return []
    explicit, hosts = _agent_chains(policy)
    return [
        f"flush chain inet {TABLE} phase",
        f"flush chain inet {TABLE} agent_explicit",
        f"flush chain inet {TABLE} agent_hosts",
        *(f"add rule inet {TABLE} agent_explicit {r}" for r in explicit),
        *(f"add rule inet {TABLE} agent_hosts {r}" for r in hosts),
    ]


def list_records_command() -> str:
    """The counted destinations, in JSON (read at the end of an episode)."""
    return f"list table inet {TABLE}"
