"""OCI and Docker manifests, indexes and image configs, read strictly. Pure.

What an episode takes from an image config: ``Env``, ``WorkingDir``, ``User`` (and
``Cmd``/``Entrypoint`` for the record). What the store takes from a manifest: the config
digest, and each layer's digest, media type and size; the config's ``rootfs.diff_ids``
give each layer's uncompressed digest, which names its unpacked folder.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
from dataclasses import dataclass, field
from typing import Any

from sequester.errors import ImageError

__all__ = [
    "DIGEST",
    "Platform",
    "host_platform",
    "Descriptor",
    "ImageConfig",
    "config_document",
    "Manifest",
    "parse_json",
    "declared_compression",
    "select_platform",
    "parse_manifest",
    "parse_config",
    "sha256_digest",
    "is_index",
    "INDEX_TYPES",
]

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
INDEX_TYPES = frozenset({OCI_INDEX, DOCKER_LIST})
MANIFEST_TYPES = frozenset({OCI_MANIFEST, DOCKER_MANIFEST})
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")  # what a digest is, everywhere in the store
_MACHINES = {
    "x86_64": ("amd64", ""),
    "amd64": ("amd64", ""),
    "aarch64": ("arm64", "v8"),
    "arm64": ("arm64", "v8"),
    "armv7l": ("arm", "v7"),
    "armv6l": ("arm", "v6"),
    "ppc64le": ("ppc64le", ""),
    "s390x": ("s390x", ""),
    "riscv64": ("riscv64", ""),
    "i686": ("386", ""),
    "i386": ("386", ""),
}
_LIMIT = 4 << 20  # a manifest or config larger than this is not one


@dataclass(frozen=True)
class Platform:
    os: str
    architecture: str
    variant: str = ""

    def __str__(self) -> str:
        return f"{self.os}/{self.architecture}" + (f"/{self.variant}" if self.variant else "")


def host_platform() -> Platform:
    arch, variant = _MACHINES.get(platform.machine().lower(), (platform.machine().lower(), ""))
    return Platform("linux", arch, variant)


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    platform: Platform | None = None


@dataclass(frozen=True)
class ImageConfig:
    env: tuple[str, ...] = ()
    workdir: str = ""
    user: str = ""
    cmd: tuple[str, ...] = ()
    entrypoint: tuple[str, ...] = ()
    diff_ids: tuple[str, ...] = ()
    platform: Platform | None = None
    # Recorded from a build (and read from a pulled image's config); nothing runs them.
    labels: tuple[str, ...] = ()  # "key=value", in order
    exposed_ports: tuple[str, ...] = ()  # "80/tcp"
    volumes: tuple[str, ...] = ()
    healthcheck: tuple[str, ...] = ()  # the Test list (["CMD-SHELL", "..."]), or ("NONE",)
    stop_signal: str = ""
    shell: tuple[str, ...] = ()

    def env_map(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for item in self.env:
            name, sep, value = item.partition("=")
            if sep and name:
                out[name] = value
        return out


@dataclass(frozen=True)
class Manifest:
    config: Descriptor
    layers: tuple[Descriptor, ...] = field(default_factory=tuple)


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def parse_json(data: bytes, what: str) -> dict[str, Any]:
    if len(data) > _LIMIT:
        raise ImageError(f"{what}: larger than {_LIMIT >> 20} MiB")
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise ImageError(f"{what}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ImageError(f"{what}: not a JSON object")
    return value


def is_index(doc: dict[str, Any]) -> bool:
    return doc.get("mediaType") in INDEX_TYPES or ("manifests" in doc and "layers" not in doc)


def _descriptor(item: Any, what: str) -> Descriptor:
    if not isinstance(item, dict):
        raise ImageError(f"{what}: a descriptor is not an object")
    digest, size = item.get("digest"), item.get("size")
    if not isinstance(digest, str) or not DIGEST.match(digest):
        raise ImageError(f"{what}: {digest!r} is not a sha256 digest")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ImageError(f"{what}: size {size!r} of {digest} is not a byte count")
    plat = item.get("platform")
    parsed = None
    if isinstance(plat, dict):
        parsed = Platform(
            str(plat.get("os", "")), str(plat.get("architecture", "")), str(plat.get("variant", "") or "")
        )
    return Descriptor(str(item.get("mediaType", "")), digest, size, parsed)


def select_platform(index: dict[str, Any], want: Platform, what: str) -> Descriptor:
    """The index's manifest for ``want`` (a variant is matched when both say one);
    :class:`ImageError` listing what the index has otherwise."""
    entries = index.get("manifests")
    if not isinstance(entries, list) or not entries:
        raise ImageError(f"{what}: an index with no manifests")
    found = [_descriptor(e, what) for e in entries]
    usable = [
        d
        for d in found
        if d.platform is not None and d.platform.os == want.os and d.platform.architecture == want.architecture
    ]
    exact = [
        d
        for d in usable
        if not want.variant or not d.platform or not d.platform.variant or d.platform.variant == want.variant
    ]
    if exact:
        return exact[0]
    have = sorted({str(d.platform) for d in found if d.platform is not None and d.platform.architecture != "unknown"})
    raise ImageError(
        f"{what}: no manifest for this machine's platform {want} "
        f"(the image has: {', '.join(have) or 'no platform information'})"
    )


def parse_manifest(doc: dict[str, Any], what: str) -> Manifest:
    if is_index(doc):
        raise ImageError(f"{what}: an index where a manifest was expected")
    if doc.get("schemaVersion") != 2:
        raise ImageError(f"{what}: schemaVersion {doc.get('schemaVersion')!r} is not 2 (schema 1 is not supported)")
    layers = doc.get("layers")
    if not isinstance(layers, list):
        raise ImageError(f"{what}: no 'layers' list")
    return Manifest(_descriptor(doc.get("config"), what), tuple(_descriptor(layer, what) for layer in layers))


def _strings(value: Any, what: str, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ImageError(f"{what}: config.{key} is not a list of strings")
    return tuple(value)


def parse_config(doc: dict[str, Any], what: str) -> ImageConfig:
    cfg = doc.get("config") or {}
    if not isinstance(cfg, dict):
        raise ImageError(f"{what}: 'config' is not an object")
    rootfs = doc.get("rootfs") or {}
    diff_ids = _strings(rootfs.get("diff_ids") if isinstance(rootfs, dict) else None, what, "rootfs.diff_ids")
    for d in diff_ids:
        if not DIGEST.match(d):
            raise ImageError(f"{what}: diff_id {d!r} is not a sha256 digest")
    for key in ("WorkingDir", "User"):
        if cfg.get(key) is not None and not isinstance(cfg.get(key), str):
            raise ImageError(f"{what}: config.{key} is not a string")
    plat = Platform(str(doc.get("os", "")), str(doc.get("architecture", "")), str(doc.get("variant", "") or ""))
    health = cfg.get("Healthcheck")
    stop_signal = cfg.get("StopSignal")
    return ImageConfig(
        env=_strings(cfg.get("Env"), what, "Env"),
        workdir=cfg.get("WorkingDir") or "",
        user=cfg.get("User") or "",
        cmd=_strings(cfg.get("Cmd"), what, "Cmd"),
        entrypoint=_strings(cfg.get("Entrypoint"), what, "Entrypoint"),
        diff_ids=diff_ids,
        platform=plat,
        labels=_pairs(cfg.get("Labels")),
        exposed_ports=_keys(cfg.get("ExposedPorts")),
        volumes=_keys(cfg.get("Volumes")),
        healthcheck=_strings(health.get("Test"), what, "Healthcheck.Test") if isinstance(health, dict) else (),
        stop_signal=stop_signal if isinstance(stop_signal, str) else "",
        shell=_strings(cfg.get("Shell"), what, "Shell"),
    )


def _pairs(value: Any) -> tuple[str, ...]:
    """Labels as ``key=value`` (an image's config is data: anything odd is left out)."""
    if not isinstance(value, dict):
        return ()
    return tuple(f"{k}={v}" for k, v in value.items() if isinstance(k, str) and isinstance(v, str))


def _keys(value: Any) -> tuple[str, ...]:
    return tuple(k for k in value if isinstance(k, str)) if isinstance(value, dict) else ()


def config_document(config: ImageConfig) -> dict[str, Any]:
    """``config`` as an OCI image config's ``config`` object (what a build writes)."""
    doc: dict[str, Any] = {}
    for key, value in (
        ("Env", list(config.env)),
        ("WorkingDir", config.workdir),
        ("User", config.user),
        ("Cmd", list(config.cmd)),
        ("Entrypoint", list(config.entrypoint)),
        ("StopSignal", config.stop_signal),
        ("Shell", list(config.shell)),
    ):
        if value:
            doc[key] = value
    if config.labels:
        doc["Labels"] = dict(item.split("=", 1) for item in config.labels)
    if config.exposed_ports:
        doc["ExposedPorts"] = {port: {} for port in config.exposed_ports}
    if config.volumes:
        doc["Volumes"] = {volume: {} for volume in config.volumes}
    if config.healthcheck:
        doc["Healthcheck"] = {"Test": list(config.healthcheck)}
    return doc


def declared_compression(media_type: str) -> str:
    """The compression a layer's media type declares ("gzip", "zstd" or "")."""
    if media_type.endswith(("+gzip", ".tar.gzip")) or "gzip" in media_type:
        return "gzip"
    if "zstd" in media_type:
        return "zstd"
    return ""
