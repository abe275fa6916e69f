"""The containers of an episode: which image, and a container made from it with the
task's limits, network, GPUs and working directory, kept alive by nothing but ``/bin/sh``.

Nothing of the task's ``tests/`` or ``solution/`` is ever put in the agent's container:
an image is built from ``environment/`` only (the Dockerfile's build context, which holds
neither), and the container gets no mount of the task's folder.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any

from sequester.environments.base import UnsupportedByBackend
from sequester.environments.docker.engine import MANAGED, EngineError, labels
from sequester.environments.settings import EpisodeSettings
from sequester.tasks import Task

__all__ = [
    "KEEP_ALIVE",
    "ImageChoice",
    "resolve_image",
    "network_for",
    "ENGINE_GUARANTEE",
    "create_container",
    "container_workdir",
    "remove_container",
    "check_gpus",
]

# The container's init: only /bin/sh needed (no `sleep infinity`, no tini); TERM ends it
# at once (`docker stop` does not wait out its grace period).
KEEP_ALIVE = ["/bin/sh", "-c", "trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done"]
_serial = itertools.count()


@dataclass(frozen=True)
class ImageChoice:
    """The image an episode runs on: the reference it was named by and its id."""

    reference: str
    id: str
    workdir: str | None  # the image's WorkingDir, if any
    built: bool = False


def _engine(what: str, fn: Any, *args: Any, **kw: Any) -> Any:
    try:
        return fn(*args, **kw)
    except Exception as exc:  # noqa: BLE001 - the SDK's and requests' errors alike
        raise EngineError(f"the engine could not {what}: {exc}") from exc


def resolve_image(client: Any, task: Task, image: str | None = None, build: bool = False) -> ImageChoice:
    """The caller's ``image``, else an image built from the task's ``environment/`` when
    ``build``, else task.toml's ``docker_image`` (pulled if the engine lacks it)."""
    import docker.errors

    if image is None and build:
        if not (task.environment_dir / "Dockerfile").is_file():
            raise UnsupportedByBackend(f"{task.name}: build=True, but the task has no environment/Dockerfile")
        tag = f"localhost/sequester-build/{task.name.lower()}:latest"
        built, _ = _engine(
            f"build {task.environment_dir}",
            client.images.build,
            path=str(task.environment_dir),
            tag=tag,
            rm=True,
            forcerm=True,
            labels={MANAGED: "1"},
            timeout=task.config.environment.build_timeout_sec,
        )
        return ImageChoice(tag, built.id, (built.attrs.get("Config") or {}).get("WorkingDir") or None, True)
    reference = image or task.config.environment.docker_image
    if reference is None:
        raise UnsupportedByBackend(
            f"{task.name}: task.toml names no [environment] docker_image: build its "
            "environment/Dockerfile with --docker-build (docker_build = true; build=True "
            "in the API), or name an image (image=)"
        )
    try:
        found = client.images.get(reference)
    except docker.errors.ImageNotFound:
        found = _engine(f"pull {reference}", client.images.pull, reference)
    except Exception as exc:  # noqa: BLE001
        raise EngineError(f"the engine could not look up image {reference}: {exc}") from exc
    return ImageChoice(reference, found.id, (found.attrs.get("Config") or {}).get("WorkingDir") or None)


def container_workdir(task: Task, choice: ImageChoice) -> str:
    """task.toml's ``workdir``, else the image's ``WorkingDir``, else the Dockerfile's
    ``WORKDIR``, else ``/`` (as the local backend on an image)."""
    return task.config.environment.workdir or choice.workdir or task.default_workdir or "/"


# What docker mode guarantees of a public network (docs/network.md): the engine's, not sequester's.
ENGINE_GUARANTEE = (
    "the engine's network: sequester refuses nothing on it (a Docker engine's bridge reaches the host's "
    "addresses, private networks and cloud metadata unless its operator's firewall refuses them)"
)


def network_for(task: Task, settings: EpisodeSettings | None = None) -> tuple[str | None, dict[str, Any]]:
    """The engine's ``network_mode`` for ``task`` under the run's network (``settings``:
    ``[episodes] network``, ``docker_network``), and the record of it: ``none`` for a task
    without internet (or a run narrowed to none), the operator's engine network
    (``docker_network``) else the engine's default for a public one, with the weaker
    guarantee said in the record. An allowlist cannot be enforced here: refused."""
    run_network = settings.network if settings is not None else "task"
    mode = task.config.environment.effective_network_mode
    record: dict[str, Any] = {"task_network_mode": mode, "run_network": run_network, "backend": "docker"}
    if mode == "no-network" or run_network == "none":
        return "none", {**record, "mode": "none", "decided_by": "task" if mode == "no-network" else "operator"}
    if mode == "allowlist" or run_network == "allowlist":
        raise UnsupportedByBackend(
            f"{task.name}: an allowlist network ({'the task' if mode == 'allowlist' else '--network allowlist'}) "
            "cannot be enforced by the docker backend: use the local backend, or --network none"
        )
    engine = settings.docker_network if settings is not None else None
    note = f"the operator's engine network {engine!r}" if engine else "the engine's default network"
    return engine, {**record, "mode": "public", "decided_by": "task", "network": note, "guarantee": ENGINE_GUARANTEE}


