"""Building a task's image from its ``environment/Dockerfile``: what ``sequester build``
and ``--image-source dockerfile`` (or ``auto`` without a prebuilt image) do before a
task's first episode.

The image is named ``localhost/sequester-build/<task>:latest`` in the store; its build
log (every step's title, ``CACHED`` or its output, and the outcome) goes to the file the
caller names (the job folder keeps one per task). The task's ``[environment]
build_timeout_sec`` bounds the whole build. Builds of one task in one process are
serialised (concurrent trials of a task build it once; the others find it cached).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from sequester.errors import BuildError
from sequester.imagebuild.builder import BuildOptions, BuildResult, StepReport, build_image
from sequester.images.store import ImageStore
from sequester.net.build.network import parse_build_network
from sequester.sandbox.idmap import IdMap, configured_id_map
from sequester.tasks import Task

__all__ = ["build_task", "task_image_name", "has_dockerfile", "BuildLog"]

_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_lock = threading.Lock()
_LOG_LIMIT = 16 << 20  # bytes of step output a build log keeps; beyond, it says so


def task_image_name(task: Task) -> str:
    slug = re.sub(r"[^a-z0-9._-]+", "-", task.name.lower()).strip("-._") or "task"
    return f"localhost/sequester-build/{slug[:100]}:latest"


def has_dockerfile(task: Task) -> bool:
    return (task.environment_dir / "Dockerfile").is_file()


class BuildLog:
    """A :class:`~.builder.BuildReporter` writing a build log (bounded) and telling an
    optional ``on_step`` callback (the CLI's progress) about each step. The file is made
    at the first line written: a build that never started (its base image cannot be had,
    and ``auto`` goes on to host mode) leaves none."""

    def __init__(self, path: Path | None, on_step: Callable[[StepReport, bool], None] | None = None, header: str = ""):
        self.path, self.on_step, self.header = path, on_step, header
        self.out: IO[bytes] | None = None
        self.written = 0

    def _write(self, data: bytes) -> None:
        if self.path is None:
            return
        if self.out is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.out = open(self.path, "ab")
            self.out.write(self.header.encode())
        if self.written + len(data) > _LOG_LIMIT:
            if self.written <= _LOG_LIMIT:
                self.out.write(b"\n[sequester: the build log is cut here: more than 16 MiB of output]\n")
                self.written = _LOG_LIMIT + 1
            return
        self.out.write(data)
        self.written += len(data)

    def close(self) -> None:
        if self.out is not None:
            self.out.close()
            self.out = None

    def step(self, report: StepReport, done: bool) -> None:
        if not done:
            self._write(f"#{report.number} {report.title()}\n".encode())
        elif report.cached:
            self._write(f"#{report.number} {report.title()}\n#{report.number} CACHED\n".encode())
        else:
            self._write(f"#{report.number} DONE {report.seconds:.1f}s\n".encode())
        if self.on_step is not None:
            self.on_step(report, done)

    def output(self, data: bytes) -> None:
        self._write(data)

    def line(self, text: str) -> None:
        self._write(text.encode() + b"\n")


def build_task(
    task: Task,
    store: ImageStore,
    *,
    runner: Path | None,
    network: str = "public",
    allowed_hosts: tuple[str, ...] = (),
    no_cache: bool = False,
    log_path: Path | None = None,
    on_step: Callable[[StepReport, bool], None] | None = None,
    ids: IdMap | None = None,
) -> BuildResult:
    """Build ``task``'s Dockerfile into ``store``; :class:`BuildError` if a step fails or
    the build outlives the task's ``build_timeout_sec``."""
    dockerfile = task.environment_dir / "Dockerfile"
    if not dockerfile.is_file():
        raise BuildError(f"task {task.name}: {dockerfile} does not exist; there is nothing to build")
    options = BuildOptions(
        no_cache=no_cache,
        network=parse_build_network(network, allowed_hosts),
        timeout=task.config.environment.build_timeout_sec,
        ids=ids,
    )
    key = (str(store.root), str(dockerfile))
    with _locks_lock:
        lock = _locks.setdefault(key, threading.Lock())
    with lock:
        header = f"# sequester build {task.name}: {dockerfile} ({time.strftime('%Y-%m-%dT%H:%M:%S')})\n"
        reporter = BuildLog(log_path, on_step, header)
        try:
            try:
                result = build_image(
                    store,
                    dockerfile,
                    task.environment_dir,
                    name=task_image_name(task),
                    options=options,
                    runner=runner,
                    reporter=reporter,
                )
            except BuildError as exc:
                reporter.line(f"# failed: {exc}")
                raise
            reporter.line(
                f"# built {result.record.id} in {result.seconds:.2f} s "
                f"({sum(not s.cached for s in result.steps)} of {len(result.steps)} steps ran)"
            )
            return result
        finally:
            reporter.close()


# A failed build is not tried again for a while (a job's trials of the task all get its
# error at once), but not forever: a long-running server outlives a mirror's bad minute.
_FAILURE_TTL = 120.0
_failed: dict[tuple[str, str, int], tuple[float, str]] = {}


def ensure_built(
    task: Task,
    store: ImageStore,
    settings,
    *,
    log_path: Path | None = None,
    on_step: Callable[[StepReport, bool], None] | None = None,
):
    """The image of ``task``'s Dockerfile, built (or found in the build cache) with the
    ``[images]`` build network of ``settings`` (an :class:`~sequester.environments.settings.EpisodeSettings`).
    A build that failed is not tried again by this process for two minutes while the
    Dockerfile is unchanged: every trial of the task gets the same :class:`BuildError`."""
    from sequester.verifier.tree import runner_tree

    dockerfile = task.environment_dir / "Dockerfile"
    try:
        key = (str(store.root), str(dockerfile), dockerfile.stat().st_mtime_ns)
    except OSError:
        raise BuildError(f"task {task.name}: {dockerfile} does not exist; there is nothing to build") from None
    with _locks_lock:
        when, earlier = _failed.get(key, (0.0, ""))
    if earlier and time.monotonic() - when < _FAILURE_TTL:
        raise BuildError(earlier)
    images = settings.images
    try:
        return build_task(
            task,
            store,
            runner=runner_tree(settings.toolchain_dir),
            network=images.build_network,
            allowed_hosts=images.build_allowed_hosts,
            log_path=log_path,
            on_step=on_step,
            ids=configured_id_map(settings.id_range),
        ).record
    except BuildError as exc:
        with _locks_lock:
            _failed[key] = (time.monotonic(), str(exc))
        raise
