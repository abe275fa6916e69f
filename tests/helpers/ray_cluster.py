"""A real two-node Ray cluster on loopback for the tests: ``ray start --head`` plus a
second node (its own raylet, object store and workers), token authentication on, every
folder private to the test session, and every process of it killed at the end (by the
session folder in its command line: ``ray stop`` would stop every Ray of this user).

The nodes' workers import the tests' helper modules (``PYTHONPATH``), so a test's agent
class (``ray_agents:...``) runs on them as a user's would; ``$SEQ_RAY_TEST_ROOT`` names
the cluster's folder on every node (the agents' control files go below it).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from procs import pid_alive

HELPERS = Path(__file__).resolve().parent
RAY = Path(sys.executable).with_name("ray")


@dataclass
class RayCluster:
    address: str
    root: Path  # the session folder every process of the cluster names
    env: dict[str, str]  # what a driver process (a `sequester run` subprocess) needs to join it
    node_ids: list[str] = field(default_factory=list)

    def processes(self) -> list[int]:
        """Pids of every process of the cluster (raylets, workers, GCS, ...) and their
        descendants (Ray's agents rename themselves, so the folder is not in their
        command line)."""
        found, children = set(), {}
        marker = str(self.root).encode()
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker in f.read():
                        found.add(int(entry))
                with open(f"/proc/{entry}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
        queue = list(found)
        while queue:
            for child in children.get(queue.pop(), ()):
                if child not in found:
                    found.add(child)
                    queue.append(child)
        return sorted(found)

    def worker_pids(self) -> list[int]:
        """Ray's worker processes (where tasks and actors run)."""
        pids = []
        for pid in self.processes():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"default_worker.py" in f.read():
                        pids.append(pid)
            except OSError:
                continue
        return pids


def _ray(args: list[str], env: dict[str, str]) -> None:
    subprocess.run([str(RAY), *args], env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                   timeout=120)


def start_cluster(cpus_per_node: int = 1, nodes: int = 2) -> RayCluster:
    """Start the cluster (about 10 s); :func:`stop_cluster` ends it."""
    # Short: Ray's socket paths live below it (a unix socket path has at most 107 bytes).
    root = Path(tempfile.mkdtemp(prefix="sqr", dir="/tmp"))
    # Ray reads the token's settings when it is first imported: the session's (set by
    # tests/conftest.py before any test imports Ray), else one of this cluster's own.
    token = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or root / "token")
    if not token.exists():
        token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
           "RAY_USAGE_STATS_ENABLED": "0", "SEQ_RAY_TEST_ROOT": str(root), "PYTHONPATH": os.pathsep.join(
               [str(HELPERS), *filter(None, [os.environ.get("PYTHONPATH")])])}
    port = 20000 + secrets.randbelow(20000)
    common = ["--temp-dir", str(root / "t"), "--num-cpus", str(cpus_per_node), "--disable-usage-stats",
              "--node-ip-address", "127.0.0.1"]
    cluster = RayCluster(f"127.0.0.1:{port}", root, {k: env[k] for k in (
        "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_USAGE_STATS_ENABLED", "SEQ_RAY_TEST_ROOT")})
    try:
        _ray(["start", "--head", "--port", str(port), "--include-dashboard=false", *common], env)
        for _ in range(nodes - 1):
            _ray(["start", "--address", cluster.address, *common], env)
    except BaseException:
        stop_cluster(cluster)
        raise
    return cluster


def stop_cluster(cluster: RayCluster) -> None:
    pids = set(cluster.processes())  # the whole tree first: orphans leave it once a parent dies
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids |= set(cluster.processes())
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (5 if sig == signal.SIGTERM else 10)
        while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
    shutil.rmtree(cluster.root, ignore_errors=True)


def join(cluster: RayCluster):
    """This process, joined as a driver (``ray.init``); returns the ``ray`` module."""
    os.environ.update(cluster.env)  # (before Ray reads its authentication settings)
    import ray

    if not ray.is_initialized():
        ray.init(address=cluster.address, log_to_driver=False, namespace="sequester")
    cluster.node_ids = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    return ray


@contextmanager
def running(cpus_per_node: int = 1, nodes: int = 2) -> Iterator[RayCluster]:
    """A started cluster this process has joined; shut down and stopped on leaving."""
    cluster = start_cluster(cpus_per_node, nodes)
    try:
        join(cluster)
        yield cluster
    finally:
        import ray

        ray.shutdown()
        stop_cluster(cluster)
