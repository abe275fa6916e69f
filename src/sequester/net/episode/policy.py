"""What an episode's network may reach: the task's policy, narrowed by the operator; pure.

A task asks (``task.toml``): ``public`` (``allow_internet = true``, Harbor's default),
``allowlist`` (``allowed_hosts``, schema 1.4) or ``no-network``. The operator decides for
the whole run (``--network`` / ``[episodes] network``):

* ``task``: the task's own policy;
* ``allowlist``: no task gets more than an allowlist: a public task gets an empty one (only
  the operator's hosts, below), an allowlist task keeps its list;
* ``none``: no task gets anything of its own.

and adds hosts for the **agent's phase only** (``--allow-host`` / ``[episodes]
allowed_hosts``: an agent's model API, a loopback model mock, a local package mirror), in
every mode: an episode whose own network is ``none`` then gets an allowlist of just those.
The verifier never gets them.

Never reachable, whatever a task says: the host itself (loopback, its own addresses), link
local and cloud metadata, the private ranges, and the other special ranges of
:data:`sequester.net.addresses.RANGES`. Only the *operator* can open one, and only as
``HOST:PORT``: ``localhost:8080`` (relayed to the host's loopback), ``10.1.2.3:3141`` or
``mirror.internal:3141`` (a name the DNS responder then lets resolve there). A task's own
``allowed_hosts`` cannot: a task from elsewhere must not point the agent at the operator's
network.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sequester.errors import PolicyError
from sequester.net.addresses import LOOPBACK, NEVER, RANGES, HostRule, parse_host_rule

__all__ = [
    "MODES",
    "RUN_NETWORKS",
    "EpisodePolicy",
    "episode_policy",
    "parse_operator_hosts",
    "parse_run_network",
]

MODES = ("none", "public", "allowlist")  # an episode's network (task.toml's "no-network" is "none")
RUN_NETWORKS = ("task", "none", "allowlist")  # what the operator lets tasks have (--network)
_TASK_MODES = {"public": "public", "allowlist": "allowlist", "no-network": "none"}


@dataclass(frozen=True)
class EpisodePolicy:
    """An episode's network, decided: ``mode`` for the verifier and the agent, ``agent``
    hosts on top for the agent's phase. ``allowed``: the task's own entries (allowlist
    mode). ``task_mode`` and ``run_network`` say where it came from (for the record)."""

    mode: str = "none"
    allowed: tuple[HostRule, ...] = ()
    agent: tuple[HostRule, ...] = ()
    task_mode: str = "no-network"
    run_network: str = "task"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise PolicyError(f"network mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.run_network not in RUN_NETWORKS:
            raise PolicyError(f"--network: {self.run_network!r} is not one of {', '.join(RUN_NETWORKS)}")

    @property
    def agent_mode(self) -> str:
        """The mode during the agent's phase: ``none`` with hosts of the operator's is an
        allowlist of those."""
        return "allowlist" if self.mode == "none" and self.agent else self.mode

    @property
    def has_network(self) -> bool:
        """Whether the episode needs a network at all (else it pays nothing for one): an
        allowlist with no entry is no network."""
        return self.agent_mode == "public" or (self.agent_mode == "allowlist" and bool(self.allowed or self.agent))

    @property
    def relayed(self) -> tuple[HostRule, ...]:
        """The operator's loopback ``HOST:PORT`` entries: relayed to the host's own loopback."""
        return tuple(r for r in self.agent if r.names_loopback)

    @property
    def routed_agent(self) -> tuple[HostRule, ...]:
        """The operator's other entries, which go through the episode's router."""
        return tuple(r for r in self.agent if not r.names_loopback)

    def notes(self) -> list[str]:
        """What of the task's policy cannot be had, said once (entries a task cannot open)."""
        said = []
        for rule in self.allowed:
            if rule.network is not None and never_reachable(rule) is not None:
                said.append(
                    f"the task's allowed_hosts entry {rule} is {never_reachable(rule)}: never reachable "
                    "from an episode (only the operator's --allow-host HOST:PORT can open such an address)"
                )
        return said

    @property
    def decided_by(self) -> str:
        """Who decided the episode's mode: ``task`` (its own), or the operator's ``--network``
        when it narrowed the task's."""
        return "task" if self.mode == _TASK_MODES[self.task_mode] else f"operator (--network {self.run_network})"

    def to_record(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "decided_by": self.decided_by,
            "agent_mode": self.agent_mode,
            "task_network_mode": self.task_mode,
            "run_network": self.run_network,
            "allowed_hosts": [str(r) for r in self.allowed],
            "agent_hosts": [str(r) for r in self.agent],
        }


