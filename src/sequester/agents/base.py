"""The agent protocol and the loader that turns a name into an agent."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import traceback
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from sequester.errors import PolicyError

if TYPE_CHECKING:
    from sequester.environments.local.episode import Episode

__all__ = ["Agent", "load_agent"]


@runtime_checkable
class Agent(Protocol):
    """Acts in an episode: runs commands with ``episode.exec``, reads and writes files."""

    @property
    def name(self) -> str: ...  # read-only is enough (a plain attribute is one too)

    def run(self, instruction: str, episode: Episode) -> None: ...


def load_agent(spec: str, kwargs: Mapping[str, Any] | None = None) -> Agent:
    """``oracle``, ``nop``, ``script:PATH`` or ``module:Class``, constructed with ``kwargs``
    (``--agent-kwarg KEY=VALUE``: Harbor's agent kwargs; none for the built-ins).

    ``module`` is imported as ``import module`` would be from the current folder: the
    current folder is put first on ``sys.path`` (as ``python -m`` does) if it is not there.
    Every way a spec can be wrong (no such module, a syntax error in it, an import that
    raises, no such class, a constructor that needs arguments or raises, no ``run``
    method) is a :class:`~sequester.errors.PolicyError` naming the spec.
    """
    from sequester.agents.builtin import NopAgent, OracleAgent, ScriptAgent

    kwargs = dict(kwargs or {})
    if kwargs and (spec in ("oracle", "nop") or spec.startswith("script:")):
        raise PolicyError(f"--agent {spec!r} takes no --agent-kwarg (given: {', '.join(sorted(kwargs))})")
    if spec == "oracle":
        return OracleAgent()
    if spec == "nop":
        return NopAgent()
    if spec.startswith("script:"):
        path = Path(spec[len("script:") :])
        if not path.is_file():
            raise PolicyError(f"--agent {spec!r}: {str(path)!r} is not a file")
        return ScriptAgent(path)
    module_name, sep, class_name = spec.partition(":")
    if not sep or not module_name or not class_name:
        raise PolicyError(f"--agent {spec!r}: expected oracle, nop, script:PATH or module:Class")
    cls = getattr(_import(spec, module_name), class_name, None)
    if cls is None:
        raise PolicyError(f"--agent {spec!r}: module {module_name!r} has no {class_name!r}")
    agent = _construct(spec, cls, kwargs)
    if not callable(getattr(agent, "run", None)):
        raise PolicyError(f"--agent {spec!r}: {class_name} has no run(instruction, episode) method")
    if not getattr(agent, "name", None):
        try:
            agent.name = spec
        except (AttributeError, TypeError):  # slots, a read-only property: the spec is not needed
            pass
    return agent


def current_folder_importable() -> None:
    """Put the current folder first on ``sys.path`` unless it is there (as ``''`` or itself)."""
    cwd = os.getcwd()
    if not any(entry in ("", ".") or _same(entry, cwd) for entry in sys.path):
        sys.path.insert(0, cwd)


def _same(entry: str, cwd: str) -> bool:
    try:
        return os.path.samefile(entry, cwd)
    except OSError:
        return False


def _import(spec: str, module_name: str) -> ModuleType:
    current_folder_importable()
    try:
        return importlib.import_module(module_name)
    except SyntaxError as exc:
        where = f"{exc.filename}:{exc.lineno}" if exc.filename else module_name
        raise PolicyError(f"--agent {spec!r}: {where}: syntax error: {exc.msg}") from None
    except ImportError as exc:
        raise PolicyError(f"--agent {spec!r}: cannot import {module_name!r}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - whatever the module's own code raises
        raise PolicyError(f"--agent {spec!r}: importing {module_name!r} raised {_describe(exc)}") from None


def _construct(spec: str, cls: object, kwargs: dict[str, Any]) -> Any:  # an Agent once load_agent checked it
    if not callable(cls):
        raise PolicyError(f"--agent {spec!r}: {cls!r} is not a class")
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as exc:
        given = f"with {', '.join(sorted(kwargs))}" if kwargs else "without arguments"
        raise PolicyError(
            f"--agent {spec!r}: the agent is constructed {given}, but {getattr(cls, '__name__', cls)}() says: {exc}"
        ) from None
    except ValueError:  # no signature to inspect (a builtin): construct it and see
        pass
    try:
        return cls(**kwargs)
    except Exception as exc:  # noqa: BLE001 - whatever the agent's own code raises
        raise PolicyError(f"--agent {spec!r}: constructing it raised {_describe(exc)}") from None


def _describe(exc: BaseException) -> str:
    """``Type: message`` and where, in the agent's own code, it was raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"
