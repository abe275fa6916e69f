"""How an episode's network looks, inside and out; pure.

    agent's namespace            router namespace (sequester's)            host
    eth0 10.0.2.100/24  --veth--  sqagent 10.0.2.2/24  (gateway)
    default via 10.0.2.2          + 10.0.2.3/24  (DNS: a socket served by the host)
    nameserver 10.0.2.3           nftables: the policy, by address
                                  tap0 10.0.3.100/24 --tap-- slirp4netns --sockets--> internet
                                  default via 10.0.3.2 (slirp's gateway; masqueraded)

The agent sees what a rootless container with slirp4netns shows (``10.0.2.100``, gateway
``10.0.2.2``, DNS ``10.0.2.3``); its frames, whatever it crafts, reach nothing but the
router's ``sqagent``, where the router's own IP stack parses them and its rules decide.
No IPv6 leaves (as on Docker's default bridge): the agent has loopback ``::1`` only.
"""

from __future__ import annotations

import ipaddress

__all__ = [
    "AGENT_IFNAME",
    "ROUTER_IFNAME",
    "TAP_IFNAME",
    "AGENT_ADDRESS",
    "GATEWAY",
    "DNS_ADDRESS",
    "LINK",
    "STACK_CIDR",
    "MTU",
    "resolv_conf",
    "hosts_file",
]

AGENT_IFNAME = "eth0"  # the agent's end of the link
ROUTER_IFNAME = "sqagent"  # the router's end
TAP_IFNAME = "tap0"  # the user-mode stack's device, in the router namespace
LINK = ipaddress.IPv4Network("10.0.2.0/24")
AGENT_ADDRESS = ipaddress.IPv4Address("10.0.2.100")
GATEWAY = ipaddress.IPv4Address("10.0.2.2")
DNS_ADDRESS = ipaddress.IPv4Address("10.0.2.3")
STACK_CIDR = ipaddress.IPv4Network("10.0.3.0/24")  # slirp4netns --cidr: the router's side
MTU = 65520  # slirp4netns' largest; the link's too, so no fragmenting in between


def resolv_conf() -> str:
    """The agent's ``/etc/resolv.conf``: the DNS responder only (the host's resolver is
    private: only sequester's host process asks it)."""
    return f"# sequester: the episode's DNS (answers what its network policy allows)\nnameserver {DNS_ADDRESS}\n"


def hosts_file(hostname: str, networked: bool) -> str:
    """The agent's ``/etc/hosts``, as Docker writes a container's: loopback names, and the
    episode's hostname at its address (``127.0.1.1``, Debian's, without a network), so a
    program that looks its own host up (R, Java, ``sudo``) finds it without asking DNS."""
    address = AGENT_ADDRESS if networked else "127.0.1.1"
    return (
        "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\nfe00::0\tip6-localnet\n"
        "ff00::0\tip6-mcastprefix\nff02::1\tip6-allnodes\nff02::2\tip6-allrouters\n"
        f"{address}\t{hostname}\n"
    )
