"""sequester inside Harbor: an environment and a verifier Harbor loads by import path.

    harbor run -p TASKS -a oracle -e sequester.harbor:SequesterEnvironment \\
        --verifier sequester.harbor:SequesterVerifier

Needs Harbor (``pip install 'sequester[harbor]'``, Python >= 3.12). The classes load
lazily: :mod:`.plan` (pure, no Harbor) imports without it. See docs/harbor.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SequesterEnvironment", "SequesterVerifier"]


def __getattr__(name: str) -> Any:
    if name == "SequesterEnvironment":
        from sequester.harbor.environment import SequesterEnvironment

        return SequesterEnvironment
    if name == "SequesterVerifier":
        from sequester.harbor.verifier import SequesterVerifier

        return SequesterVerifier
    raise AttributeError(f"module 'sequester.harbor' has no attribute {name!r}")
