"""What a Harbor call becomes in an episode, as plain data. Pure (no Harbor needed).

* :func:`exec_command`: the shell line of one ``exec(command, cwd, env, user)``;
* :func:`network_for`: sequester's ``network`` and operator hosts for Harbor's policy of
  the agent's phase.
"""

from __future__ import annotations

import re
import shlex

from sequester.tasks import Task

__all__ = ["exec_command", "network_for"]

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


def network_for(mode: str, hosts: list[str], task: Task, asked: str | None) -> tuple[str | None, list[str]]:
    """sequester's ``network`` (None: the settings') and the operator hosts for Harbor's
    policy of the agent's phase (``mode``: ``no-network``, ``allowlist``, ``public``):
    none is none; an allowlist is the task's own allowlist plus, as operator hosts (the
    agent's phase only), the hosts beyond it (a model's API Harbor adds), or on a task that
    declares none, an allowlist of just those; public is the task's own network. ``asked``
    (the ``network`` option) narrows it further."""
    if mode == "no-network":
        return "none", []
    if mode == "allowlist":
        own = set(task.config.environment.allowed_hosts)
        extra = [h for h in hosts if h not in own]
        if asked == "none":
            return "none", []
        return ("task" if task.config.environment.network_mode == "allowlist" else "allowlist"), extra
    return asked, []
