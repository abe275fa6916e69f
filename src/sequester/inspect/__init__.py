"""sequester as an Inspect sandbox: ``sandbox=("sequester", TASK_DIR)`` and the
``task_verdict()`` scorer.

Inspect (``pip install 'sequester[inspect]'``) finds the sandbox through the ``inspect_ai``
entry point group (:mod:`.registry`); nothing needs importing. The names here load lazily,
so this package imports without Inspect. See docs/inspect.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SequesterSandbox", "task_verdict"]


def __getattr__(name: str) -> Any:
    if name == "SequesterSandbox":
        from sequester.inspect.sandbox import SequesterSandbox

        return SequesterSandbox
    if name == "task_verdict":
        from sequester.inspect.scorer import task_verdict

        return task_verdict
    raise AttributeError(f"module 'sequester.inspect' has no attribute {name!r}")
