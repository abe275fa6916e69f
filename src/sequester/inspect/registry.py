"""What Inspect loads through the ``inspect_ai`` entry point group: registering the
``sequester`` sandbox and the scorer with Inspect's registry."""

from __future__ import annotations

from sequester.inspect.sandbox import SequesterSandbox
from sequester.inspect.scorer import task_verdict

__all__ = ["SequesterSandbox", "task_verdict"]
