"""The FastAPI app of ``sequester serve``: OpenEnv's HTTP endpoints and its WebSocket.

    GET  /health     {"status": "healthy"}                      (no token: a readiness probe)
    GET  /metadata   name, description, readme_content, version, author, documentation_url
    GET  /schema     {"action", "observation", "state"}: JSON schemas of what /ws carries
    GET  /state      the server's state (sessions active / max, tasks)
    POST /reset      OpenEnv's stateless reset: a throw-away session, closed at once
    POST /step       400: a step needs a session, and sessions live on the WebSocket
    WS   /ws         one session per connection (see :mod:`.connection`)

Every route but ``/health`` is behind :class:`~.auth.TokenGuard`. FastAPI's own ``/docs``
and ``/openapi.json`` are off (``/schema`` is the description a client needs, and every
route more is surface). Request bodies are read here, bounded, and parsed by
:mod:`.protocol`, so a body is never larger than ``max_message_bytes`` in memory and a
malformed one is a 422 naming the field, never a 500.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sequester import __version__
from sequester.serve import protocol
from sequester.serve.auth import TokenGuard, load_token
from sequester.serve.connection import Connection
from sequester.serve.serve_settings import ServeSettings
from sequester.serve.sessions import SessionManager, log_event

if TYPE_CHECKING:
    from sequester.config import Config

__all__ = ["create_app", "count_tasks", "uvicorn_config"]

DESCRIPTION = (
    "Terminal-Bench 2 / Harbor task episodes in sandboxes, scored by verifiers the agent cannot reach, "
    "and isolated Python kernels, over OpenEnv's protocol."
)
README = """# sequester

One WebSocket connection to `/ws` is one session.

* Episode: `{"type": "reset", "data": {"task": "<task>"}}`, then steps with `exec`, `write_file`, `read_file`,
  and `evaluate` (the verdict: reward, done).
* Kernel: `{"type": "reset", "data": {"kind": "kernel"}}`, then `cell` steps.

`GET /schema` has the actions and observations. Every endpoint but `/health` needs
`Authorization: Bearer <token>`.
"""


class ServerState(BaseModel):
    """``GET /state``: the server's, not a session's (HTTP has no session)."""

    sessions_active: int
    sessions_max: int
    connections: int
    tasks: int
    idle_timeout_s: float
    max_message_bytes: int
    image_source: str
    version: str


class EnvironmentMetadata(BaseModel):
    """``GET /metadata``: OpenEnv's ``EnvironmentMetadata`` fields."""

    name: str
    description: str
    readme_content: str | None = None
    version: str | None = None
    author: str | None = None
    documentation_url: str | None = None


class _StepRequest(BaseModel):
    """OpenEnv's ``StepRequest``: checked so that a malformed one is told which field is wrong."""

    model_config = ConfigDict(extra="forbid", strict=True)
    action: dict[str, Any]
    timeout_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    request_id: str | None = Field(default=None, max_length=255)


def _status(exc: protocol.FrameError) -> int:
    """The HTTP status of a refusal: 413 too large, 400 not JSON, 500 a task that cannot be
    loaded (the operator's), else 422 (a field is wrong; the message names it)."""
    if isinstance(exc, _TooLarge):
        return 413
    return {protocol.ErrorCode.INVALID_JSON: 400, protocol.ErrorCode.FACTORY_ERROR: 500}.get(exc.code, 422)


def _refusal(status: int, code: protocol.ErrorCode, message: str) -> JSONResponse:
    return JSONResponse({"detail": message, "code": code.value}, status_code=status)


class _TooLarge(protocol.FrameError):
    """A body over the limit: answered 413."""


async def _body(request: Request, limit: int) -> Any:
    """The request's JSON, read at most ``limit`` bytes far.

    Attack stopped: a POST whose body (declared or chunked) is gigabytes, which Starlette
    would read whole into memory before any route saw it."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise _TooLarge(protocol.ErrorCode.VALIDATION_ERROR, f"body: larger than {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _TooLarge(protocol.ErrorCode.VALIDATION_ERROR, f"body: larger than {limit} bytes")
        chunks.append(chunk)
    data = b"".join(chunks)
    if not data.strip():
        return {}
    return protocol.parse_json(data)


class _DenialIsNotAnError(logging.Filter):
    """uvicorn's WebSocket protocols log "ASGI callable returned without completing
    handshake" after a handshake refused with a denial response (the 401 of
    :class:`~.auth.TokenGuard`), which is the refusal working, not an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "ASGI callable returned without completing handshake."


_DENIAL_FILTER = _DenialIsNotAnError()


def count_tasks(tasks_dir: Path | None, depth: int = 3) -> int:
    """How many tasks the folder serves: the folders holding a ``task.toml``, at most
    ``depth`` levels down (hidden ones and links left out), each loaded, so that a malformed
    one fails at start rather than in a client's reset."""
    if tasks_dir is None:
        return 0
    from sequester.tasks import load_task
    from sequester.tasks.finder import served_task_folders

    count = 0
    for folder in served_task_folders(Path(tasks_dir), depth):
        load_task(folder)
        count += 1
    return count


