"""What the agent leaves in ``/logs/agent`` and ``/logs/artifacts`` is kept in the trial's
``agent/`` and ``artifacts/`` folders, as Harbor keeps them, never over the trial's own files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from paths import EXAMPLES

SCRIPT = """
echo 'from the agent' > /logs/agent/notes.txt
mkdir -p /logs/artifacts/out && echo 42 > /logs/artifacts/out/answer
echo forged > /logs/agent/commands.jsonl
mkdir -p /logs/agent/command-0 && echo forged > /logs/agent/command-0/stdout.txt
ln -s /etc/shadow /logs/agent/shadow
"""


def test_the_agents_logs_and_artifacts_are_kept_with_the_trial(tmp_path: Path):
    script = tmp_path / "agent.sh"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, "-m", "sequester.cli", "run", str(EXAMPLES / "c-word-count"), "--agent",
                        f"script:{script}", "-o", str(tmp_path / "jobs"), "--job-name", "j"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (trial,) = [p for p in (tmp_path / "jobs" / "j").iterdir() if p.is_dir()]
    assert (trial / "agent" / "notes.txt").read_text() == "from the agent\n"
    assert (trial / "artifacts" / "out" / "answer").read_text() == "42\n"
    commands = [json.loads(line) for line in (trial / "agent" / "commands.jsonl").read_text().splitlines()]
    assert len(commands) == 1 and "forged" not in (trial / "agent" / "command-0" / "stdout.txt").read_text()
    assert not (trial / "agent" / "shadow").exists() and not (trial / "agent" / "shadow").is_symlink()
    notes = json.loads((trial / "result.json").read_text())["notes"]
    assert any(n.startswith("/logs/agent: not kept:") and "commands.jsonl" in n and "shadow" in n for n in notes), notes
