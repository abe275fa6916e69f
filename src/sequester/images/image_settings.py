"""The ``[images]`` table of a config file: plain frozen data.

    [images]
    source = "auto"                  # prebuilt | dockerfile | host | auto (see sequester.images.choose)
    store_dir = "/var/lib/sequester/images"   # the content-addressed store (default below)
    mirrors = { "docker.io" = "127.0.0.1:5000" }   # registry host -> the host to fetch from instead
    aliases = { "python:3.13-slim-bookworm" = "/data/images/python-3.13.oci.tar" }  # reference -> reference or file
    insecure = ["127.0.0.1:5000"]    # registries spoken to over plain HTTP (loopback only)
    build_network = "public"         # a build's RUN/ADD network: none | public | allowlist
    build_allowed_hosts = ["pypi.org", "files.pythonhosted.org:443"]  # for allowlist

Credentials are not part of it: they come from ``~/.docker/config.json`` (or
``$DOCKER_CONFIG/config.json``, or ``$REGISTRY_AUTH_FILE``) and from the environment
(:mod:`.credentials`), and are never logged.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sequester.errors import PolicyError
from sequester.images.reference import is_loopback_host

__all__ = ["ImageSettings", "IMAGE_SOURCES", "BUILD_NETWORKS", "default_store_dir"]

IMAGE_SOURCES = ("auto", "prebuilt", "dockerfile", "host")
BUILD_NETWORKS = ("public", "none", "allowlist")


def default_store_dir() -> Path:
    # Not below /var/tmp or ~/.cache: a cleaner that deletes old files there would take
    # single files out of an unpacked layer, and an image would change under its digest.
    if os.getuid() == 0:
        return Path("/var/lib/sequester/images")
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "sequester" / "images"


@dataclass(frozen=True)
class ImageSettings:
    source: str = "auto"
    store_dir: Path = dataclasses.field(default_factory=default_store_dir)
    mirrors: Mapping[str, str] = dataclasses.field(default_factory=dict)
    aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)
    insecure: tuple[str, ...] = ()
    build_network: str = "public"
    build_allowed_hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.source not in IMAGE_SOURCES:
            raise PolicyError(f"images.source: {self.source!r} is not one of {', '.join(IMAGE_SOURCES)}")
        if self.build_network not in BUILD_NETWORKS:
            raise PolicyError(f"images.build_network: {self.build_network!r} is not one of {', '.join(BUILD_NETWORKS)}")
        hosts = self.build_allowed_hosts
        if isinstance(hosts, str) or not all(isinstance(h, str) and h for h in hosts):
            raise PolicyError(f"images.build_allowed_hosts: {hosts!r} is not a list of host names")
        object.__setattr__(self, "build_allowed_hosts", tuple(hosts))
        for name in ("mirrors", "aliases"):
            table = getattr(self, name)
            if not isinstance(table, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) and k and v for k, v in table.items()
            ):
                raise PolicyError(f"images.{name}: {table!r} is not a table of non-empty strings")
            object.__setattr__(self, name, dict(table))
        insecure = self.insecure
        if isinstance(insecure, str) or not all(isinstance(h, str) for h in insecure):
            raise PolicyError(f"images.insecure: {insecure!r} is not a list of registry hosts")
        for host in insecure:
            # Plain HTTP only where nothing between us and the registry can change a byte.
            if not is_loopback_host(host):
                raise PolicyError(
                    f"images.insecure: {host!r} is not a loopback registry (localhost, 127.x, [::1]); "
                    "plain HTTP is allowed only there"
                )
        object.__setattr__(self, "insecure", tuple(insecure))
        object.__setattr__(self, "store_dir", Path(self.store_dir))
