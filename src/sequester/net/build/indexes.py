"""The package indexes this machine is configured to use: the ``host:port`` of each.

Read from the host's own files and environment (pip's configuration files, the pip and
uv variables, apt's sources), never from a Dockerfile: :mod:`.network` lets a build
reach exactly these hosts even when they are private (an operator's mirror on 10.x).
Kept apart from the policy because it is a different concern, file discovery and parsing,
with nothing of the address checks in it.
"""

from __future__ import annotations

import configparser
import logging
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from urllib.parse import urlsplit

from sequester.net.addresses import normalize_host

__all__ = ["apt_source_files", "index_hosts", "pip_config_files"]

log = logging.getLogger("sequester.net")

_PIP_KEYS = ("index-url", "extra-index-url", "find-links")
_ENV_URLS = (
    "PIP_INDEX_URL",
    "PIP_EXTRA_INDEX_URL",
    "PIP_FIND_LINKS",
    "UV_INDEX_URL",
    "UV_DEFAULT_INDEX",
    "UV_EXTRA_INDEX_URL",
    "UV_INDEX",
    "UV_FIND_LINKS",
)


def pip_config_files(env: Mapping[str, str]) -> list[Path]:
    """Where pip looks: site-wide (XDG dirs, /etc/pip.conf), the user's, $PIP_CONFIG_FILE."""
    home = Path(env.get("HOME") or os.path.expanduser("~"))
    xdg_dirs = [Path(d) / "pip" / "pip.conf" for d in (env.get("XDG_CONFIG_DIRS") or "/etc/xdg").split(":") if d]
    named = env.get("PIP_CONFIG_FILE") or os.devnull
    return [
        *xdg_dirs,
        Path("/etc/pip.conf"),
        home / ".pip" / "pip.conf",
        Path(env.get("XDG_CONFIG_HOME") or home / ".config") / "pip" / "pip.conf",
        *([Path(named)] if named != os.devnull else []),
    ]


def apt_source_files(root: Path = Path("/etc/apt")) -> list[Path]:
    parts = root / "sources.list.d"
    return [root / "sources.list", *sorted(parts.glob("*.list")), *sorted(parts.glob("*.sources"))]


def index_hosts(
    *,
    env: Mapping[str, str] | None = None,
    pip_files: Iterable[Path] | None = None,
    apt_files: Iterable[Path] | None = None,
) -> frozenset[str]:
    """``host:port`` of every http(s) package index configured for pip, uv and apt here
    (file:// and other schemes ignored; unreadable or malformed files skipped)."""
    env = os.environ if env is None else env
    urls: list[str] = []
    for path in pip_config_files(env) if pip_files is None else pip_files:
        urls += _pip_urls(Path(path))
    for key in _ENV_URLS:
        # UV_INDEX entries may be NAME=URL.
        urls += [u.split("=", 1)[1] if "=" in u.split("://", 1)[0] else u for u in env.get(key, "").split()]
    for path in apt_source_files() if apt_files is None else apt_files:
        urls += _apt_urls(Path(path))
    return frozenset(filter(None, map(_host_port, urls)))


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except (OSError, ValueError):  # missing, unreadable, a directory: no indexes from it
        return ""


def _pip_urls(path: Path) -> list[str]:
    parser = configparser.RawConfigParser()
    try:
        parser.read_string(_read(path), source=str(path))
    except configparser.Error as exc:
        log.debug("index hosts: %s is not a valid pip configuration: %s", path, exc)
        return []
    return [
        url
        for section in parser.sections()
        for key, value in parser.items(section)
        if key.replace("_", "-") in _PIP_KEYS
        for url in value.split()
    ]


def _apt_urls(path: Path) -> list[str]:
    text = _read(path)
    if path.suffix != ".sources":  # one-line style: deb [options] URI suite [components]
        return [
            m.group(1)
            for line in text.splitlines()
            if (m := re.match(r"\s*deb(?:-src)?\s+(?:\[[^\]]*\]\s*)?(\S+)", line))
        ]
    urls: list[str] = []
    for stanza in re.split(r"\n\s*\n", text):  # deb822: the URIs: field (continued on indented lines)
        stanza = "\n".join(line for line in stanza.splitlines() if not line.startswith("#"))
        if not re.search(r"(?im)^enabled:\s*no\s*$", stanza) and (
            found := re.search(r"(?im)^uris:(.*(?:\n[ \t].*)*)", stanza)
        ):
            urls += found.group(1).split()
    return urls


def _host_port(url: str) -> str | None:
    try:
        parts = urlsplit(url.strip())
        host, port, scheme = parts.hostname, parts.port, parts.scheme.lower()
    except ValueError:
        return None
    if scheme not in ("http", "https") or not host:
        return None
    host = normalize_host(host)
    return f"{f'[{host}]' if ':' in host else host}:{port or (443 if scheme == 'https' else 80)}"
