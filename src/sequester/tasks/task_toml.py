"""What a task's ``task.toml`` asks for: timeouts, the verifier's environment, resources, network.

Two generations of the Harbor schema are in use. Older tasks (Terminal-Bench 2 as released)
write sizes as strings (``memory = "2G"``) and say ``allow_internet``; newer ones write
``memory_mb`` / ``storage_mb`` and ``network_mode``. Both are accepted and normalised to the
newer form, so nothing downstream needs to know which one a task used.

Unknown tables and keys are tolerated (tasks carry authoring metadata sequester does not
read), but every key that *is* read is checked strictly: a task that asks for something we
would misread is an error naming the file and the field, never a guess.

Layout::

    version = "1.0"                 # or schema_version
    [metadata]                      # kept as a dict, not interpreted
    [verifier]
    timeout_sec = 600.0
    env = { KEY = "value" }
    [agent]
    timeout_sec = 1800.0
    [environment]
    docker_image = "ubuntu:24.04"
    cpus = 1
    gpus = 0                        # NVIDIA GPUs the task needs; gpu_types = ["H100"]: acceptable models
    memory = "2G"                   # or memory_mb = 2048
    storage = "10G"                 # or storage_mb = 10240
    workdir = "/app"
    allow_internet = true           # or network_mode = "public" | "no-network" | "allowlist"
    allowed_hosts = ["pypi.org"]    # only with network_mode = "allowlist"
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sequester.errors import TaskError

__all__ = ["NETWORK_MODES", "VerifierConfig", "AgentConfig", "EnvironmentConfig", "TaskConfig", "parse_task_config"]

NETWORK_MODES = ("public", "no-network", "allowlist")

# "2G", "512M", "1024K", also "1.5G", "2GB", "2Gi", "2GiB"; always binary (1G = 1024M).
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT])(?:IB|I|B)?\s*$", re.IGNORECASE)
_SIZE_MB = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}


def _positive(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise TaskError(f"{key}: {value!r} is not a positive number")
    return float(value)


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TaskError(f"{key}: {value!r} is not a positive whole number")
    return value


@dataclass(frozen=True)
class VerifierConfig:
    """How the task's tests are run: their time limit and extra environment variables.

    ``freeze_agent`` (sequester's own key): freeze the agent's processes while the tests
    run, for tasks scored on files rather than on a live service; ``None`` leaves it to the
    run's settings.
    """

    timeout_sec: float = 600.0
    env: dict[str, str] = field(default_factory=dict)
    freeze_agent: bool | None = None
    # Harbor's (schema 1.4): "shared" runs the tests in the agent's environment,
    # "separate" in a fresh one holding only the task's artifacts; None: the run decides.
    environment_mode: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "timeout_sec", _positive(self.timeout_sec, "[verifier] timeout_sec"))
        if self.environment_mode not in (None, "shared", "separate"):
            raise TaskError(f"[verifier] environment_mode: {self.environment_mode!r} is not 'shared' or 'separate'")
        if self.freeze_agent is not None and not isinstance(self.freeze_agent, bool):
            raise TaskError(f"[verifier] freeze_agent: {self.freeze_agent!r} is not true or false")
        if not isinstance(self.env, Mapping):
            raise TaskError(f"[verifier] env: {self.env!r} is not a table of strings")
        for name, value in self.env.items():
            if not isinstance(name, str) or not name or "=" in name:
                raise TaskError(f"[verifier] env: {name!r} is not an environment variable name")
            if not isinstance(value, str):
                raise TaskError(f"[verifier] env.{name}: {value!r} is not a string")
        object.__setattr__(self, "env", dict(self.env))


@dataclass(frozen=True)
class Artifact:
    """A path of the agent's final state that a separate verifier gets (Harbor's
    ``artifacts = ["/app/out.txt", {source = "/app/build", exclude = ["*.o"]}]``)."""

    source: str
    exclude: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source.startswith("/") or ".." in self.source.split("/"):
            raise TaskError(f"artifacts: {self.source!r} is not an absolute path without '..'")
        if not all(isinstance(p, str) and p for p in self.exclude):
            raise TaskError(f"artifacts: exclude of {self.source!r} must be a list of patterns")
        object.__setattr__(self, "exclude", tuple(self.exclude))


def _artifacts(value: Any) -> tuple[Artifact, ...]:
    if not isinstance(value, list):
        raise TaskError(f"artifacts: {value!r} is not a list")
    out = []
    for entry in value:
        if isinstance(entry, str):
            out.append(Artifact(entry))
        elif isinstance(entry, dict):
            unknown = set(entry) - {"source", "destination", "exclude", "service"}
            if unknown or "source" not in entry:
                raise TaskError(f"artifacts: {entry!r} needs 'source' (and may have 'exclude')")
            if entry.get("service") not in (None, "main"):
                raise TaskError(f"artifacts: {entry['source']!r}: compose services are not supported")
            out.append(Artifact(entry["source"], tuple(entry.get("exclude", ()))))
        else:
            raise TaskError(f"artifacts: {entry!r} is not a path or a table")
    return tuple(out)


@dataclass(frozen=True)
class AgentConfig:
    """How long the agent may work on the task; ``None``: the caller's default."""

    timeout_sec: float | None = None

    def __post_init__(self) -> None:
        if self.timeout_sec is not None:
            object.__setattr__(self, "timeout_sec", _positive(self.timeout_sec, "[agent] timeout_sec"))


