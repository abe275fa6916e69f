"""What an episode's DNS responder answers: which questions go upstream at all, and what
an upstream answer lets through; pure (the addresses' test of being the host's own is
:class:`~sequester.net.addresses.LocalAddresses`, a bind()).

Questions refused before anything is asked: malformed ones, anything but one ``QUERY`` of
class ``IN``, zone transfers; names of the host's own networks (``localhost``, ``.local``,
``.internal``, ``.home.arpa``, ``.lan``, single labels, reverse names of refused ranges);
in allowlist mode, every name no entry allows.

An answer is refused whole when any address in it lies in a refused range or on the host
(DNS rebinding: a public name pointing at 10.0.0.5 or 169.254.169.254), unless the
operator named that very name with a port (``mirror.internal:3141``): then that port of
those addresses is granted, for the agent's phase only. In allowlist mode every address of
an answer to an allowed name is granted (the router's sets, with the answer's TTL, at
least :data:`MIN_TTL` and at most :data:`MAX_TTL`; the TTLs the agent sees are lowered to
it, so no program holds an address longer than the router lets it through).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from sequester.net.addresses import LOOPBACK, NEVER, HostRule, IPAddress, LocalAddresses, classify_address
from sequester.net.episode.dns import AAAA, CLASS_IN, NOERROR, Message, Question
from sequester.net.episode.policy import EpisodePolicy
from sequester.net.episode.ruleset import Grant

__all__ = ["MIN_TTL", "MAX_TTL", "Verdict", "Answers", "special_name"]

MIN_TTL = 60  # seconds an answered address stays granted, at least (CDNs answer with 20-60 s)
MAX_TTL = 86400
_SPECIAL = ("localhost", "local", "internal", "home.arpa", "lan")
_TRANSFERS = (251, 252, 255)  # IXFR, AXFR, ANY


@dataclass(frozen=True)
class Verdict:
    """What to do with an upstream answer: refuse it (``refused`` says why), or send it
    with TTLs at most ``ttl_cap`` after letting ``grants`` through."""

    refused: str | None = None
    grants: tuple[Grant, ...] = ()
    ttl_cap: int | None = None
    addresses: tuple[str, ...] = ()


def _reverse_address(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address (missing parts as zeros) a reverse name stands for, or None."""
    labels = name.split(".")
    try:
        if name.endswith(".in-addr.arpa"):
            octets = [int(x) for x in reversed(labels[:-2])][:4]
            if not octets or any(not 0 <= o <= 255 for o in octets):
                return None
            return ipaddress.IPv4Address(bytes(octets + [0] * (4 - len(octets))))
        if name.endswith(".ip6.arpa"):
            nibbles = "".join(reversed(labels[:-2]))[:32]
            if not nibbles:
                return None
            return ipaddress.IPv6Address(int(nibbles.ljust(32, "0"), 16))
    except ValueError:
        return None
    return None


def special_name(name: str) -> str | None:
    """Why ``name`` is never asked upstream (it belongs to the host's own networks), or None."""
    if name == "":
        return None  # the root (resolvers' priming queries)
    if "." not in name:
        return f"{name!r} is a single label (a name of the local network)"
    for suffix in _SPECIAL:
        if name == suffix or name.endswith("." + suffix):
            return f"{name!r} is a name of the local network (.{suffix})"
    return None


def _matches(rule: HostRule, name: str) -> bool:
    if rule.name is None:
        return False
    return name == rule.name or (rule.name.startswith(".") and name.endswith(rule.name))


class Answers:
    """The responder's decisions for one episode's ``policy``. ``agent_phase``: whether the
    operator's hosts count now (not while the verifier runs)."""

    def __init__(
        self,
        policy: EpisodePolicy,
        *,
        local: LocalAddresses | None = None,
        host_networks: Sequence[ipaddress.IPv4Network] = (),
        min_ttl: int = MIN_TTL,
        max_ttl: int = MAX_TTL,
    ):
        self.policy = policy
        self.local = local or LocalAddresses()
        self.host_networks = tuple(host_networks)
        self.min_ttl, self.max_ttl = min_ttl, max_ttl
        self.agent_phase = True

    @property
    def mode(self) -> str:
        return self.policy.agent_mode if self.agent_phase else self.policy.mode

    def _rules(self, name: str) -> tuple[list[HostRule], list[HostRule]]:
        """The task's and (in the agent's phase) the operator's name entries matching ``name``."""
        task = [r for r in self.policy.allowed if _matches(r, name)]
        agent = [r for r in self.policy.routed_agent if _matches(r, name)] if self.agent_phase else []
        return task, agent

    def refusal(self, ip: IPAddress) -> tuple[str, str] | None:
        """``(category, why)`` if ``ip`` may never be reached, else None."""
        found = classify_address(ip, local=self.local)
        if found is not None:
            return found
        if isinstance(ip, ipaddress.IPv4Address) and any(ip in n for n in self.host_networks):
            return "own", f"{ip} is on the host's own network"
        return None

    def question(self, msg: Message) -> str | None:
        """Why ``msg`` is refused before anything is asked, or None."""
        if msg.is_response or msg.opcode != 0 or len(msg.questions) != 1:
            return "not one standard query"
        q = msg.questions[0]
        if q.klass != CLASS_IN or q.type in _TRANSFERS:
            return f"query type {q.type} of class {q.klass} is not answered"
        if self.mode == "none":
            return "the episode has no network now"
        reverse = _reverse_address(q.name)
        if reverse is not None and self.refusal(reverse) is not None:
            return f"{q.name!r} is a reverse name of {reverse}, which may not be reached"
        said = special_name(q.name)
        explicit = [r for r in self._rules(q.name)[1] if r.port is not None]
        if said is not None and not explicit:  # the operator's own HOST:PORT (mirror.internal:3141)
            return said
        if self.mode == "allowlist":
            task, agent = self._rules(q.name)
            if not task and not agent:
                return f"{q.name!r} is not an allowed host"
        return None

    def answer(self, question: Question, msg: Message) -> Verdict:
        """What the upstream answer ``msg`` to ``question`` lets through."""
        if msg.rcode != NOERROR:
            return Verdict()
        task, agent = self._rules(question.name)
        explicit = [r for r in agent if r.port is not None]
        grants: list[Grant] = []
        answered = []
        ttls = []
        for record in msg.records:
            ip = record.address
            if ip is None:
                continue
            if record.section == 0:
                answered.append(str(ip))
                ttls.append(record.ttl)
            refused = self.refusal(ip)
            if refused is not None:
                category, why = refused
                if not explicit or category in (NEVER, LOOPBACK):
                    return Verdict(refused=f"{question.name!r} resolves to {why}", addresses=(str(ip),))
        timeout = max(self.min_ttl, min(min(ttls, default=self.min_ttl), self.max_ttl))
        for record in msg.answers:
            ip = record.address
            if not isinstance(ip, ipaddress.IPv4Address) or record.type == AAAA:
                continue  # no IPv6 leaves an episode
            private = self.refusal(ip) is not None
            for rule in explicit:
                grants.append(Grant("agent_ports", ip, rule.port, timeout))
            if private or self.mode != "allowlist":
                continue
            for rule in agent:
                if rule.port is None:
                    grants.append(Grant("agent_any", ip, None, timeout))
            for rule in task:
                grants.append(Grant("task_any" if rule.port is None else "task_ports", ip, rule.port, timeout))
        return Verdict(
            grants=tuple(dict.fromkeys(grants)), ttl_cap=timeout if grants else None, addresses=tuple(answered)
        )