def create_container(
    client: Any, image_id: str, task: Task, settings: EpisodeSettings, *, role: str, workdir: str, network: str | None
) -> Any:
    """Create and start a container of ``image_id`` for ``role`` (see the module). Its
    limits: task.toml's ``cpus`` and ``memory_mb``; processes: the settings'
    ``max_processes`` (task.toml has no such key). On a failed start nothing is left."""
    env = task.config.environment
    name = f"sequester-{role}-{os.getpid()}-{next(_serial)}-{secrets.token_hex(3)}"
    options: dict[str, Any] = {
        "entrypoint": KEEP_ALIVE,
        "command": [],
        "working_dir": workdir,
        "labels": labels(role),
        "name": name,
        "detach": True,
        "nano_cpus": int(env.cpus * 1e9),
        "pids_limit": settings.max_processes,
        "stdin_open": False,
        "tty": False,
    }
    if env.memory_mb is not None:
        options["mem_limit"] = env.memory_mb << 20
        options["memswap_limit"] = env.memory_mb << 20  # no swap beyond the limit: the limit is the limit
    if network is not None:
        options["network_mode"] = network
    if env.gpus:  # as `docker run --gpus N` (the engine's NVIDIA runtime or CDI); checked by the caller
        import docker.types

        options["device_requests"] = [docker.types.DeviceRequest(count=env.gpus, capabilities=[["gpu"]])]
    try:
        container = _engine(f"create a container of {image_id}", client.containers.create, image_id, **options)
    except EngineError as exc:
        if env.gpus:  # an engine without GPUs refuses the request: the task's, not the engine's failure
            raise UnsupportedByBackend(f"{task.name} asks for {_gpus(env.gpus)}; {exc}") from exc
        raise
    try:
        _engine(f"start container {name}", container.start)
        container.reload()
    except BaseException:
        try:
            container.remove(force=True)
        except Exception:  # noqa: BLE001,S110 - the reaper removes it when this process is gone
            pass
        raise
    if not (container.attrs.get("State") or {}).get("Running"):
        remove_container(container)
        raise EngineError(f"container {name} of {image_id} exited at once (does the image have /bin/sh?)")
    return container


def _gpus(count: int) -> str:
    return f"{count} GPU{'s' * (count != 1)} ([environment] gpus = {count})"


def check_gpus(container: Any, task: Task, found: int | None) -> None:
    """The container got the task's GPUs: ``found`` ``/dev/nvidia<N>`` devices in it (None:
    they could not be counted). An engine may take a device request and give nothing
    (podman without CDI devices does): :class:`UnsupportedByBackend`, the container removed."""
    wanted = task.config.environment.gpus
    if wanted and (found is None or found < wanted):
        remove_container(container)
        raise UnsupportedByBackend(
            f"{task.name} asks for {_gpus(wanted)}; the engine's container has "
            f"{'no countable' if found is None else found or 'no'} /dev/nvidia<N> device{'s' * (found != 1)}"
        )


_REMOVE_TRIES = (0.0, 0.5, 2.0, 5.0)  # seconds before each try


def remove_container(container: Any) -> None:
    """Force-remove ``container``, trying again when the engine fails: under load podman
    answers 500 ("could not be stopped: timed out waiting for file .../exits/...", "unlinkat
    .../shm: device or resource busy") and a later try takes. Gone already is done. Raises
    :class:`EngineError` when the last try fails too."""
    import docker.errors

    last: Exception | None = None
    for pause in _REMOVE_TRIES:
        time.sleep(pause)
        try:
            if last is not None:
                with contextlib.suppress(Exception):  # a container that would not stop: killed first
                    container.kill()
            container.remove(force=True)
            return
        except docker.errors.NotFound:
            return
        except Exception as exc:  # noqa: BLE001 - the SDK's and requests' errors alike
            last = exc
    raise EngineError(f"the engine did not remove container {container.name} ({len(_REMOVE_TRIES)} tries): {last}")
