"""Choosing a kernel's first stage in tests: the native one (kernel/stage0.c) or Python's."""

from __future__ import annotations

import pytest

from sequester import Kernel, Policy
from sequester.kernel.stage0 import stage0_program

STAGES = ["native", "python"]


def native_available() -> bool:
    return stage0_program() is not None


def use_stage(monkeypatch, stage: str) -> None:
    """Kernels started from now on in this test go through ``stage`` (skips if the native
    stage cannot be built here)."""
    if stage == "native" and not native_available():
        pytest.skip("the native stage cannot be built here")
    monkeypatch.setenv("SEQUESTER_NATIVE_STAGE", "1" if stage == "native" else "0")


def run_here(code: str, policy: Policy | None = None) -> dict:
    """``code`` in a fresh kernel of this process: its stage, value, error, stdout."""
    with Kernel(policy or Policy()) as k:
        r = k.run(code, timeout=30)
        return {"stage": k.report["first_stage"], "value": r.value, "stdout": r.stdout,
                "error": None if r.error is None else {"type": r.error.type, "message": r.error.message}}
