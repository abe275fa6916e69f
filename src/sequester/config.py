"""The whole config file, one schema, and the one place that reads it: ``[runtime]`` and
``[limits]`` (the kernel's :class:`~sequester.policy.Policy`), ``[episodes]`` (the
:class:`~sequester.environments.settings.EpisodeSettings`), ``[images]`` (their
:class:`~sequester.images.image_settings.ImageSettings`) and ``[serve]`` (``sequester
serve``'s :class:`~sequester.serve.serve_settings.ServeSettings`).

Every command reads the file through :func:`load_config`, so each of them rejects the same
mistakes the same way: an unknown table (``[episode]``), an unknown key in a known table
(``limits.memory``, ``episodes.exec_timout``), a value of the wrong kind. The message
names the file and the key; the CLI exits 2 with it. The tables' classes are plain data
that validate their own values; here, only the file's shape and its relative paths.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sequester.environments.settings import EpisodeSettings
from sequester.errors import PolicyError
from sequester.images.image_settings import ImageSettings
from sequester.policy import ENV_NAME, Limits, Policy, endpoint_at, existing_path, parse_isolation
from sequester.serve.serve_settings import ServeSettings

__all__ = [
    "TABLES",
    "Config",
    "config_from_mapping",
    "config_table",
    "episodes_from_mapping",
    "images_from_mapping",
    "load_config",
    "load_policy",
    "policy_from_mapping",
    "read_config",
    "serve_from_mapping",
]

_RUNTIME_KEYS = {"isolation", "readonly", "allow", "env"}
TABLES = ("runtime", "limits", "episodes", "images", "serve")  # every table a config file may have


@dataclass(frozen=True)
class Config:
    """A validated config file: what kernels get and what episodes get."""

    policy: Policy
    episodes: EpisodeSettings
    source: str
    serve: ServeSettings = dataclasses.field(default_factory=ServeSettings)


def config_from_mapping(data: Mapping[str, Any], base_dir: Path, source: str = "config") -> Config:
    """Validate every table of parsed TOML (relative paths are taken from ``base_dir``)."""
    policy = policy_from_mapping(data, base_dir, source)  # the tables, [runtime], [limits]
    episodes = episodes_from_mapping(data, base_dir, source)
    episodes = dataclasses.replace(episodes, images=images_from_mapping(data, base_dir, source))
    return Config(policy, episodes, source, serve_from_mapping(data, base_dir, source))


def load_config(path: str | os.PathLike[str] | None = None) -> Config:
    """Read and validate a config file; ``None``: the embedded ``configs/default.toml``."""
    return config_from_mapping(*read_config(path))


def load_policy(path: str | os.PathLike[str] | None = None) -> Policy:
    """Load a policy from a TOML file; ``None`` loads the embedded default (``configs/default.toml``).

    The whole file is validated, its ``[episodes]`` table included.
    """
    return load_config(path).policy


def read_config(path: str | os.PathLike[str] | None = None) -> tuple[dict[str, Any], Path, str]:
    """Parse a config file (``None``: the embedded ``configs/default.toml``).

    Returns the data, the folder relative paths are taken from, and a name for messages.
    """
    if path is None:
        from importlib.resources import files

        text = files("sequester").joinpath("default.toml").read_text()
        return _parse_toml(text, "default.toml"), Path.cwd(), "default.toml"
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise PolicyError(f"config {str(file)!r}: {exc.strerror}") from None
    return _parse_toml(text, str(file)), file.resolve().parent, str(file)


def _parse_toml(text: str, source: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"{source}: not valid TOML: {exc}") from None


def _table(data: Mapping[str, Any], key: str, source: str) -> Mapping[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, Mapping):
        raise PolicyError(f"{source}: {key!r} must be a table ([{key}]), got {value!r}")
    return value


def config_table(data: Mapping[str, Any], key: str, known: set[str], source: str) -> dict[str, Any]:
    """The config file's ``[key]`` table (empty when absent), with no key but ``known``:
    every table of the file is checked the same way, naming the first unknown key."""
    table = _table(data, key, source)
    unknown = set(table) - known
    if unknown:
        raise PolicyError(f"{source}: unknown key '{key}.{sorted(unknown)[0]}'")
    return dict(table)


def policy_from_mapping(data: Mapping[str, Any], base_dir: Path, source: str = "policy") -> Policy:
    """Build a policy from parsed TOML. Relative paths are taken from ``base_dir``."""
    # [episodes] belongs to sequester.environments.settings, read from the same file
    # (sequester.config validates the three together).
    unknown = sorted(set(data) - set(TABLES))
    if unknown:
        key = unknown[0]
        kind = "table" if isinstance(data[key], Mapping) else "key"
        raise PolicyError(
            f"{source}: unknown {kind} {key!r} (a config file has the tables "
            f"{', '.join(f'[{t}]' for t in TABLES)}, and nothing else)"
        )
    runtime = config_table(data, "runtime", set(_RUNTIME_KEYS), source)
    limits = config_table(data, "limits", {f.name for f in dataclasses.fields(Limits)}, source)

    def rel(values: Any, key: str) -> list[Path]:
        if not isinstance(values, list):
            raise PolicyError(f"{source}: {key}: expected a list, got {values!r}")
        bad = [v for v in values if not isinstance(v, str)]
        if bad:
            raise PolicyError(f"{source}: {key}: {bad[0]!r} is not a path")
        return [existing_path(base_dir / v, f"{key}") for v in values]

    try:
        isolation, hide = parse_isolation(runtime.get("isolation", True), "runtime.isolation")
        allow = runtime.get("allow", [])
        if not isinstance(allow, list):
            raise PolicyError(f"runtime.allow: expected a list, got {allow!r}")
        env = runtime.get("env", [])
        if not isinstance(env, list):
            raise PolicyError(f"runtime.env: expected a list, got {env!r}")
        for i, name in enumerate(env):
            if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
                raise PolicyError(f"runtime.env[{i}]: {name!r} is not an environment variable name")
        return Policy(
            isolation=isolation,
            hide=tuple(rel(list(hide), "runtime.isolation.hide")),
            readonly=tuple(rel(runtime.get("readonly", []), "runtime.readonly")),
            allow=tuple(endpoint_at(v, f"runtime.allow[{i}]") for i, v in enumerate(allow)),
            env=tuple(env),
            limits=Limits(**limits),
        )
    except PolicyError as exc:
        raise PolicyError(f"{source}: {exc}") from None


def episodes_from_mapping(data: Mapping[str, Any], base_dir: Path, source: str = "config") -> EpisodeSettings:
    raw = data.get("episodes")
    if isinstance(raw, Mapping) and "on_tamper" in raw:
        raise PolicyError(
            f"{source}: episodes.on_tamper was removed: the verdict no longer depends on tampering "
            "(the verifier's runner is out of the agent's reach); the report stays in the results"
        )
    values = config_table(data, "episodes", {f.name for f in dataclasses.fields(EpisodeSettings)} - {"images"}, source)
    for key in ("state_dir", "toolchain_dir"):
        if key in values:
            if not isinstance(values[key], str):
                raise PolicyError(f"{source}: episodes.{key}: {values[key]!r} is not a path")
            values[key] = base_dir / values[key]
    try:
        return EpisodeSettings(**values)
    except PolicyError as exc:
        raise PolicyError(f"{source}: {exc}") from None


def images_from_mapping(data: Mapping[str, Any], base_dir: Path, source: str = "config") -> ImageSettings:
    values = config_table(data, "images", {f.name for f in dataclasses.fields(ImageSettings)}, source)
    if "store_dir" in values:
        if not isinstance(values["store_dir"], str):
            raise PolicyError(f"{source}: images.store_dir: {values['store_dir']!r} is not a path")
        values["store_dir"] = base_dir / values["store_dir"]
    aliases = values.get("aliases")
    if isinstance(aliases, Mapping):
        # A file on the right of an alias is taken relative to the config file.
        values["aliases"] = {
            k: (str(base_dir / v) if isinstance(v, str) and v.startswith((".", "/")) else v) for k, v in aliases.items()
        }
    for key in ("insecure", "build_allowed_hosts"):
        if key in values and isinstance(values[key], list):
            values[key] = tuple(values[key])
    try:
        return ImageSettings(**values)
    except PolicyError as exc:
        raise PolicyError(f"{source}: {exc}") from None
    except TypeError as exc:
        raise PolicyError(f"{source}: [images]: {exc}") from None


def serve_from_mapping(data: Mapping[str, Any], base_dir: Path, source: str = "config") -> ServeSettings:
    values = config_table(data, "serve", {f.name for f in dataclasses.fields(ServeSettings)}, source)
    if "tasks_dir" in values:
        if not isinstance(values["tasks_dir"], str):
            raise PolicyError(f"{source}: serve.tasks_dir: {values['tasks_dir']!r} is not a path")
        values["tasks_dir"] = base_dir / values["tasks_dir"]
    try:
        return ServeSettings(**values)
    except PolicyError as exc:
        raise PolicyError(f"{source}: {exc}") from None
