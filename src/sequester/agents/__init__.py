"""Agents: what acts in an episode between ``reset`` and ``evaluate``.

An agent is any object with ``run(instruction: str, episode: Episode) -> None``
(:class:`Agent`). Built in: ``oracle`` (runs the task's own solution), ``nop`` (does
nothing), ``script:PATH`` (a file's content as one command). Any other agent is named
``module:Class`` and loaded with :func:`load_agent`.
"""

from sequester.agents.base import Agent, load_agent
from sequester.agents.builtin import NopAgent, OracleAgent, ScriptAgent

__all__ = ["Agent", "NopAgent", "OracleAgent", "ScriptAgent", "load_agent"]