def create_app(
    config: Config, *, token: str | None = None, hide: tuple[Path, ...] = (), tasks: int | None = None
) -> FastAPI:
    """The app serving ``config`` (its ``[serve]`` settings, its episode settings and
    ``[images] source``, its kernel policy). ``token``: the bearer token (default: from
    ``$SEQUESTER_SERVE_TOKEN`` or ``[serve] token``, else generated: ``app.state.token``).
    ``hide``: more paths no agent may see. ``tasks``: the task count, if already known."""
    settings = config.serve
    logging.getLogger("uvicorn.error").addFilter(_DENIAL_FILTER)  # once: a filter is added only if absent
    if token is None:
        token = load_token(None, settings).value
    manager = SessionManager(config, hide=hide, tasks=count_tasks(settings.tasks_dir) if tasks is None else tasks)
    limit = settings.max_message_bytes

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await manager.close_all()  # graceful shutdown (SIGTERM): every session closed

    app = FastAPI(
        title="sequester", version=__version__, docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    app.state.manager, app.state.token = manager, token

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "healthy"}

    @app.get("/metadata")
    async def metadata() -> dict[str, Any]:
        return EnvironmentMetadata(
            name="sequester",
            description=DESCRIPTION,
            readme_content=README,
            version=__version__,
            author="sequester",
            documentation_url=None,
        ).model_dump()

    @app.get("/schema")
    async def schema() -> dict[str, Any]:
        return protocol.schemas()

    @app.get("/state")
    async def state() -> dict[str, Any]:
        return ServerState(
            sessions_active=manager.active,
            sessions_max=manager.max_sessions,
            connections=len(manager.connections),
            tasks=manager.task_count,
            idle_timeout_s=settings.idle_timeout,
            max_message_bytes=limit,
            image_source=config.episodes.images.source,
            version=__version__,
        ).model_dump()

    @app.post("/reset")
    async def reset(request: Request) -> JSONResponse:
        """Stateless, as OpenEnv's HTTP reset is: the session starts (so the task is checked
        and can run here) and is closed before the answer; steps need the WebSocket."""
        try:
            body = await _body(request, limit)
            if not isinstance(body, dict):
                raise protocol.FrameError(protocol.ErrorCode.VALIDATION_ERROR, "body: not a JSON object")
            reset_request = protocol.parse_reset(body, where="body")
            if not manager.try_acquire():
                return _refusal(
                    503, protocol.ErrorCode.CAPACITY_REACHED, f"all {manager.max_sessions} sessions are in use"
                )
            try:
                try:
                    session = manager.new_session(secrets.token_hex(8), reset_request, where="body")
                except protocol.FrameError:
                    raise
                except Exception as exc:  # noqa: BLE001 - as a start that failed
                    return _refusal(500, protocol.ErrorCode.FACTORY_ERROR, f"the session could not be made: {exc}")
                try:
                    observation = await session.start()
                except Exception as exc:  # noqa: BLE001 - an image that cannot be had, a sandbox that did not start
                    return _refusal(500, protocol.ErrorCode.FACTORY_ERROR, f"the {session.kind} could not start: {exc}")
                finally:
                    await session.close()
            finally:
                manager.release()
        except protocol.FrameError as exc:
            return _refusal(_status(exc), exc.code, exc.message)
        log_event("http_reset", session=session.id, kind=session.kind, task=session.task)
        return JSONResponse({"observation": observation.model_dump(mode="json"), "reward": None, "done": False})

    @app.post("/step")
    async def step(request: Request) -> JSONResponse:
        try:
            body = await _body(request, limit)
            if not isinstance(body, dict):
                raise protocol.FrameError(protocol.ErrorCode.VALIDATION_ERROR, "body: not a JSON object")
            try:
                checked = _StepRequest.model_validate(body)
            except ValidationError as exc:
                raise protocol.FrameError(
                    protocol.ErrorCode.VALIDATION_ERROR, protocol.error_text(exc, "body")
                ) from None
            protocol.parse_action(checked.action, where="body.action")
        except protocol.FrameError as exc:
            return _refusal(_status(exc), exc.code, exc.message)
        return _refusal(
            400,
            protocol.ErrorCode.SESSION_ERROR,
            "a step needs a session, and plain HTTP has none: open the WebSocket /ws, send a reset, then step there",
        )

    @app.websocket("/ws")
    async def ws(websocket: WebSocket) -> None:
        await Connection(websocket, manager).run()

    app.add_middleware(TokenGuard, token=token)
    return app


def uvicorn_config(app: FastAPI, settings: ServeSettings, *, access_log: bool = False) -> Any:
    """How uvicorn serves ``app`` (the CLI's and the tests' servers alike)."""
    import uvicorn

    return uvicorn.Config(
        # websockets-sansio: pings (half-open connections are found) and 401 handshake refusals.
        # ws_max_size: a larger message closes its connection with 1009 (attack stopped: a
        # client making the server hold a message of gigabytes in memory).
        # No permessage-deflate: zlib on every frame was most of a step's CPU in the server
        # (measured: benchmarks/serve_bench.py), for frames that are small or already dense.
        app,
        ws="websockets-sansio",
        ws_max_size=settings.max_message_bytes,
        ws_per_message_deflate=False,
        ws_ping_interval=settings.ping_interval,
        ws_ping_timeout=settings.ping_timeout,
        # Connections beyond this are answered 503 before any app code runs (a flood of
        # handshakes cannot take all of the process's file descriptors).
        limit_concurrency=max(64, 4 * settings.max_sessions + 16),
        lifespan="on",
        timeout_graceful_shutdown=60,
        server_header=False,
        access_log=access_log,
        log_level="warning",
    )
