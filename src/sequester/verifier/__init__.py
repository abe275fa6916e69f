"""The verifier's runner: a read-only tree of trusted programs that run a task's tests,
and the environment they run with. See :mod:`.tree` for what it holds and why."""

from sequester.verifier.layout import RUNNER_MOUNT
from sequester.verifier.tree import PINNED, ensure_runner, runner_tree

__all__ = ["RUNNER_MOUNT", "PINNED", "ensure_runner", "runner_tree"]
