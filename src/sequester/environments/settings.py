"""Settings of episodes: plain frozen data, from the ``[episodes]`` table of a config file.

[episodes]
exec_timeout = 600          # default seconds per exec (each call may pass its own)
freeze_agent = false        # freeze the agent's processes while the verifier runs
verifier_env = "shared"     # or "separate": the tests run in a fresh view holding only the task's artifacts
reward_range = [0, 1]       # rewards outside it are invalid (the agent's 0); "any": any finite number
output_bytes = 10000000     # cap on one exec's output and on the verifier's output
max_processes = 4096        # processes the agent may have at once (RLIMIT_NPROC)
state_dir = "/var/tmp/..."  # where episodes keep their writable layers
toolchain_dir = "..."       # the verifier's runner tree (built once; see sequester.verifier)
backend = "local"           # or "docker": a Docker-API engine runs the episodes (sequester.environments)
docker_host = "unix:///..." # the engine (default: $DOCKER_HOST, else the engine's default socket)
docker_build = false        # docker: build the task's environment/Dockerfile with the engine
docker_network = "NAME"     # docker: the engine network public tasks get (default: the engine's default)
network = "task"            # or "allowlist" / "none": what the run lets tasks have (see sequester.net.episode)
allowed_hosts = []          # HOST[:PORT] the agent's phase may reach besides (a model API, a loopback mock)
dns_servers = []            # IP[:PORT] the episodes' DNS responder asks (default: /etc/resolv.conf's)
checkpoint_depth = 16       # sealed layers an episode may stand on (Episode.checkpoint)
checkpoint_disk_mb = 20480  # disk the sealed layers of one process may take
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sequester.caches import cache_root, user_cache
from sequester.errors import PolicyError
from sequester.images.image_settings import ImageSettings
from sequester.net.episode.policy import parse_operator_hosts, parse_run_network
from sequester.net.episode.upstream import parse_server
from sequester.sandbox.idmap import IdMap, caller_id_map, check_unused, parse_id_range

if TYPE_CHECKING:
    from sequester.images.store import ImageStore

BACKENDS = ("local", "docker")

__all__ = [
    "BACKENDS",
    "EpisodeSettings",
    "episode_id_map",
    "episode_image_store",
    "cluster_cache_dir",
    "default_state_dir",
    "default_toolchain_dir",
]


def default_state_dir() -> Path:
    # Root's is 0700 (a kernel, which runs as nobody, cannot enter it); a user's lives in
    # the home folder, which every sandbox hides.
    return Path("/var/tmp/sequester-episodes") if os.getuid() == 0 else user_cache() / "episodes"


def cluster_cache_dir() -> Path:
    """A cluster node's folder of shipped tasks (their tests and solutions) and trial
    staging (:mod:`sequester.cluster.node`); every episode on the machine hides it."""
    return cache_root() / "cluster"


def default_toolchain_dir() -> Path:
    return cache_root() / "verifier"


@dataclass(frozen=True)
class EpisodeSettings:
    exec_timeout: float = 600.0
    freeze_agent: bool = False
    output_bytes: int = 10_000_000
    verifier_env: str | None = None  # "shared" | "separate"; None: the task's environment_mode, else shared
    # Rewards outside this range are invalid (the agent's 0); None: any finite number, as Harbor.
    reward_range: tuple[float, float] | None = (0.0, 1.0)
    state_dir: Path = dataclasses.field(default_factory=default_state_dir)
    toolchain_dir: Path = dataclasses.field(default_factory=default_toolchain_dir)
    # The [images] table (a table of its own in a config file): where images come from.
    images: ImageSettings = dataclasses.field(default_factory=ImageSettings)
    # RLIMIT_NPROC of the agent's processes: a fork bomb stops here, not at the host's limit.
    max_processes: int = 4096
    backend: str = "local"  # what runs the episodes: "local" (namespaces here) or "docker" (see sequester.environments)
    docker_host: str | None = None
    docker_build: bool = False
    # docker: the engine network a public task's containers join (one the operator set up,
    # e.g. with a firewall refusing private and metadata addresses); None: the engine's default.
    docker_network: str | None = None
    # A root caller's range of subordinate ids for its episodes ("BASE:COUNT"; see
    # sequester.sandbox.idmap): else /etc/subuid's root entry (sequester setup ids).
    id_range: str | None = None
    # The run's network (sequester.net.episode.policy): "task" (each task's own), "allowlist"
    # (no task gets more than its allowlist) or "none"; and hosts for the agent's phase only.
    network: str = "task"
    allowed_hosts: tuple[str, ...] = ()
    # The resolvers the episodes' DNS responder asks on the host ("IP" or "IP:PORT");
    # empty: the host's own (/etc/resolv.conf).
    dns_servers: tuple[str, ...] = ()
    # Harbor's --agent-timeout-multiplier and --verifier-timeout-multiplier: the task's
    # [agent] and [verifier] timeout_sec are scaled by them (see timed_task).
    agent_timeout_multiplier: float = 1.0
    verifier_timeout_multiplier: float = 1.0
    # Checkpoints (sequester.environments.local.checkpoint): the sealed layers an episode
    # may stand on, and the disk the sealed layers of one process may take.
    checkpoint_depth: int = 16
    checkpoint_disk_mb: int = 20480

    def __post_init__(self) -> None:
        for name, least in (("checkpoint_depth", 2), ("checkpoint_disk_mb", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise PolicyError(f"episodes.{name}: {value!r} is not a whole number of at least {least}")
        for name in (
            "exec_timeout",
            "output_bytes",
            "max_processes",
            "agent_timeout_multiplier",
            "verifier_timeout_multiplier",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise PolicyError(f"episodes.{name}: {value!r} is not a positive number")
        if self.verifier_env not in (None, "shared", "separate"):
            raise PolicyError(f"episodes.verifier_env: {self.verifier_env!r} is not 'shared' or 'separate'")
        for name in ("freeze_agent", "docker_build"):
            if not isinstance(getattr(self, name), bool):
                raise PolicyError(f"episodes.{name}: {getattr(self, name)!r} is not true or false")
        if self.backend not in BACKENDS:
            raise PolicyError(f"episodes.backend: {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.docker_host is not None and (not isinstance(self.docker_host, str) or not self.docker_host):
            raise PolicyError(
                f"episodes.docker_host: {self.docker_host!r} is not an engine address "
                "(unix:///PATH, tcp://HOST:PORT, ssh://...)"
            )
        if self.docker_network is not None and (not isinstance(self.docker_network, str) or not self.docker_network):
            raise PolicyError(f"episodes.docker_network: {self.docker_network!r} is not an engine network's name")
        if self.id_range is not None:
            check_unused(*parse_id_range(self.id_range))  # raises, naming the key
        object.__setattr__(self, "network", parse_run_network(self.network))
        if isinstance(self.allowed_hosts, str) or not isinstance(self.allowed_hosts, (list, tuple)):
            raise PolicyError(f"episodes.allowed_hosts: {self.allowed_hosts!r} is not a list of HOST[:PORT]")
        object.__setattr__(self, "allowed_hosts", tuple(self.allowed_hosts))
        parse_operator_hosts(self.allowed_hosts)  # raises, naming the key and the entry
        if isinstance(self.dns_servers, str) or not isinstance(self.dns_servers, (list, tuple)):
            raise PolicyError(f"episodes.dns_servers: {self.dns_servers!r} is not a list of IP[:PORT]")
        object.__setattr__(self, "dns_servers", tuple(self.dns_servers))
        for i, server in enumerate(self.dns_servers):
            try:
                parse_server(server)
            except (TypeError, ValueError, AttributeError):
                raise PolicyError(f"episodes.dns_servers[{i}]: {server!r} is not IP or IP:PORT") from None
        object.__setattr__(self, "reward_range", _reward_range(self.reward_range))
        object.__setattr__(self, "state_dir", Path(self.state_dir))
        object.__setattr__(self, "toolchain_dir", Path(self.toolchain_dir))


def _reward_range(value: Any) -> tuple[float, float] | None:
    """``[low, high]`` of finite numbers, or ``None`` / ``"any"`` for no range."""
    if value is None or value == "any":
        return None
    if (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in value)
        and value[0] <= value[1]
    ):
        return (float(value[0]), float(value[1]))
    raise PolicyError(f'episodes.reward_range: {value!r} is not [low, high] (finite, low <= high) or "any"')


def episode_id_map(settings: EpisodeSettings) -> tuple[IdMap | None, str | None]:
    """The ids an episode of ``settings`` maps (:mod:`sequester.sandbox.idmap`), or
    ``(None, why)``: then the caller alone."""
    return caller_id_map(parse_id_range(settings.id_range) if settings.id_range else None)


def episode_image_store(settings: EpisodeSettings) -> ImageStore:
    """The image store of ``settings``, its layers owned through the episodes' id map."""
    from sequester.images.store import ImageStore

    return ImageStore(settings.images, ids=episode_id_map(settings)[0])