@dataclass(frozen=True)
class EnvironmentConfig:
    """The container the task runs in: image, resources, working directory and network.

    ``allow_internet`` is the older switch and ``network_mode`` the newer one; when both are
    given ``network_mode`` decides, except that ``allow_internet = false`` with
    ``network_mode = "public"`` is refused: one of them is a mistake, and guessing the wider
    one would open the network a task author meant to close.
    """

    docker_image: str | None = None
    cpus: float = 1
    # NVIDIA GPUs (Harbor's ``gpus``); ``gpu_types``: the acceptable models, None for any.
    gpus: int = 0
    gpu_types: tuple[str, ...] | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None
    workdir: str | None = None
    allow_internet: bool = True
    network_mode: str | None = None
    allowed_hosts: tuple[str, ...] = ()
    # Seconds for building the task's Dockerfile (``sequester build``; --image-source
    # dockerfile): a build past it is an environment error, never the agent's 0.
    build_timeout_sec: float = 600.0

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "build_timeout_sec", _positive(self.build_timeout_sec, "[environment] build_timeout_sec")
        )
        if self.docker_image is not None and (not isinstance(self.docker_image, str) or not self.docker_image.strip()):
            raise TaskError(f"[environment] docker_image: {self.docker_image!r} is not an image name")
        object.__setattr__(self, "cpus", _positive(self.cpus, "[environment] cpus"))
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 0:
            raise TaskError(f"[environment] gpus: {self.gpus!r} is not a whole number of GPUs (0 or more)")
        if self.gpu_types is not None:
            if not isinstance(self.gpu_types, (list, tuple)) or not all(
                isinstance(t, str) and t.strip() for t in self.gpu_types
            ):
                raise TaskError(f"[environment] gpu_types: {self.gpu_types!r} is not a list of GPU model names")
            object.__setattr__(self, "gpu_types", tuple(self.gpu_types))
        for name in ("memory_mb", "storage_mb"):
            if getattr(self, name) is not None:
                _positive_int(getattr(self, name), f"[environment] {name}")
        if self.workdir is not None and (not isinstance(self.workdir, str) or not self.workdir.startswith("/")):
            raise TaskError(f"[environment] workdir: {self.workdir!r} is not an absolute path")
        if not isinstance(self.allow_internet, bool):
            raise TaskError(f"[environment] allow_internet: {self.allow_internet!r} is not true or false")
        if self.network_mode is not None and self.network_mode not in NETWORK_MODES:
            raise TaskError(
                f"[environment] network_mode: {self.network_mode!r} is not one of "
                + ", ".join(repr(m) for m in NETWORK_MODES)
            )
        if not isinstance(self.allowed_hosts, (list, tuple)):
            raise TaskError(f"[environment] allowed_hosts: {self.allowed_hosts!r} is not a list of host names")
        for i, host in enumerate(self.allowed_hosts):
            if not isinstance(host, str) or not host or any(c.isspace() for c in host):
                raise TaskError(f"[environment] allowed_hosts[{i}]: {host!r} is not a host name")
        object.__setattr__(self, "allowed_hosts", tuple(self.allowed_hosts))
        if self.network_mode == "public" and not self.allow_internet:
            raise TaskError("[environment] network_mode: 'public' contradicts allow_internet = false")
        if self.allowed_hosts and self.effective_network_mode != "allowlist":
            raise TaskError(
                f"[environment] allowed_hosts: only allowed with network_mode = 'allowlist' "
                f"(the network mode is {self.effective_network_mode!r})"
            )

    @property
    def effective_network_mode(self) -> str:
        """``network_mode`` if set, else ``"no-network"`` without ``allow_internet``, else ``"public"``."""
        if self.network_mode is not None:
            return self.network_mode
        return "public" if self.allow_internet else "no-network"


