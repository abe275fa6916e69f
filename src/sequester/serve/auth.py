"""The bearer token of ``sequester serve``: where it comes from, and the guard that checks it.

Sources, first found wins: ``--token-file F`` (its first line), ``$SEQUESTER_SERVE_TOKEN``,
the config file's ``[serve] token``; else one is generated (``secrets.token_urlsafe(32)``)
and printed once at start. Every request but ``GET /health`` must carry
``Authorization: Bearer <token>``, the HTTP requests and the WebSocket handshake alike
(the real ``openenv`` client sends it with ``EnvClient(..., headers={...})``). There is no
``?token=`` form: a query string is logged by proxies and access logs, and OpenEnv's
client cannot set one anyway (it appends ``/ws`` to the base URL).
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sequester.errors import PolicyError
from sequester.serve.serve_settings import ServeSettings, check_token

__all__ = ["Token", "load_token", "TokenGuard", "TOKEN_ENV", "PUBLIC_PATHS"]

TOKEN_ENV = "SEQUESTER_SERVE_TOKEN"
PUBLIC_PATHS = frozenset({"/health"})  # OpenEnv's readiness probe: nothing in it to protect
_MAX_TOKEN_FILE = 4096

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class Token:
    value: str
    source: str  # "--token-file PATH", "$SEQUESTER_SERVE_TOKEN", "config", "generated"
    file: Path | None = None  # hidden from every episode's agent

    @property
    def generated(self) -> bool:
        return self.source == "generated"

    def __repr__(self) -> str:  # never the value: a repr ends up in logs and tracebacks
        return f"Token(source={self.source!r})"


def load_token(
    token_file: str | os.PathLike[str] | None, settings: ServeSettings, environ: dict[str, str] | None = None
) -> Token:
    """The token from the first source that has one (see the module), checked for length
    and characters; a bad one is a :class:`PolicyError` (exit 2) naming its source."""
    env = os.environ if environ is None else environ
    if token_file is not None:
        path = Path(token_file)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK)  # a FIFO must not hang the start
            try:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode):
                    raise PolicyError(f"--token-file {str(path)!r}: not a regular file")
                data = os.read(fd, _MAX_TOKEN_FILE + 1)
            finally:
                os.close(fd)
        except OSError as exc:
            raise PolicyError(f"--token-file {str(path)!r}: {exc.strerror}") from None
        if len(data) > _MAX_TOKEN_FILE:
            raise PolicyError(f"--token-file {str(path)!r}: larger than {_MAX_TOKEN_FILE} bytes: not a token file")
        lines = data.decode("utf-8", "replace").splitlines()
        value = lines[0].strip() if lines else ""
        return Token(check_token(value, f"--token-file {str(path)!r}"), f"--token-file {path}", path.resolve())
    if env.get(TOKEN_ENV):
        return Token(check_token(env[TOKEN_ENV], f"${TOKEN_ENV}"), f"${TOKEN_ENV}")
    if settings.token is not None:
        return Token(settings.token, "config")
    return Token(secrets.token_urlsafe(32), "generated")


def _credential(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The credential of the one ``Authorization: Bearer`` header, else ``None``."""
    values = [v for k, v in headers if k.lower() == b"authorization"]
    if len(values) != 1:  # none, or several (which one would a proxy have checked?)
        return None
    scheme, _, credential = values[0].strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return credential.strip()


class TokenGuard:
    """ASGI middleware: every HTTP request and WebSocket handshake but :data:`PUBLIC_PATHS`
    carries the token, or is answered 401 before the app sees it.

    Attack stopped: any local process (another user's, an agent's escaping through a
    forwarded port, a web page doing DNS rebinding against 127.0.0.1) driving episodes and
    kernels, or reading state, without the token. The comparison is
    :func:`hmac.compare_digest` on bytes, so the time a wrong guess takes says nothing of
    how much of it was right; a guess is never logged.
    """

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], token: str):
        self.app = app
        self._token = token.encode("ascii")

    def authorized(self, scope: Scope) -> bool:
        credential = _credential(scope.get("headers") or [])
        # compare_digest is constant-time in the content; a wrong length returns at once,
        # which reveals only the length (all generated tokens have the same one).
        return credential is not None and hmac.compare_digest(credential, self._token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        public = scope["type"] == "http" and scope.get("path") in PUBLIC_PATHS
        if scope["type"] not in ("http", "websocket") or public:
            await self.app(scope, receive, send)
            return
        if self.authorized(scope):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"detail": "a valid 'Authorization: Bearer <token>' header is required"}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"www-authenticate", b'Bearer realm="sequester"'),
            (b"content-length", str(len(body)).encode()),
        ]
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 401, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        message = await receive()  # websocket.connect
        if message.get("type") != "websocket.connect":
            return
        if "websocket.http.response" in (scope.get("extensions") or {}):
            # The handshake itself is refused with 401 (the client sees the status).
            await send({"type": "websocket.http.response.start", "status": 401, "headers": headers})
            await send({"type": "websocket.http.response.body", "body": body})
        else:  # a server without the denial-response extension: 403, the one refusal ASGI has
            await send({"type": "websocket.close", "code": 4401, "reason": "unauthorized"})
