"""Agents for the cluster tests (``--agent ray_agents:Name``), run by the nodes' workers.

They talk to the test through files in ``$SEQ_RAY_TEST_ROOT/control`` (the test cluster's
own folder, set on every node by ``ray_cluster.start_cluster``): the agent runs in a Ray
worker on the same machine, the test reads and writes the same folder.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from sequester.agents import OracleAgent


def control() -> Path:
    folder = Path(os.environ["SEQ_RAY_TEST_ROOT"]) / "control"
    folder.mkdir(exist_ok=True)
    return folder


class DiesOnce(OracleAgent):
    """The first attempt of each task writes its worker's pid and waits to be killed
    (``<task>.pid``); a later attempt (the pid file is there) is the oracle."""

    def __init__(self) -> None:
        super().__init__(name="dies-once")

    def run(self, instruction, episode):
        pid_file = control() / f"{episode.task.name}.pid"
        if not pid_file.exists():
            # An episode with a process running when the worker dies (the test looks for it).
            episode.exec("sleep 4321.3 > /dev/null 2>&1 &")
            pid_file.write_text(str(os.getpid()))
            time.sleep(120)  # the test kills this worker long before
        super().run(instruction, episode)


class Sleeper:
    """Runs a long command with a marker the test looks for in /proc (``sleep 4321.7``)."""

    name = "sleeper"

    def run(self, instruction, episode):
        episode.exec("sleep 4321.7 & sleep 4321.7", timeout=600)


class Stubborn:
    """Starts a marked command in the background, then waits in Python, where an abort
    cannot reach it: only killing its worker ends the trial."""

    name = "stubborn"

    def run(self, instruction, episode):
        episode.exec("sleep 4321.9 > /dev/null 2>&1 &")
        (control() / f"{episode.task.name}.stubborn").write_text(str(os.getpid()))
        time.sleep(600)
