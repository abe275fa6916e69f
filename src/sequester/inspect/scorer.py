"""``task_verdict()``: an Inspect scorer whose score is sequester's verdict on the sample's
episode: the task's pristine tests, out of the agent's reach (as ``sequester run`` scores).

A 0 the agent caused is 0 with its reason as the explanation; a verifier that could not
run (the task's own set-up failed) raises, so Inspect records the sample's error, never a
0. The score's metadata hold sequester's notes and the tampering found.
"""

from __future__ import annotations

from typing import Any

from inspect_ai.scorer import Score, Target, accuracy, mean, scorer
from inspect_ai.solver import TaskState
from inspect_ai.util import sandbox

__all__ = ["task_verdict"]


@scorer(metrics=[mean(), accuracy()])
def task_verdict(name: str = "reward") -> Any:
    """Score with sequester's verdict (``name``: which of the task's rewards is the value)."""
    from sequester.inspect.sandbox import SequesterSandbox

    async def score(state: TaskState, target: Target) -> Score:
        env = sandbox().as_type(SequesterSandbox)
        found = await env.evaluate()
        value = float(found.rewards.get(name, 0.0))
        explanation = found.zero_reason or ("the task's tests passed" if value > 0 else "the task's tests failed")
        return Score(
            value=value,
            explanation=explanation,
            metadata={"rewards": dict(found.rewards), "notes": list(found.notes), "tampering": list(found.tampering)},
        )

    return score