def never_reachable(rule: HostRule) -> str | None:
    """What a literal address or network of ``rule`` is, if it lies in a refused range."""
    if rule.network is None:
        return None
    for refused, _category, what in RANGES:
        if refused.version == rule.network.version and rule.network.subnet_of(refused):  # type: ignore[arg-type]
            return what
    return None


def parse_run_network(value: object, *, field: str = "episodes.network") -> str:
    if not isinstance(value, str) or value.strip().lower() not in RUN_NETWORKS:
        raise PolicyError(f"{field}: {value!r} is not one of {', '.join(RUN_NETWORKS)}")
    return value.strip().lower()


def parse_operator_hosts(hosts: Iterable[str], *, field: str = "episodes.allowed_hosts") -> tuple[HostRule, ...]:
    """The operator's hosts, checked: a loopback, private, link-local or host address is
    allowed only as ``HOST:PORT`` (a port of one service, never the whole address), and an
    address that nothing can reach (multicast, 0/8) not at all."""
    if isinstance(hosts, str):  # a lone string would be split into characters
        hosts = [hosts]
    rules = []
    for i, text in enumerate(hosts):
        rule = parse_host_rule(text, field=f"{field}[{i}]")
        if rule.network is not None:
            for refused, category, what in RANGES:
                if refused.version != rule.network.version or not rule.network.subnet_of(refused):  # type: ignore[arg-type]
                    continue
                if category == NEVER:
                    raise PolicyError(f"{field}[{i}]: {text!r} is {what}: never reachable")
                if rule.port is None:
                    raise PolicyError(
                        f"{field}[{i}]: {text!r} is {what}: reachable only as HOST:PORT (one service, "
                        "e.g. 10.1.2.3:3141), never the whole address"
                    )
                if category == LOOPBACK and rule.network.num_addresses != 1:
                    raise PolicyError(f"{field}[{i}]: {text!r}: loopback only as one address and port")
        if rule.names_loopback and rule.port is None:
            raise PolicyError(f"{field}[{i}]: {text!r} is the host's loopback: reachable only as HOST:PORT")
        if rule.names_loopback and rule.name is not None and rule.name != "localhost":
            raise PolicyError(f"{field}[{i}]: {text!r}: name the loopback as localhost:PORT or 127.0.0.1:PORT")
        rules.append(rule)
    return tuple(dict.fromkeys(rules))


def episode_policy(
    task_mode: str,
    task_hosts: Iterable[str] = (),
    *,
    run_network: str = "task",
    agent_hosts: Iterable[HostRule] = (),
) -> EpisodePolicy:
    """The episode's policy from task.toml's ``network_mode`` (``public``, ``allowlist``,
    ``no-network``) and ``allowed_hosts``, narrowed by ``run_network``, with the operator's
    ``agent_hosts`` (already parsed: :func:`parse_operator_hosts`) for the agent's phase."""
    if task_mode not in _TASK_MODES:
        raise PolicyError(f"network_mode {task_mode!r} is not one of {', '.join(_TASK_MODES)}")
    run_network = parse_run_network(run_network, field="--network")
    mode = _TASK_MODES[task_mode]
    if run_network == "none":
        mode = "none"
    elif run_network == "allowlist" and mode == "public":
        mode = "allowlist"
    allowed: tuple[HostRule, ...] = ()
    if mode == "allowlist" and task_mode == "allowlist":
        allowed = tuple(
            dict.fromkeys(
                parse_host_rule(h, field=f"[environment] allowed_hosts[{i}]") for i, h in enumerate(task_hosts)
            )
        )
    return EpisodePolicy(mode, allowed, tuple(agent_hosts), task_mode, run_network)
