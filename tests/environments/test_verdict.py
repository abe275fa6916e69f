"""The verdict (:mod:`sequester.environments.verdict`, pure): the note a frozen evaluation
gets."""

from __future__ import annotations

from sequester.environments.verdict import FROZEN_TIMEOUT_NOTE, FROZEN_ZERO_NOTE, frozen_evaluation_note


def test_frozen_evaluation_note():
    """A frozen agent's service cannot answer; a timeout or a 0 then says why."""
    assert frozen_evaluation_note("cgroup", timed_out=True) == FROZEN_TIMEOUT_NOTE
    assert frozen_evaluation_note("SIGSTOP", timed_out=False, reward=0.0) == FROZEN_ZERO_NOTE
    assert "freeze_agent = false" in FROZEN_TIMEOUT_NOTE and "live service" in FROZEN_TIMEOUT_NOTE
    assert frozen_evaluation_note("cgroup", timed_out=False, reward=1.0) is None
    assert frozen_evaluation_note(None, timed_out=True) is None  # not frozen: the usual timeout
