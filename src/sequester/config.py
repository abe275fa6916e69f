"""The whole config file, one schema: ``[runtime]`` and ``[limits]`` (the kernel's
:class:`~sequester.policy.Policy`) and ``[episodes]`` (the
:class:`~sequester.environments.settings.EpisodeSettings`) and ``[images]`` (their
:class:`~sequester.images.image_settings.ImageSettings`) and ``[serve]`` (``sequester serve``'s
:class:`~sequester.serve.serve_settings.ServeSettings`).

Every command reads the file through :func:`load_config`, so each of them rejects the same
mistakes the same way: an unknown table (``[episode]``), an unknown key in a known table
(``limits.memory``, ``episodes.exec_timout``), a value of the wrong kind. The message
names the file and the key; the CLI exits 2 with it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sequester.environments.settings import EpisodeSettings, settings_from_mapping
from sequester.images.image_settings import images_from_mapping
from sequester.policy import Policy, policy_from_mapping, read_config
from sequester.serve.serve_settings import ServeSettings, serve_from_mapping

__all__ = ["Config", "config_from_mapping", "load_config"]


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
    episodes = settings_from_mapping(data, base_dir, source)
    episodes = dataclasses.replace(episodes, images=images_from_mapping(data, base_dir, source))
    return Config(policy, episodes, source, serve_from_mapping(data, base_dir, source))


def load_config(path: str | os.PathLike[str] | None = None) -> Config:
    """Read and validate a config file; ``None``: the embedded ``configs/default.toml``."""
    return config_from_mapping(*read_config(path))
