"""Image references, as Docker spells them, normalised. Pure.

``python:3.13-slim-bookworm`` is ``docker.io/library/python:3.13-slim-bookworm``;
``ghcr.io/org/img@sha256:...`` names one manifest by digest; ``localhost:5000/x`` and
``127.0.0.1:5000/x`` are registries because their first part has a port or a dot (Docker's
rule). The ``[images]`` table's ``mirrors`` move a registry host to another (a loopback
mirror), ``aliases`` one reference to another reference or a local file.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from sequester.errors import ImageError
from sequester.images.manifest import DIGEST

__all__ = ["Reference", "parse_reference", "DOCKER_HUB", "is_loopback_host"]

DOCKER_HUB = "docker.io"
_HUB_ALIASES = frozenset({"docker.io", "index.docker.io", "registry-1.docker.io", "registry.hub.docker.com"})
# Docker's grammar (distribution/reference), simplified to what it accepts.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_PATH = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
_TAG = re.compile(r"^[\w][\w.-]{0,127}$")
_HOST = re.compile(
    r"^(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*"
    r"|\[[0-9a-fA-F:]+\])(?::[0-9]{1,5})?$"
)


@dataclass(frozen=True)
class Reference:
    """A registry image reference: ``registry/repository[:tag][@digest]``."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    def __str__(self) -> str:
        return self.name + (f":{self.tag}" if self.tag else "") + (f"@{self.digest}" if self.digest else "")

    @property
    def name(self) -> str:
        """``registry/repository``, without tag or digest."""
        return f"{self.registry}/{self.repository}"

    @property
    def short(self) -> str:
        """As Docker shows it: ``python:3.13`` for Docker Hub's official images."""
        text = str(self)
        for prefix in (f"{DOCKER_HUB}/library/", f"{DOCKER_HUB}/"):
            if text.startswith(prefix):
                return text[len(prefix) :]
        return text

    def on(self, registry: str) -> Reference:
        """The same image on another registry host (a mirror)."""
        return Reference(registry, self.repository, self.tag, self.digest)

    def mirrored(self, mirrors: Mapping[str, str]) -> Reference:
        """Where to fetch it from, given the ``[images] mirrors`` table (host -> host)."""
        for source, target in mirrors.items():
            if _canonical_host(source) == self.registry:
                return self.on(_canonical_host(target))
        return self


def parse_reference(text: str) -> Reference:
    """Normalise ``text`` as Docker does; :class:`ImageError` naming it when it is not one."""
    original = text
    text = text.strip()
    if text.startswith("docker://"):
        text = text[len("docker://") :]
    if not text or any(c.isspace() for c in text):
        raise ImageError(f"image reference {original!r}: empty or contains spaces")
    digest = None
    if "@" in text:
        text, digest = text.split("@", 1)
        if not DIGEST.match(digest):
            raise ImageError(f"image reference {original!r}: {digest!r} is not a sha256 digest (sha256:<64 hex>)")
    first, _, rest = text.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost" or first.startswith("[")):
        if not _HOST.match(first):
            raise ImageError(f"image reference {original!r}: {first!r} is not a registry host")
        registry, remainder = _canonical_host(first), rest
    else:
        registry, remainder = DOCKER_HUB, text
    tag = None
    last_slash = remainder.rfind("/")
    colon = remainder.rfind(":")
    if colon > last_slash:
        remainder, tag = remainder[:colon], remainder[colon + 1 :]
        if not _TAG.match(tag):
            raise ImageError(f"image reference {original!r}: {tag!r} is not a valid tag")
    if registry == DOCKER_HUB and "/" not in remainder:
        remainder = f"library/{remainder}"
    if not _PATH.match(remainder):
        raise ImageError(
            f"image reference {original!r}: {remainder!r} is not a repository name "
            "(lowercase letters, digits and separators)"
        )
    if tag is None and digest is None:
        tag = "latest"
    return Reference(registry, remainder, tag, digest)


def _canonical_host(host: str) -> str:
    host = host.strip().lower().removeprefix("https://").removeprefix("http://").rstrip("/")
    return DOCKER_HUB if host in _HUB_ALIASES else host


def is_loopback_host(host: str) -> bool:
    """``localhost:5000``, ``127.x.y.z:port``, ``[::1]:port``: where plain HTTP may be allowed."""
    name = host.rsplit(":", 1)[0] if not host.startswith("[") else host[1 : host.find("]")]
    return name == "localhost" or name.startswith("127.") or name == "::1"
