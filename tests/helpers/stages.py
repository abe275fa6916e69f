"""Choosing how a kernel is started in tests: through the native first stage
(kernel/stage0.c) in a view template's child ("template", the default), through the
native stage in a bwrap sandbox of its own ("native"), or through Python's first stage."""

from __future__ import annotations

import os

import pytest

from sequester import Kernel, Policy
from sequester.kernel.stage0 import stage0_program

STAGES = ["template", "native", "python"]
# What Kernel.report says of each: (first_stage, view).
REPORTED = {"template": ("native", "template"), "native": ("native", "bwrap"), "python": ("python", "bwrap")}


def native_available() -> bool:
    return stage0_program() is not None


def stage_env(stage: str) -> dict[str, str]:
    """The environment variables that select ``stage``."""
    return {"SEQUESTER_NATIVE_STAGE": "0" if stage == "python" else "1",
            "SEQUESTER_VIEW_TEMPLATE": "1" if stage == "template" else "0"}


def use_stage(monkeypatch, stage: str) -> None:
    """Kernels started from now on in this test go through ``stage`` (skips if the native
    stage cannot be built here)."""
    if stage != "python" and not native_available():
        pytest.skip("the native stage cannot be built here")
    for name, value in stage_env(stage).items():
        monkeypatch.setenv(name, value)


def set_stage(stage: str) -> None:
    """:func:`use_stage` for code without a monkeypatch (a harness's own process)."""
    os.environ.update(stage_env(stage))


def run_here(code: str, policy: Policy | None = None) -> dict:
    """``code`` in a fresh kernel of this process: its stage, value, error, stdout."""
    with Kernel(policy or Policy()) as k:
        r = k.run(code, timeout=30)
        return {"stage": k.report["first_stage"], "view": k.report.get("view"), "value": r.value, "stdout": r.stdout,
                "error": None if r.error is None else {"type": r.error.type, "message": r.error.message}}


def checked(out: dict, stage: str) -> object:
    """The value of a probe's result (:func:`run_here`'s, or a harness's of the same form)
    run through ``stage``: skips where that flow does not use the native stage here."""
    if stage != "python" and out["stage"] != "native":
        pytest.skip("the native stage is not used in this flow here")
    assert (out["stage"], out["view"]) == REPORTED[stage]
    assert out["error"] is None, out["error"]
    return eval(out["value"])  # noqa: S307 - the tests' own probe's repr
