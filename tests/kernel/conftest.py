"""Fixtures of the kernel tests: the ordinary-user flow of a kernel."""

from __future__ import annotations

import json
import os

import pytest
from nobody_site import NOBODY, SYSTEM_PYTHON, nobody_site
from stages import run_here, set_stage, stage_env

from sequester.kernel.stage0 import stage0_program

ROOT = os.geteuid() == 0

# The harness run as nobody on a world-readable copy of sequester (a root test run).
USER_FLOW_HARNESS = r'''
import json, os, sys
request = json.load(sys.stdin)
os.environ["SEQUESTER_NATIVE_STAGE"] = "0" if request["stage"] == "python" else "1"
os.environ["SEQUESTER_VIEW_TEMPLATE"] = "1" if request["stage"] == "template" else "0"
from sequester import Kernel, Policy
from sequester.kernel.stage0 import stage0_program
program = stage0_program()
with Kernel(Policy()) as k:
    code = request["code"].replace("@PROGRAM@", str(program))
    r = k.run(code, timeout=30)
    print(json.dumps({"stage": k.report["first_stage"], "view": k.report.get("view"), "value": r.value, "stdout": r.stdout, "uid": os.getuid(),
                      "error": None if r.error is None else {"type": r.error.type, "message": r.error.message}}))
'''


@pytest.fixture(scope="module")
def user_flow():
    """Runs ``code`` (``@PROGRAM@``: the caller's native-stage program) in a kernel of an
    ordinary caller, through ``stage``; the harness's JSON."""
    if not ROOT:
        def here(code: str, stage: str) -> dict:
            set_stage(stage)
            try:
                return run_here(code.replace("@PROGRAM@", str(stage0_program())))
            finally:
                for name in stage_env(stage):
                    os.environ.pop(name, None)
        yield here
        return
    if not SYSTEM_PYTHON.exists():
        pytest.skip("as root the user flow runs on /usr/bin/python3, which is missing")
    with nobody_site() as run:
        def as_nobody(code: str, stage: str) -> dict:
            proc = run(USER_FLOW_HARNESS, json.dumps({"code": code, "stage": stage}))
            assert proc.returncode == 0, proc.stderr[-3000:]
            out = json.loads(proc.stdout.strip().splitlines()[-1])
            assert out["uid"] == NOBODY
            return out

        yield as_nobody
