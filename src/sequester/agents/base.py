"""The agent protocol and the loader that turns a name into an agent."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ..errors import PolicyError

if TYPE_CHECKING:
    from ..episodes.episode import Episode

__all__ = ["Agent", "load_agent"]


@runtime_checkable
class Agent(Protocol):
    """Acts in an episode: runs commands with ``episode.exec``, reads and writes files."""

    name: str

    def run(self, instruction: str, episode: Episode) -> None: ...


def load_agent(spec: str) -> Agent:
    """``oracle``, ``nop``, ``script:PATH`` or ``module:Class`` (constructed without arguments)."""
    from .builtin import NopAgent, OracleAgent, ScriptAgent

    if spec == "oracle":
        return OracleAgent()
    if spec == "nop":
        return NopAgent()
    if spec.startswith("script:"):
        path = Path(spec[len("script:"):])
        if not path.is_file():
            raise PolicyError(f"--agent {spec!r}: {str(path)!r} is not a file")
        return ScriptAgent(path)
    module_name, sep, class_name = spec.partition(":")
    if not sep or not module_name or not class_name:
        raise PolicyError(f"--agent {spec!r}: expected oracle, nop, script:PATH or module:Class")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise PolicyError(f"--agent {spec!r}: cannot load it: {exc}") from None
    agent = cls()
    if not callable(getattr(agent, "run", None)):
        raise PolicyError(f"--agent {spec!r}: {class_name} has no run(instruction, episode) method")
    if not getattr(agent, "name", None):
        agent.name = spec
    return agent
