""":class:`DockerEnvironment`: an episode in a container of a Docker-API engine (Docker,
or podman serving the Docker API), behind :class:`sequester.environments.base.Environment`.

    env = DockerEnvironment(base_url="unix:///run/podman/podman.sock")
    env.start("examples/tasks/python-csv-stats")
    env.exec("python3 -c 'print(1)'")
    result = env.evaluate()
    env.close()

The one place that orders the steps: :mod:`.engine` (connect, label, reap), :mod:`.container`
(image, limits, network), :mod:`.exec` (one bounded, host-timed command), :mod:`.files`
(archives in and out), :mod:`.ops` (one container's calls, its processes seen from here),
:mod:`.verify` (scoring). Unlike the local backend, each exec is a
fresh ``sh -c`` in the task's working directory: ``cd`` and ``export`` do not persist.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sequester.environments import verdict
from sequester.environments.archive import DIR_LIMIT, reroot
from sequester.environments.base import (
    Capabilities,
    ExecResult,
    UnsupportedByBackend,
    missing_capabilities,
    timed_task,
    wanted_verifier_env,
    wants_freeze,
)
from sequester.environments.docker import files
from sequester.environments.docker.container import (
    ImageChoice,
    check_gpus,
    container_workdir,
    create_container,
    network_for,
    remove_container,
    resolve_image,
)
from sequester.environments.docker.engine import EngineError, connect, reap_once
from sequester.environments.docker.exec import run_exec
from sequester.environments.docker.ops import ContainerHandle, kill_from_host
from sequester.environments.docker.verify import NOT_WIPED, evaluate_separate, evaluate_shared, wipe_staged
from sequester.environments.settings import EpisodeSettings
from sequester.environments.verdict import Evaluation, frozen_evaluation_note, zero_result
from sequester.errors import EpisodeError, SandboxError
from sequester.sandbox.freeze import SignalFreezer
from sequester.tasks import Task, load_task

__all__ = ["DockerEnvironment", "CAPABILITIES"]

CAPABILITIES = Capabilities(
    backend="docker",
    separate_verifier=True,
    shared_verifier=True,
    freeze=True,
    trusted_runner=False,
    network_policies=frozenset({"none", "public"}),
    # Nothing the agent touched runs the verdict, unless the task or the
    # settings ask for the agent's own container (live services).
    default_verifier_env="separate",
    gpus=None,  # requested of the engine (`--gpus N`), and counted in the container once it runs
)
_READ_LIMIT = 64 << 20


@dataclass
class _Run:
    task: Task
    image: ImageChoice
    container: Any
    ops: ContainerHandle
    workdir: str
    deadline: float | None
    notes: list[str] = field(default_factory=list)
    staged: bool = False  # the tests of a shared evaluation are still in the agent's container


class DockerEnvironment:
    """One agent's episode on one task in a Docker-API engine's container (see the
    module). Not thread-safe; :meth:`abort` may be called from any thread."""

    def __init__(
        self,
        settings: EpisodeSettings | None = None,
        *,
        base_url: str | None = None,
        image: str | None = None,
        build: bool = False,
        hide: Iterable[str | os.PathLike[str]] = (),
    ):
        """``base_url``: the engine (else ``$DOCKER_HOST``, else the default socket);
        ``image``: run on this image instead of task.toml's ``docker_image``; ``build``:
        build the task's ``environment/Dockerfile`` on the engine. ``hide`` is accepted
        for the interface: a container shows nothing of the host's files to hide."""
        self.settings = settings or EpisodeSettings()
        self._base_url, self._image, self._build = base_url, image, build
        self.extra_hidden = tuple(hide)
        self._client: Any = None
        self._run: _Run | None = None
        self._closed = False
        self._network_record: dict[str, Any] = {}
        self._aborted = threading.Event()

    @property
    def capabilities(self) -> Capabilities:
        return CAPABILITIES

    # -- properties --------------------------------------------------------------------

    def _for_agent(self) -> _Run:
        """The run, with the tests a shared evaluation left in the container wiped first
        (fail closed: if that does not take, the container is killed and nothing the
        agent asks for runs). Why they may be left until now: see :meth:`evaluate`."""
        run = self._running()
        if run.staged:
            run.staged = False
            if not wipe_staged(run.ops):
                run.notes.append(NOT_WIPED)
        return run

    def _running(self) -> _Run:
        if self._aborted.is_set():
            raise EpisodeError("the episode was aborted")
        if self._run is None:
            raise EpisodeError(
                "the episode is closed" if self._closed else "the episode is not running: call start(task) first"
            )
        return self._run

    @property
    def task(self) -> Task:
        return self._running().task

    @property
    def instruction(self) -> str:
        return self._running().task.instruction

    @property
    def workdir(self) -> str:
        return self._running().workdir

    @property
    def notes(self) -> list[str]:
        return list(self._running().notes)

    @property
    def container(self) -> Any:
        """The agent's container (an SDK object: diagnostics, tests)."""
        return self._running().container

    @property
    def network(self) -> dict[str, Any] | None:
        """The episode's network for the trial's record (its mode, what decided it, and
        what the engine's network guarantees); no traffic is counted in docker mode."""
        return dict(self._network_record) if self._network_record else None

    @property
    def system(self) -> dict[str, object]:
        run = self._running()
        return {"mode": "docker", "image": run.image.reference, "id": run.image.id, "container": run.container.id}

    # -- lifecycle ----------------------------------------------------------------------

    def start(self, task: Task | str | os.PathLike[str]) -> DockerEnvironment:
        """Start on ``task`` in a new container, replacing any earlier one."""
        if self._closed:
            raise EpisodeError("the episode is closed")
        self._stop()
        task = timed_task(task if isinstance(task, Task) else load_task(task), self.settings)
        missing = missing_capabilities(CAPABILITIES, task, self.settings)
        if missing:  # (Compose services): before anything is made
            raise UnsupportedByBackend("; ".join(missing))
        # before anything is made: an unsupported network refuses the task
        network, self._network_record = network_for(task, self.settings)
        if self._client is None:
            self._client = connect(self._base_url)
            reap_once(self._client, self._client.api.base_url)
        choice = resolve_image(self._client, task, self._image, self._build)
        workdir = container_workdir(task, choice)
        container = create_container(
            self._client, choice.id, task, self.settings, role="agent", workdir=workdir, network=network
        )
        if task.config.environment.gpus:
            check_gpus(container, task, self._count_gpus(container))
        ops = ContainerHandle(self._client, container, self.settings.output_bytes, remove_on_discard=False)
        limit = task.config.agent.timeout_sec
        run = _Run(task, choice, container, ops, workdir, time.monotonic() + limit if limit else None)
        run.notes.append("each exec runs in a fresh sh in the working directory (cd and exports do not persist)")
        if self._network_record.get("mode") == "public":
            run.notes.append(f"network: {self._network_record['guarantee']}")
            if self.settings.allowed_hosts:
                run.notes.append("--allow-host: the docker backend's public network reaches those hosts and the rest")
        if task.config.environment.storage_mb is not None:
            run.notes.append("[environment] storage_mb is not enforced by the docker backend")
        if task.config.environment.gpus and task.config.environment.gpu_types:
            run.notes.append(
                f"[environment] gpu_types = {list(task.config.environment.gpu_types)} not checked: "
                "the engine chose the GPUs"
            )
        if ops.namespace is None:
            run.notes.append(
                "the engine's processes are not visible from this host: a timed-out command is "
                "killed from inside its container"
            )
        self._run = run
        return self

    def exec(self, command: str, timeout: float | None = None) -> ExecResult:
        """Run ``command`` with ``/bin/sh -c`` in the working directory; ``timeout``
        (default: the settings' ``exec_timeout``) is enforced from the host."""
        run = self._for_agent()
        limit = self.settings.exec_timeout if timeout is None else timeout
        if limit <= 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        if run.deadline is not None:
            left = run.deadline - time.monotonic()
            if left <= 0:
                return ExecResult("", "", None, True, 0.0, "the episode's agent time ([agent] timeout_sec) is over")
            limit = min(limit, left)
        try:
            raw = run_exec(
                self._client,
                run.container.id,
                ["/bin/sh", "-c", command],
                timeout=limit,
                output_bytes=self.settings.output_bytes,
                workdir=run.workdir,
                namespace=run.ops.namespace,
            )
        except EngineError as exc:
            if self._aborted.is_set():
                raise EpisodeError("the episode was aborted") from None
            if not self._engine_answers():  # the engine's failure: the trial's error
                raise EpisodeError(f"the command could not be run: {exc}") from exc
            if not self._is_running(run):  # the agent ended its container's init: its doing
                return ExecResult(
                    "", "", None, False, 0.0, "the agent's container is no longer running, so the command did not run"
                )
            # The engine answers and the container runs, yet this exec failed (seen: every
            # process slot taken by a fork bomb, the exec session lost): the container's
            # state did it, which is the agent's, never a trial error.
            return ExecResult(
                "", "", None, False, 0.0, f"the engine could not run the command in the agent's container ({exc})"
            )
        return ExecResult(
            raw.stdout.decode(errors="replace"),
            raw.stderr.decode(errors="replace"),
            raw.exit_code,
            raw.timed_out,
            raw.duration,
            "; ".join(raw.notes),
        )

    def _count_gpus(self, container: Any) -> int | None:
        """How many ``/dev/nvidia<N>`` the container has (None: it could not be asked)."""
        try:
            raw = run_exec(
                self._client,
                container.id,
                ["/bin/sh", "-c", 'for d in /dev/nvidia[0-9]*; do [ -e "$d" ] && echo "$d"; done'],
                timeout=30,
                output_bytes=65536,
            )
        except EngineError:
            return None
        return len(raw.stdout.split()) if raw.exit_code is not None else None

    def _engine_answers(self) -> bool:
        try:
            self._client.ping()
        except Exception:  # noqa: BLE001 - any failure: it does not
            return False
        return True

    def _is_running(self, run: _Run) -> bool:
        try:
            run.container.reload()
        except Exception:  # noqa: BLE001 - removed, or the engine is gone: not running
            return False
        return bool((run.container.attrs.get("State") or {}).get("Running"))

    def write_file(self, path: str, content: bytes | str, mode: int = 0o644) -> None:
        """Write a file in the agent's container (as its root), making parent folders."""
        data = content.encode() if isinstance(content, str) else content
        files.write_file(self._for_agent().container, self._absolute(path), data, mode)

    def read_file(self, path: str) -> bytes:
        return files.read_file(self._for_agent().container, self._absolute(path), _READ_LIMIT)

    def upload_dir(self, source: str | os.PathLike[str], dest: str) -> None:
        """Copy a host folder into the agent's container at ``dest`` (the oracle's solution)."""
        files.upload_dir(self._for_agent().container, source, self._absolute(dest))

    def read_dir(self, path: str, limit: int = DIR_LIMIT) -> bytes:
        """A tar of the folder ``path`` of the agent's container (names relative to it)."""
        where = self._absolute(path)
        try:
            got = files.get_tar(self._for_agent().container, where, limit)
        except files.TooLarge as exc:
            raise EpisodeError(f"{where}: {exc}") from exc
        go_dir = 1 << 31  # the engine's stat is Go's FileMode: ModeDir is its top bit
        if got is None or not int(got[1].get("mode", 0)) & go_dir:
            raise EpisodeError(f"{where}: no such folder")
        return reroot(got[0], posixpath.basename(where.rstrip("/")))

    def _absolute(self, path: str) -> str:
        return path if path.startswith("/") else f"{self.workdir.rstrip('/')}/{path}"

    # -- evaluation --------------------------------------------------------------------

    def _start_verifier(self) -> ContainerHandle:
        run = self._running()
        container = create_container(
            self._client,
            run.image.id,
            run.task,
            self.settings,
            role="verifier",
            workdir=run.workdir,
            network=network_for(run.task, self.settings)[0],
        )
        return ContainerHandle(self._client, container, self.settings.output_bytes, remove_on_discard=True)

    def evaluate(self, *, freeze: bool | None = None, verifier_env: str | None = None) -> verdict.VerifierResult:
        """The task's pristine tests, scored (see :mod:`.verify`): in a fresh container of
        the same image holding the task's artifacts (``separate``), or in the agent's
        (``shared``). ``freeze``: the agent's container is paused (separate), or each of
        its processes stopped (shared: the tests run beside them), until the verdict is in.
        Agent-caused failures are a 0 with ``zero_reason``; :class:`VerifierCouldNotRun`
        only for the engine's."""
        run = self._for_agent()
        task = run.task
        mode = wanted_verifier_env(task, self.settings, verifier_env, default=CAPABILITIES.default_verifier_env)
        wanted = wants_freeze(task, self.settings, freeze)
        common: dict[str, Any] = {
            "workdir": run.workdir,
            "output_limit": self.settings.output_bytes,
            "reward_range": self.settings.reward_range,
        }
        if mode == "shared" and not self._is_running(run):
            return zero_result(
                Evaluation({}, b"", (), 0.0),
                "the agent's container is no longer running (its init was ended), so the tests could not run in it",
                tampering=(),
                frozen=None,
                notes=(),
            )
        if wanted and mode == "shared" and run.ops.namespace is None:
            raise UnsupportedByBackend(
                "freezing the agent for a shared verifier needs the engine's processes "
                "visible from this host (the engine runs elsewhere)"
            )
        frozen, stopped, paused = None, None, False
        if wanted:  # first: nothing of the evaluation happens while an agent process runs
            if mode == "separate":
                try:
                    run.container.pause()
                    paused, frozen = True, "pause"
                except Exception as exc:  # noqa: BLE001 - e.g. the agent ended its container: nothing runs
                    if self._is_running(run):
                        raise verdict.VerifierCouldNotRun(f"the agent's container could not be paused: {exc}") from exc
            else:
                assert run.ops.init_pid is not None
                stopped = SignalFreezer(run.ops.init_pid)
                outcome = stopped.freeze()
                frozen = "sigstop" if outcome.held else outcome.method
        try:
            if mode == "separate":
                scored = evaluate_separate(run.ops, self._start_verifier, task, frozen=frozen, **common)
            else:
                # Unfrozen, the agent's processes ran beside the tests and could read them
                # all along; wiping them before its next call (or never, when the trial
                # closes the container next) shows them nothing more, and saves an exec.
                # Frozen, they never saw them: wiped before they resume.
                scored = evaluate_shared(
                    run.ops,
                    task,
                    frozen=frozen,
                    start_verifier=self._start_verifier,
                    wipe_after=stopped is not None,
                    **common,
                )
                run.staged = scored.staged
        finally:
            if paused:
                try:
                    run.container.unpause()
                except Exception as exc:  # noqa: BLE001 - the verdict stands; the next exec says what broke
                    run.notes.append(f"the agent's container could not be unpaused: {exc}")
            if stopped is not None:
                stopped.remove()
        if not scored.clean:
            run.notes.append("the agent's container was killed after scoring (the tests could not be removed)")
        result = scored.result
        said = frozen_evaluation_note(
            frozen, timed_out=bool(result.zero_reason and "ran over" in result.zero_reason), reward=result.reward
        )
        return dataclasses.replace(result, notes=(*result.notes, said)) if said else result

    # -- teardown ------------------------------------------------------------------------

    def _stop(self) -> None:
        run, self._run = self._run, None
        if run is None:
            return
        kill_from_host(run.ops)
        try:
            remove_container(run.container)
        except EngineError as exc:
            raise SandboxError(f"the agent's container {run.container.name} was not removed: {exc}") from exc

    def abort(self) -> None:
        """From any thread: kill the agent's container now (a command in flight ends at
        once). Every later use raises :class:`EpisodeError`; :meth:`close` still removes it."""
        self._aborted.set()
        run = self._run
        if run is not None:
            try:
                run.container.kill()
            except Exception:  # noqa: BLE001,S110 - already dead, or going: close removes it
                pass

    def close(self) -> None:
        """Remove the agent's container (after errors too). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop()

    def __enter__(self) -> DockerEnvironment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
