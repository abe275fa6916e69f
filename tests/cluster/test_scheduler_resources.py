"""What a trial asks of the cluster (:mod:`sequester.cluster.scheduler`), without a cluster:
its resources come from the task, and a task no node can hold is known before it is sent."""

from __future__ import annotations

from pathlib import Path

from paths import EXAMPLES

from sequester.cluster.scheduler import infeasible, trial_resources
from sequester.tasks import load_task


def test_resources_and_feasibility_come_from_the_task(tmp_path: Path) -> None:
    task = load_task(EXAMPLES / "python-csv-stats")
    need = trial_resources(task)
    assert need["num_cpus"] == task.config.environment.cpus
    big = {"num_cpus": 4.0, "memory": 8192.0 * (1 << 20)}
    nodes = [{"CPU": 2.0, "memory": 16e9}, {"CPU": 8.0, "memory": 4e9}]
    assert "4 CPUs and 8192 MB" in infeasible(big, nodes) and "largest: 8 CPUs" in infeasible(big, nodes)
    assert infeasible(big, [*nodes, {"CPU": 4.0, "memory": 9e9}]) is None
    assert infeasible({"num_cpus": 1.0}, []) is not None, "no node at all"
