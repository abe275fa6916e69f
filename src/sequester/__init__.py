"""sequester: run model-written programs so they see only what a policy allows.

The public surface is this module's ``__all__``; everything else is internal. Names are
loaded lazily, so the kernel process (which imports ``sequester.kernel.server``) does not
pay for the host-side machinery.
"""

from __future__ import annotations

# Not ``typing``: the kernel imports this package at every start, and ``typing`` (with
# ``re``, ``collections``, ...) costs milliseconds there. Annotations are strings anyway.
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any

__all__ = [
    "Capabilities",
    "CellError",
    "CellResult",
    "Endpoint",
    "Environment",
    "Episode",
    "EpisodeSettings",
    "ExecResult",
    "Isolation",
    "Kernel",
    "KernelClosedError",
    "KernelError",
    "Limits",
    "Policy",
    "PolicyError",
    "SandboxError",
    "SandboxUnavailableError",
    "SequesterError",
    "Task",
    "TaskError",
    "VerifierError",
    "VerifierResult",
    "find_tasks",
    "load_agent",
    "load_policy",
    "load_task",
    "open_environment",
    "parse_endpoint",
]
__version__ = "0.1.0"

_WHERE = {
    "Capabilities": "sequester.environments.base",
    "Environment": "sequester.environments.base",
    "open_environment": "sequester.environments",
    "CellError": "sequester.kernel.results",
    "CellResult": "sequester.kernel.results",
    "Kernel": "sequester.kernel.client",
    "Endpoint": "sequester.policy",
    "Isolation": "sequester.policy",
    "Limits": "sequester.policy",
    "Policy": "sequester.policy",
    "load_policy": "sequester.config",
    "parse_endpoint": "sequester.policy",
    "KernelClosedError": "sequester.errors",
    "KernelError": "sequester.errors",
    "PolicyError": "sequester.errors",
    "SandboxError": "sequester.errors",
    "SandboxUnavailableError": "sequester.errors",
    "SequesterError": "sequester.errors",
    "TaskError": "sequester.errors",
    "Episode": "sequester.environments.local.episode",
    "ExecResult": "sequester.environments.base",
    "EpisodeSettings": "sequester.environments.settings",
    "VerifierError": "sequester.environments.verdict",
    "VerifierResult": "sequester.environments.verdict",
    "Task": "sequester.tasks",
    "find_tasks": "sequester.tasks",
    "load_task": "sequester.tasks",
    "load_agent": "sequester.agents",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        from importlib import import_module

        value = getattr(import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'sequester' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # pragma: no cover
    from sequester.agents import load_agent
    from sequester.config import load_policy
    from sequester.environments import Capabilities, Environment, open_environment
    from sequester.environments.base import ExecResult
    from sequester.environments.local.episode import Episode
    from sequester.environments.settings import EpisodeSettings
    from sequester.environments.verdict import VerifierError, VerifierResult
    from sequester.errors import (
        KernelClosedError,
        KernelError,
        PolicyError,
        SandboxError,
        SandboxUnavailableError,
        SequesterError,
        TaskError,
    )
    from sequester.kernel.client import Kernel
    from sequester.kernel.results import CellError, CellResult
    from sequester.policy import Endpoint, Isolation, Limits, Policy, parse_endpoint
    from sequester.tasks import Task, find_tasks, load_task
