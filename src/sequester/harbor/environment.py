"""Harbor's ``BaseEnvironment`` over a sequester episode: ``harbor run -e sequester.harbor:SequesterEnvironment``.

Harbor makes one per trial (``environment_dir`` is the task's ``environment/`` folder) and
drives it with async calls; each is one call of the episode's (:class:`~sequester.environments.Environment`)
in a worker thread, one at a time (an episode is not shared between threads):

* ``start``: the task's system as ``sequester run`` has it (its prebuilt image, its
  Dockerfile built without a daemon, or the host, by ``[images] source``; or the docker
  backend's engine), the episode started on it, its calibration looked up;
* ``exec(command, cwd, env, timeout_sec, user)``: ``bash -c command`` in a fresh process
  of the episode (as ``docker exec`` runs it: its own working directory and variables,
  nothing of an earlier call's kept), as ``user`` (``runuser``/``setpriv`` of the image);
  past ``timeout_sec`` the command is ended and ``RuntimeError`` raised, as Harbor's Docker
  environment does;
* files go in and out through the namespace helper (``upload_*``, ``download_*``): what
  comes out is unpacked with tarfile's ``data`` filter, bounded
  (:mod:`sequester.environments.archive`);
* the agent's time is Harbor's to keep (its timeouts and multipliers): the episode gets no
  deadline of its own.

Options (``--ek KEY=VALUE``): ``config`` (a sequester config file; default: the embedded
one), ``backend`` (``local`` or ``docker``), ``image_source``, ``network`` (``task``,
``allowlist``, ``none``), ``allow_hosts`` (operator hosts for the agent's phase, e.g. a
loopback model API ``localhost:8080``), ``calibration`` (``auto``, ``required``, ``off``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any, Literal

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities
from harbor.environments.options import EnvironmentOptions
from harbor.models.task.config import NetworkMode, NetworkPolicy
from pydantic import Field

from sequester.environments import Environment, missing_capabilities, open_environment
from sequester.environments.archive import unpack
from sequester.environments.settings import EpisodeSettings
from sequester.environments.verdict import VerifierResult
from sequester.errors import SequesterError, TaskNotCalibrated
from sequester.harbor.plan import exec_command, harbor_operator_hosts, network_for
from sequester.net.episode.policy import parse_operator_hosts
from sequester.tasks import Task, load_task

__all__ = ["SequesterEnvironment", "SequesterOptions"]

_NO_LIMIT = 7 * 24 * 3600.0  # Harbor's "no timeout": bounded only by what Harbor itself keeps


class SequesterOptions(EnvironmentOptions):
    """What ``--ek`` may set (anything else is Harbor's "Unknown option" error)."""

    config: str | None = Field(default=None, description="A sequester config file (default: the embedded one).")
    backend: Literal["local", "docker"] | None = Field(default=None, description="What runs the episode.")
    image_source: Literal["auto", "prebuilt", "dockerfile", "host"] | None = Field(
        default=None, description="Where the task's system comes from ([images] source)."
    )
    network: Literal["task", "allowlist", "none"] | None = Field(
        default=None, description="The episode's network, narrowed from the task's (sequester's --network)."
    )
    allow_hosts: list[str] = Field(
        default_factory=list, description="Operator hosts (HOST[:PORT]) for the agent's phase only."
    )
    calibration: Literal["auto", "required", "off"] = Field(
        default="auto", description="Consult this machine's calibration records (sequester calibrate)."
    )


class SequesterEnvironment(BaseEnvironment):
    """A Harbor environment whose container is a sequester episode (see the module)."""

    options_model = SequesterOptions
    options: SequesterOptions

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._episode: Environment | None = None
        self._lock = asyncio.Lock()
        self.calibration: dict[str, Any] | None = None
        super().__init__(*args, **kwargs)
        self._task = self._load()
        self._settings = self._episode_settings()

    @staticmethod
    def type() -> str:
        return "sequester"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(
            disable_internet=True,
            network_allowlist=True,
            network_allowlist_hostnames=True,
            network_allowlist_ipv4_addresses=True,
            dynamic_network_policy=True,
        )

    # -- the task and the settings ----------------------------------------------------

    def _validate_definition(self) -> None:
        task_dir = Path(self.environment_dir).parent
        if not (task_dir / "task.toml").is_file():
            raise FileNotFoundError(f"{task_dir}: no task.toml (sequester runs Harbor / Terminal-Bench tasks)")

    def _load(self) -> Task:
        task = load_task(Path(self.environment_dir).parent)
        # The agent's time is Harbor's (its timeouts and multipliers): no deadline of the episode's.
        agent = dataclasses.replace(task.config.agent, timeout_sec=None)
        return dataclasses.replace(task, config=dataclasses.replace(task.config, agent=agent))

    def _episode_settings(self) -> EpisodeSettings:
        from sequester.config import load_config

        opts = self.options
        settings = load_config(opts.config).episodes
        changes: dict[str, Any] = {}
        if opts.backend:
            changes["backend"] = opts.backend
        if opts.image_source:
            changes["images"] = dataclasses.replace(settings.images, source=opts.image_source)
        parse_operator_hosts(opts.allow_hosts, field="allow_hosts")  # (a bad one: named, before anything starts)
        policy = self._network_policy
        network, hosts = network_for(
            policy.network_mode.value, list(policy.allowed_hosts), self._task, opts.network, self._agent_phase_hosts()
        )
        if network:
            changes["network"] = network
        hosts, notes = harbor_operator_hosts(hosts, opts.allow_hosts)
        for note in notes:
            self.logger.warning(note)
        extra = tuple(dict.fromkeys([*settings.allowed_hosts, *hosts, *opts.allow_hosts]))
        if extra != settings.allowed_hosts:
            changes["allowed_hosts"] = extra
        return dataclasses.replace(settings, **changes)

    def _agent_phase_hosts(self) -> list[str]:
        """The hosts of Harbor's policy for the agent's phase (``--allow-agent-host``, the
        model's API it infers for an installed agent). Harbor hands the environment its
        startup policy (``network_policy``) and the phases' it will set later
        (``phase_network_policies``: the agent's first, for a shared verifier the
        verifier's next, per step); an episode's network is decided at its start, so the
        first agent phase's hosts are taken then. (A separate verifier's environment gets
        only the verifier's phase: its hosts would be operator hosts, withdrawn while the
        tests run, where nothing else runs.)"""
        phases = getattr(self, "_phase_network_policies", None) or []
        if not phases or phases[0].network_mode != NetworkMode.ALLOWLIST:
            return []
        return list(phases[0].allowed_hosts)

    @property
    def episode(self) -> Environment:
        """The running episode (started by :meth:`start`)."""
        if self._episode is None:
            raise RuntimeError("the sequester environment has not been started")
        return self._episode

    @property
    def task(self) -> Task:
        return self._task

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self, force_build: bool) -> None:
        async with self._lock:
            self._episode = await asyncio.to_thread(self._start, force_build)

    def _start(self, force_build: bool) -> Environment:
        episode = open_environment(self._settings)
        missing = missing_capabilities(episode.capabilities, self._task, self._settings)
        if missing:
            raise SequesterError("; ".join(missing))
        if self._settings.backend == "local":
            from sequester.jobs.images import choose_job_images

            plan = choose_job_images([self._task], self._settings)[self._task.path]
            if isinstance(plan, Exception):
                raise plan
            episode.start(self._task, image=plan)  # type: ignore[call-arg]
        else:
            episode.start(self._task)
        try:
            self.calibration = self._calibration(episode)
        except BaseException:
            episode.close()
            raise
        return episode

    def _calibration(self, episode: Environment) -> dict[str, Any]:
        mode = self.options.calibration
        if mode == "off":
            return {"state": "off"}
        from sequester import __version__
        from sequester.calibration.lookup import lookup
        from sequester.jobs.harbor import task_checksum

        state = lookup(
            task_checksum=task_checksum(self._task.path),
            system=getattr(episode, "system", None),
            settings=self._settings,
            version=__version__,
            mode=mode,
        )
        if state.state == "not-calibrated" or (mode == "required" and state.state != "calibrated"):
            raise TaskNotCalibrated(f"task {self._task.name} is not calibrated here: {state.reason}")
        return state.to_dict()

    async def stop(self, delete: bool) -> None:
        async with self._lock:
            episode, self._episode = self._episode, None
            if episode is not None:
                await asyncio.to_thread(episode.close)

    async def _apply_network_policy(self, network_policy: NetworkPolicy) -> None:
        """The phases' networks are the episode's own: the agent's is set at the start, and
        the verifier's is the task's with the operator's hosts withdrawn (sequester's
        evaluation switches them). A phase Harbor asks to be broader than that is refused."""
        if network_policy.network_mode == NetworkMode.PUBLIC and self._settings.network == "none":
            raise ValueError(
                "this sequester environment has no network (network = none): a public phase cannot be given"
            )

    async def evaluate(self) -> VerifierResult:
        """sequester's verdict on the episode (see :class:`~sequester.harbor.verifier.SequesterVerifier`)."""
        async with self._lock:
            return await asyncio.to_thread(self.episode.evaluate)

    # -- commands and files -------------------------------------------------------------

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        line = exec_command(
            command,
            cwd=cwd or self.task_env_config.workdir or self.episode.workdir,
            env=self._merge_env(env),
            user=self._resolve_user(user),
        )
        limit = float(timeout_sec) if timeout_sec else _NO_LIMIT
        async with self._lock:
            result = await asyncio.to_thread(self.episode.exec, line, limit)
        if result.timed_out:
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds")
        code = result.exit_code if result.exit_code is not None else 1
        stderr = result.stderr + (f"\n[sequester] {result.note}" if result.note else "")
        return ExecResult(stdout=result.stdout, stderr=stderr, return_code=code)

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        data = Path(source_path).read_bytes()
        mode = Path(source_path).stat().st_mode & 0o777
        async with self._lock:
            await asyncio.to_thread(self.episode.write_file, target_path, data, mode)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        async with self._lock:
            await asyncio.to_thread(self.episode.upload_dir, source_dir, target_dir)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        async with self._lock:
            data = await asyncio.to_thread(self.episode.read_file, source_path)
        target = Path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        async with self._lock:
            data = await asyncio.to_thread(self.episode.read_dir, source_dir)
        notes = unpack(data, Path(target_dir))
        Path(target_dir).mkdir(parents=True, exist_ok=True)
        for note in notes:
            self.logger.warning("%s: %s", source_dir, note)
