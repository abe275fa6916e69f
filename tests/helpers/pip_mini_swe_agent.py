"""Harbor's own mini-swe-agent (``harbor.agents.installed.mini_swe_agent.MiniSweAgent``),
installed into the environment by pip from PyPI instead of by uv.

Loaded by Harbor's CLI, in Harbor's venv (``harbor run -a pip_mini_swe_agent:PipMiniSweAgent``
with this folder on ``PYTHONPATH``); never imported by the project's own tests.

Harbor's ``install()`` fetches uv from astral.sh and a Python with ``uv python install``
from GitHub, neither of which a machine that reaches only the package registries can do.
This class replaces that one step: a venv of the environment's own ``python3`` (>= 3.10,
what mini-swe-agent asks, with its ``venv`` module and ensurepip: Debian's python3-venv)
with ``mini-swe-agent`` and the extras Harbor's installer adds (``litellm[mcp]``, orjson,
fastapi) from PyPI (the environment must reach pypi.org and files.pythonhosted.org:
``--allow-agent-host``). Everything else is Harbor's: the run
command, the model name, base URL and API key handling, the trajectory conversion.

What Harbor's ``run()`` needs of the install (its command starts with ``if [ -f
"$HOME/.local/bin/env" ]; then . "$HOME/.local/bin/env"; else export
PATH="$HOME/.local/bin:$PATH"; fi; mini-swe-agent ...``): a ``mini-swe-agent`` command in
``$HOME/.local/bin`` (here a link to the venv's), and no ``$HOME/.local/bin/env`` that
would leave that folder off ``PATH`` (uv's installer writes one; pip does not). Harbor's
version command asks ``uv tool list``: it is replaced by the venv's own record of the
package.
"""

from __future__ import annotations

import shlex

from harbor.agents.installed.mini_swe_agent import MiniSweAgent
from harbor.environments.base import BaseEnvironment

VENV = "$HOME/.local/share/mini-swe-agent-venv"  # (a user-level tool folder, as uv's tools are)


class PipMiniSweAgent(MiniSweAgent):
    """mini-swe-agent from PyPI by pip into a venv of the environment's Python."""

    async def install(self, environment: BaseEnvironment) -> None:
        version_spec = f"=={self._version}" if self._version else ""
        requirement = shlex.quote(f"mini-swe-agent{version_spec}")
        await self.exec_as_agent(
            environment,
            command=(
                "set -euo pipefail; "
                f'python3 -m venv "{VENV}" && '
                f'"{VENV}/bin/python" -m pip install --quiet --disable-pip-version-check '
                f"{requirement} 'litellm[mcp]' orjson fastapi && "
                'mkdir -p "$HOME/.local/bin" && '
                f'ln -sf "{VENV}/bin/mini-swe-agent" "$HOME/.local/bin/mini-swe-agent" && '
                'export PATH="$HOME/.local/bin:$PATH" && '
                "mini-swe-agent --help >/dev/null"
            ),
        )

    def get_version_command(self) -> str | None:
        return f'"{VENV}/bin/python" -m pip show mini-swe-agent 2>/dev/null | sed -n "s/^Version: //p"'
