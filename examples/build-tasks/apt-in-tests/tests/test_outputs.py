import subprocess
from pathlib import Path

# A script the tests write and run, installing a tool of its own (as git-multibranch's does).
CHECK = """#!/bin/bash
set -e
DEBIAN_FRONTEND=noninteractive apt-get install -y dc
dc -e '6 7 * p'
"""


def test_answer_is_what_bc_computes():
    expected = subprocess.run(["bc"], input="6*7\n", capture_output=True, text=True, check=True).stdout.strip()
    assert Path("/app/answer.txt").read_text().strip() == expected


def test_answer_is_what_dc_computes(tmp_path):
    script = tmp_path / "check.sh"
    script.write_text(CHECK)
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=True).stdout
    assert Path("/app/answer.txt").read_text().strip() == out.strip().splitlines()[-1]
