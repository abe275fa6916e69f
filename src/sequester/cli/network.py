"""``--network task|none|allowlist`` and ``--allow-host HOST[:PORT]``: the run's network,
the same flags on ``sequester run`` and ``sequester serve``, over ``[episodes] network /
allowed_hosts`` (see :mod:`sequester.net.episode.policy`). ``sequester build`` spells its
own hosts the same way (``--allow-host``, for its allowlist)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from sequester.environments.settings import EpisodeSettings
from sequester.net.episode.policy import RUN_NETWORKS, parse_operator_hosts, parse_run_network

__all__ = ["add_network_arguments", "apply_network_arguments"]


def add_network_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--network",
        metavar="|".join(RUN_NETWORKS),
        help="what every episode's network may be: task (each task's own: public, allowlist or none), "
        "allowlist (a public task gets only the hosts of --allow-host) or none; never the host, its "
        "loopback, private, link-local or metadata addresses (default: [episodes] network, task)",
    )
    p.add_argument(
        "--allow-host",
        action="append",
        default=None,
        metavar="HOST[:PORT]",
        help="a host the agent's phase may reach whatever the task says (a model API; a loopback mock or "
        "a private mirror only as HOST:PORT); never the verifier's (repeatable; default: [episodes] "
        "allowed_hosts)",
    )


def apply_network_arguments(args: argparse.Namespace, settings: EpisodeSettings) -> EpisodeSettings:
    """``settings`` with the flags' values; a bad value raises
    :class:`~sequester.errors.PolicyError` naming the flag (exit status 2)."""
    changes: dict[str, Any] = {}
    if args.network is not None:
        changes["network"] = parse_run_network(args.network, field="--network")
    if args.allow_host is not None:
        parse_operator_hosts(args.allow_host, field="--allow-host")
        changes["allowed_hosts"] = tuple(args.allow_host)
    return dataclasses.replace(settings, **changes) if changes else settings