@dataclass(frozen=True)
class TaskConfig:
    """Everything ``task.toml`` says, normalised to the newer schema."""

    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    metadata: dict[str, Any] = field(default_factory=dict)
    schema_version: str | None = None
    artifacts: tuple[Artifact, ...] = ()


def parse_size_mb(value: Any, key: str) -> int:
    """``"2G"`` -> 2048, ``"512M"`` -> 512, ``"1024K"`` -> 1 (rounded up to whole MB).

    A bare number is refused: Docker reads it as bytes, people write it meaning MB.
    """
    match = _SIZE.match(value) if isinstance(value, str) else None
    if not match:
        raise TaskError(f"{key}: {value!r} is not a size like '2G', '512M' or '1024K'")
    mb = math.ceil(float(match[1]) * _SIZE_MB[match[2].upper()])
    if mb <= 0:
        raise TaskError(f"{key}: {value!r} is not a positive size")
    return mb


def _table(data: Mapping[str, Any], name: str) -> dict[str, Any]:
    value = data.get(name, {})
    if not isinstance(value, dict):
        raise TaskError(f"[{name}]: {value!r} is not a table")
    return value


def _size(table: Mapping[str, Any], old: str, new: str) -> int | None:
    """The newer ``<new>`` key or the older ``<old>`` string; both are fine if they agree."""
    mb = table.get(new)
    if old in table:
        from_old = parse_size_mb(table[old], f"[environment] {old}")
        if mb is not None and mb != from_old:
            raise TaskError(f"[environment] {old} = {table[old]!r} and {new} = {mb!r} disagree")
        mb = from_old
    return mb


def _version(data: Mapping[str, Any]) -> str | None:
    found = {k: data[k] for k in ("schema_version", "version") if k in data}
    for key, value in found.items():
        if not isinstance(value, str):
            raise TaskError(f"{key}: {value!r} is not a string")
    if len(set(found.values())) > 1:
        raise TaskError(f"version = {found['version']!r} and schema_version = {found['schema_version']!r} disagree")
    return next(iter(found.values()), None)


def config_from_mapping(data: Mapping[str, Any]) -> TaskConfig:
    """Build a :class:`TaskConfig` from parsed TOML; errors name the field but not the file."""
    verifier, agent, env = _table(data, "verifier"), _table(data, "agent"), _table(data, "environment")
    metadata = _table(data, "metadata")
    environment = EnvironmentConfig(
        docker_image=env.get("docker_image"),
        cpus=env.get("cpus", 1),
        gpus=env.get("gpus", 0),
        gpu_types=env.get("gpu_types"),
        memory_mb=_size(env, "memory", "memory_mb"),
        storage_mb=_size(env, "storage", "storage_mb"),
        workdir=env.get("workdir"),
        allow_internet=env.get("allow_internet", True),
        network_mode=env.get("network_mode"),
        allowed_hosts=env.get("allowed_hosts", ()),
        build_timeout_sec=env.get("build_timeout_sec", 600.0),
    )
    return TaskConfig(
        verifier=VerifierConfig(
            timeout_sec=verifier.get("timeout_sec", 600.0),
            env=verifier.get("env", {}),
            freeze_agent=verifier.get("freeze_agent"),
            environment_mode=verifier.get("environment_mode"),
        ),
        agent=AgentConfig(timeout_sec=agent.get("timeout_sec")),
        environment=environment,
        metadata=dict(metadata),
        schema_version=_version(data),
        artifacts=_artifacts(data.get("artifacts", [])),
    )


def parse_task_config(text: str, source: str) -> TaskConfig:
    """Parse the text of a ``task.toml``; ``source`` (a path or name) starts every error message."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TaskError(f"{source}: not valid TOML: {exc}") from None
    try:
        return config_from_mapping(data)
    except TaskError as exc:
        raise TaskError(f"{source}: {exc}") from None
