"""What a Harbor call becomes in an episode, as plain data. Pure (no Harbor needed).

* :func:`exec_command`: the shell line of one ``exec(command, cwd, env, user)``;
* :func:`network_for`: sequester's ``network`` and operator hosts for Harbor's policies of
  the environment and of the agent's phase;
* :func:`harbor_operator_hosts`: which of Harbor's hosts an episode can open as they are.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable

from sequester.errors import PolicyError
from sequester.net.addresses import HostRule, parse_host_rule
from sequester.net.episode.policy import parse_operator_hosts
from sequester.tasks import Task

__all__ = ["exec_command", "harbor_operator_hosts", "network_for"]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def exec_command(command: str, *, cwd: str, env: dict[str, str] | None, user: str | int | None) -> str:
    """The line the episode's shell runs for one Harbor ``exec``: a subshell (nothing of it
    stays in the shell) that enters ``cwd``, sets ``env`` and runs ``bash -c command`` as
    ``user`` (root: as it is; a name: ``runuser``; a number: ``setpriv``), as ``docker
    exec -w CWD -e K=V -u USER CONTAINER bash -c COMMAND`` does."""
    # (a relative folder as a path: `cd -` would be the shell's OLDPWD)
    parts = [f"cd {shlex.quote(cwd if cwd.startswith('/') else './' + cwd)} || exit 127"]
    if env:
        for key in env:
            if not _NAME.fullmatch(key):  # (bash takes only these: "é" would be dropped unsaid)
                raise ValueError(f"env: {key!r} is not a variable name")
        parts.append("export " + " ".join(shlex.quote(f"{k}={v}") for k, v in env.items()))
    run = f"bash -c {shlex.quote(command)}"
    if user is None or str(user) in ("root", "0"):
        run = f"exec {run}"
    elif isinstance(user, int) or str(user).isdigit():
        run = f"exec setpriv --reuid={int(user)} --regid={int(user)} --clear-groups -- {run}"
    else:
        run = f"exec runuser -u {shlex.quote(str(user))} -- {run}"
    parts.append(run)
    return "( " + "; ".join(parts) + " )"


def network_for(
    mode: str, hosts: list[str], task: Task, asked: str | None, agent_hosts: Iterable[str] = ()
) -> tuple[str | None, list[str]]:
    """sequester's ``network`` (None: the settings') and the operator hosts for Harbor's
    policy of the environment (``mode``: ``no-network``, ``allowlist``, ``public``; its
    ``hosts``) and the hosts its policy of the agent's phase allows (``agent_hosts``).

    The environment's: none is none; an allowlist is the task's own allowlist plus, as
    operator hosts (the agent's phase only), the hosts beyond it, or on a task that
    declares none, an allowlist of just those; public is the task's own network. The
    agent's phase's hosts beyond those (``--allow-agent-host``, the model's API Harbor
    infers for an installed agent) are operator hosts too: the agent has them from the
    start, for its installation as well (sequester's agent phase is everything before the
    tests). ``asked`` (the ``network`` option) narrows it further: ``none`` keeps none of
    Harbor's hosts."""
    own = set(task.config.environment.allowed_hosts)
    network: str | None
    extra: list[str]
    if asked == "none" or mode == "no-network":
        network, extra = "none", []
    elif mode == "allowlist":
        extra = [h for h in hosts if h not in own]
        network = "task" if task.config.environment.network_mode == "allowlist" else "allowlist"
    else:
        network, extra = asked, []
    if asked != "none":
        extra += [h for h in agent_hosts if h not in own and h not in hosts]
    return network, list(dict.fromkeys(extra))


def harbor_operator_hosts(hosts: Iterable[str], allow_hosts: Iterable[str]) -> tuple[list[str], list[str]]:
    """The ``hosts`` of Harbor's policies an episode can open as they are, and a note for
    each it leaves out. Harbor names a host without a port (the model's base URL
    ``http://localhost:8080/v1`` becomes ``localhost``), and the host's loopback or a
    private address is reachable only as ``HOST:PORT`` (:func:`parse_operator_hosts`):
    such a host is left out, silently when an ``allow_hosts`` entry (the operator's
    option, already checked) names it with its port, else with a note saying how to open
    it."""
    named = [parse_host_rule(h) for h in allow_hosts]
    kept, notes = [], []
    for host in hosts:
        try:
            parse_operator_hosts([host], field="-")
        except PolicyError as exc:
            why = str(exc).split(": ", 1)[-1]  # (past the field's name: "'localhost' is the host's loopback: ...")
            try:
                rule: HostRule | None = parse_host_rule(host)
            except PolicyError:
                rule = None
            if rule is None or not any(_same_host(rule, other) for other in named):
                how = " (to open one service of it, name that HOST:PORT in --ek allow_hosts)" * ("HOST:PORT" in why)
                notes.append(f"Harbor's allowlist: {why}; left out of the agent's phase{how}")
            continue
        kept.append(host)
    return kept, notes


def _same_host(rule: HostRule, other: HostRule) -> bool:
    if rule.names_loopback and other.names_loopback:
        return True
    return (rule.name, rule.network) == (other.name, other.network)
