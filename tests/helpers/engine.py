"""A Docker-API engine of the tests' own: podman serving the Docker API on a private socket,
with storage of its own (nothing of the machine's podman or Docker is touched).

    from engine import engine, module_engine, import_rootfs   # fixtures + helper

``engine`` lives for one test, ``module_engine`` for a test module (an engine start and
an image import cost seconds). Both skip unless podman and runc are installed and the
tests run as root (a private podman service as an ordinary user needs a user namespace
set-up this suite does not make).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from procs import pids_with_cmdline as host_pids_of  # noqa: F401 - the docker tests' name for it
from registry import skip_unless_tools

__all__ = ["Engine", "running_engine", "engine", "module_engine", "import_rootfs", "skip_unless_engine",
           "host_pids_of"]

# exit_command_delay: podman keeps each exec's conmon this long after the exec ended (300 s
# by default), then runs a cleanup against the storage; shorter, fewer linger (see _end_leftovers).
CONTAINERS_CONF = """[containers]
default_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]
[engine]
runtime = "runc"
exit_command_delay = 20
"""


@dataclass(frozen=True)
class Engine:
    """A running podman API service: ``podman`` (argv prefix reaching its storage),
    ``host`` (a DOCKER_HOST URL), ``env`` (the environment podman must run with)."""

    podman: list[str]
    host: str
    env: dict[str, str]

    def __iter__(self):  # (podman, host, env), as the older fixture yielded
        return iter((self.podman, self.host, self.env))

    def run(self, *args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
        return subprocess.run([*self.podman, *args], env=self.env, capture_output=True, timeout=timeout, **kw)


def skip_unless_engine(*tools: str) -> None:
    """Skip the calling test or fixture unless a private podman service can run here."""
    skip_unless_tools("podman", "runc", *tools)
    if os.geteuid() != 0:
        pytest.skip("a podman service of the test's own is run as root here (CI runs as root)")


def _end_leftovers(runroot: Path) -> None:
    """Kill what podman left running for this engine: each exec's conmon, which waits out
    ``exit_command_delay`` and then runs ``podman container cleanup`` on this engine's
    storage -- re-creating it after the teardown removed it. Each is found by the
    engine's private run folder in its arguments and killed by its pid."""
    needle = str(runroot).encode() + b"\0"
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                found = needle in f.read()
        except OSError:
            continue
        if found:
            with contextlib.suppress(OSError):
                os.kill(int(name), signal.SIGKILL)


def _unmount_below(top: Path) -> None:
    """Detach every mount at or below ``top``, deepest first: podman's overlay driver
    bind-mounts its ``overlay`` folder onto itself and ``system reset`` leaves it, which
    would keep the storage from being removed (and pytest's temporary folders with it)."""
    prefix = str(top.resolve())
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for point in sorted({p for p in points if p == prefix or p.startswith(prefix + "/")}, key=len, reverse=True):
        subprocess.run(["umount", "--lazy", point], capture_output=True, timeout=60)


@contextlib.contextmanager
def running_engine(base: Path) -> Iterator[Engine]:
    """A podman API service whose configuration and storage live under ``base``; on exit
    it is stopped and every container and image of its storage removed."""
    conf = base / "containers.conf"
    conf.write_text(CONTAINERS_CONF)
    runroot = Path(tempfile.mkdtemp(prefix="pd-", dir="/tmp"))  # podman wants it under 50 characters
    # overlay: a container of a 260 MB image starts in 0.3 s (vfs copies the image: 4 s).
    podman = ["podman", "--root", str(base / "storage"), "--runroot", str(runroot), "--storage-driver", "overlay"]
    env = {**os.environ, "CONTAINERS_CONF": str(conf)}
    socket = base / "podman.sock"
    service = subprocess.Popen([*podman, "system", "service", "--time=0", f"unix://{socket}"], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while not socket.exists():
            if service.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"podman's API service did not start: {service.stderr.read().decode()[-2000:]}")
            time.sleep(0.05)
        yield Engine(podman, f"unix://{socket}", env)
    finally:
        service.terminate()
        try:
            service.wait(10)
        except subprocess.TimeoutExpired:
            service.kill()
            service.wait()
        subprocess.run([*podman, "system", "reset", "--force"], env=env, capture_output=True, timeout=120)
        _end_leftovers(runroot)
        _unmount_below(base / "storage")
        shutil.rmtree(runroot, ignore_errors=True)
        shutil.rmtree(base / "storage", ignore_errors=True)


@pytest.fixture
def engine(tmp_path) -> Iterator[Engine]:
    """A podman API service for one test (see the module)."""
    skip_unless_engine()
    with running_engine(tmp_path) as running:
        yield running


@pytest.fixture(scope="module")
def module_engine(tmp_path_factory) -> Iterator[Engine]:
    """A podman API service shared by a test module's tests (see the module)."""
    skip_unless_engine()
    with running_engine(tmp_path_factory.mktemp("engine")) as running:
        yield running


def import_rootfs(eng: Engine, rootfs: Path, name: str, *, exclude: Sequence[str] = (),
                  changes: Sequence[str] = ()) -> str:
    """``podman import`` of a root filesystem folder as image ``name`` (its reference);
    ``exclude``: paths (``./usr/bin/timeout``) left out of it, ``changes``: Dockerfile
    instructions (``WORKDIR /app``) applied to its configuration."""
    tar = subprocess.Popen(["tar", "-C", str(rootfs), *(f"--exclude={p}" for p in exclude), "-c", "."],
                           stdout=subprocess.PIPE)
    args = [a for change in changes for a in ("--change", change)]
    try:
        done = subprocess.run([*eng.podman, "import", *args, "-", name], env=eng.env, stdin=tar.stdout,
                              capture_output=True, timeout=300)
    finally:
        assert tar.stdout is not None
        tar.stdout.close()
        tar.wait()
    if done.returncode != 0 or tar.returncode != 0:
        pytest.fail(f"podman import of {rootfs} failed: {done.stderr.decode()[-2000:]}")
    return name
