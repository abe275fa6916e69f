"""Registry credentials for skopeo, never on a command line and never logged.

Where they come from, first match wins per registry:

1. the environment: ``SEQUESTER_REGISTRY_USERNAME`` and ``SEQUESTER_REGISTRY_PASSWORD``
   (for the registry ``SEQUESTER_REGISTRY_HOST`` names, or every registry when it is unset);
2. ``$REGISTRY_AUTH_FILE``, else ``$DOCKER_CONFIG/config.json``, else ``~/.docker/config.json``
   (Docker's format: ``auths``, ``credHelpers``, ``credsStore``; skopeo reads it).

skopeo gets one file with ``--authfile``: the user's, or a private copy (mode 0600, in a
folder only we can enter, removed afterwards) with the environment's entry added, or an
empty private one when there are no credentials. Always a file of our choosing: left to
itself, skopeo also reads ``$XDG_RUNTIME_DIR/containers/auth.json`` or, without that
variable, ``/run/containers/UID/auth.json``, and fails outright when root's podman made
``/run/containers`` 0700. Passing ``--src-creds user:password`` instead would show the
password to every local user in ``/proc/PID/cmdline``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

from sequester.errors import ImageError

__all__ = ["authfile_for", "user_authfile"]

_LIMIT = 1 << 20  # a config.json larger than this is not one


def user_authfile(env: Mapping[str, str] | None = None) -> Path | None:
    env = os.environ if env is None else env
    for candidate in (
        env.get("REGISTRY_AUTH_FILE"),
        (Path(env["DOCKER_CONFIG"]) / "config.json") if env.get("DOCKER_CONFIG") else None,
        Path(env.get("HOME") or Path.home()) / ".docker" / "config.json",
    ):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


@contextlib.contextmanager
def authfile_for(registry: str, env: Mapping[str, str] | None = None) -> Iterator[Path]:
    """The file to pass as ``--authfile`` for ``registry`` (an empty one: anonymous)."""
    env = os.environ if env is None else env
    user, password = env.get("SEQUESTER_REGISTRY_USERNAME"), env.get("SEQUESTER_REGISTRY_PASSWORD")
    host = env.get("SEQUESTER_REGISTRY_HOST")
    existing = user_authfile(env)
    wanted = bool(user and password) and not (host and host != registry)
    if existing is not None and not wanted:
        yield existing
        return
    data: dict = {}
    if existing is not None:
        try:
            with open(existing, "rb") as f:
                raw = f.read(_LIMIT + 1)
            if len(raw) > _LIMIT:
                raise ValueError("larger than 1 MiB")
            data = json.loads(raw)
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:
            raise ImageError(f"registry credentials: {existing} cannot be read: {exc}") from None
    auths = data.setdefault("auths", {})
    if not isinstance(auths, dict):
        raise ImageError(f"registry credentials: 'auths' in {existing} is not an object")
    if wanted:
        auths[registry] = {"auth": base64.b64encode(f"{user}:{password}".encode()).decode()}
    private = tempfile.mkdtemp(prefix="sequester-auth-")  # mode 0700
    try:
        path = Path(private) / "auth.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        yield path
    finally:
        shutil.rmtree(private, ignore_errors=True)
