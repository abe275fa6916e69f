"""A Python client of ``sequester serve``: one WebSocket connection, one session.

    from sequester.serve.client import SequesterClient

    with SequesterClient("http://127.0.0.1:8000", token) as env:
        env.reset("python-csv-stats")                  # .observation["instruction"]
        env.write_file("/tmp/solve.sh", script)        # str (UTF-8) or bytes (base64)
        print(env.exec("bash /tmp/solve.sh").observation["stdout"])
        print(env.evaluate().reward)                    # 1.0; done is True

:class:`AsyncSequesterClient` is the same with ``await``; :class:`SequesterClient` runs it
on an event loop of its own in a thread, so it can be used from plain code (and from code
that already runs an event loop). The token is ``token``, else ``$SEQUESTER_SERVE_TOKEN``;
it goes in the handshake's ``Authorization: Bearer`` header, as OpenEnv's own client sends
it (``EnvClient(..., headers=...)``).

An ``error`` frame from the server raises :class:`ServerError` with its ``code``
(``VALIDATION_ERROR``, ``CAPACITY_REACHED``, ...); the session goes on unless the server
closed it. Anything that breaks the connection itself (refused handshake, 401, a reply
later than ``message_timeout_s``, the server gone) raises :class:`ClientError`, and the
connection is closed: a late reply would otherwise be read as the answer to the next
request. Long steps are safe with a ``message_timeout_s``: the client asks for the
server's keep-alive ``progress`` frames at reset, each of which restarts the wait, and a
step's own ``timeout`` extends it.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import inspect
import ipaddress
import json
import os
import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from sequester.errors import SequesterError

__all__ = ["AsyncSequesterClient", "SequesterClient", "StepResult", "ServerError", "ClientError"]

TOKEN_ENV = "SEQUESTER_SERVE_TOKEN"
_STEP_SLACK_S = 30.0  # a step with its own timeout may take that long, plus this
_CLOSE_WAIT_S = 30.0  # for the server to close its session (it gives a step that long to give way)


class ServerError(SequesterError):
    """The server answered with an ``error`` frame: ``code`` is OpenEnv's error code."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


class ClientError(SequesterError):
    """No answer could be had: the connection was refused, lost, or timed out (and closed)."""


@dataclass(frozen=True)
class StepResult:
    """An ``observation`` frame's data, as OpenEnv's ``StepResult`` has it."""

    observation: dict[str, Any]
    reward: float | None = None
    done: bool = False


def ws_url(base_url: str) -> str:
    """``http://h:p`` (or ``ws://``, ``https://``, ``wss://``, a bare ``h:p``) → ``ws://h:p/ws``."""
    if "://" not in base_url:
        base_url = "ws://" + base_url
    parts = urlsplit(base_url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    if scheme not in ("ws", "wss"):
        raise ValueError(f"base_url: {parts.scheme!r} is not http, https, ws or wss")
    path = parts.path.rstrip("/")
    if not path.endswith("/ws"):
        path += "/ws"
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))


def _action(kind: str, **fields: Any) -> dict[str, Any]:
    """An action frame's data: the fields that are not ``None``."""
    return {"type": kind, **{k: v for k, v in fields.items() if v is not None}}


def _takes_proxy(connect: Any) -> bool:
    return "proxy" in inspect.signature(connect.__init__).parameters


def _loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class AsyncSequesterClient:
    """One session of ``sequester serve`` (see the module). Not for concurrent use by
    several tasks at once: requests are answered in order, so they are serialized."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        connect_timeout_s: float = 10.0,
        message_timeout_s: float | None = None,
        max_message_size: int = 100 * 1024 * 1024,
    ):
        self.url = ws_url(base_url)
        self._token = token if token is not None else os.environ.get(TOKEN_ENV)
        self.connect_timeout_s, self.message_timeout_s = connect_timeout_s, message_timeout_s
        self.max_message_size = max_message_size
        self._ws: Any = None
        self._closed = False
        self._lock: asyncio.Lock | None = None

    def __repr__(self) -> str:  # never the token
        return f"AsyncSequesterClient({self.url!r})"

    async def connect(self) -> AsyncSequesterClient:
        from websockets.asyncio.client import connect
        from websockets.exceptions import InvalidStatus

        if self._closed:
            raise ClientError("the client is closed (a new session needs a new client)")
        if self._ws is not None:
            return self
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else None
        # websockets >= 15 honours $https_proxy & co.: never for loopback (older: no proxies at all)
        extra: dict[str, Any] = {"proxy": None} if _loopback(self.url) and _takes_proxy(connect) else {}
        try:
            self._ws = await connect(
                self.url,
                additional_headers=headers,
                open_timeout=self.connect_timeout_s,
                max_size=self.max_message_size,
                **extra,
            )
        except InvalidStatus as exc:
            status = exc.response.status_code
            hint = " (a wrong or missing token)" if status == 401 else ""
            raise ClientError(f"{self.url}: the server refused the connection with HTTP {status}{hint}") from None
        except (TimeoutError, OSError) as exc:
            raise ClientError(f"{self.url}: cannot connect: {exc or type(exc).__name__}") from None
        except Exception as exc:  # websockets' handshake errors (InvalidHandshake, InvalidURI, ...)
            raise ClientError(f"{self.url}: cannot connect: {exc}") from None
        return self

    async def __aenter__(self) -> AsyncSequesterClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _drop(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            try:
                await ws.close()
            except Exception:  # noqa: BLE001 - best effort: the connection is going anyway
                pass

    async def _request(self, frame: dict[str, Any], wait_s: float | None = None) -> dict[str, Any]:
        """Send ``frame``; the first reply that is not ``progress``. Error frames raise."""
        from websockets.exceptions import ConnectionClosed

        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            await self.connect()
            if wait_s is None:
                wait_s = self.message_timeout_s
            try:
                await self._ws.send(json.dumps(frame))
            except ConnectionClosed:
                pass  # a refused session sends its error frame, then closes: read it below
            while True:
                try:
                    raw = await asyncio.wait_for(self._ws.recv(), wait_s)
                except asyncio.CancelledError:  # its reply would be read as the next request's
                    ws, self._ws = self._ws, None
                    asyncio.ensure_future(ws.close())
                    raise
                except TimeoutError:
                    await self._drop()
                    raise ClientError(
                        f"no reply in {wait_s:g} s to a {frame['type']!r} frame; the connection "
                        "was closed (its session is gone)"
                    ) from None
                except ConnectionClosed as exc:
                    self._ws = None
                    reason = f" ({' '.join(map(str, (exc.rcvd.code, exc.rcvd.reason))).strip()})" if exc.rcvd else ""
                    raise ClientError(f"the server closed the connection{reason}") from None
                try:
                    reply = json.loads(raw)
                    kind, data = reply["type"], reply.get("data") or {}
                except (ValueError, TypeError, KeyError):
                    await self._drop()
                    raise ClientError("the server sent a frame that is not a JSON object with a type") from None
                if kind == "progress":
                    continue  # a keep-alive while a long step runs: wait on
                if kind == "error":
                    raise ServerError(str(data.get("code", "UNKNOWN")), str(data.get("message", "")))
                return reply

    async def _observe(self, frame: dict[str, Any], wait_s: float | None = None) -> StepResult:
        reply = await self._request(frame, wait_s)
        if reply["type"] != "observation":
            await self._drop()
            raise ClientError(f"expected an observation frame, got {str(reply['type'])[:40]!r}")
        data = reply.get("data") or {}
        return StepResult(data.get("observation") or {}, data.get("reward"), bool(data.get("done", False)))

    def _wait_for(self, timeout: float | None) -> float | None:
        if self.message_timeout_s is None or timeout is None:
            return self.message_timeout_s
        return max(self.message_timeout_s, timeout + _STEP_SLACK_S)

    async def reset(self, task: str | None = None, kind: str = "episode", **extra: Any) -> StepResult:
        """Start the session: an episode of ``task`` (an id under the server's tasks
        folder), a fork of a checkpoint (``checkpoint=ID``, no task), or with
        ``kind="kernel"`` a kernel. ``extra`` goes in the frame as is."""
        data: dict[str, Any] = dict(extra)
        if kind == "kernel":
            data["kind"] = "kernel"
        elif kind == "episode":
            if not task and "checkpoint" not in data:
                raise ValueError("reset: an episode needs a task id (or checkpoint=ID, a fork of one)")
            if task:
                data["task"] = task
        else:
            raise ValueError(f"reset: kind {kind!r} is not 'episode' or 'kernel'")
        if self.message_timeout_s is not None:
            data.setdefault("progress", True)  # keep-alives restart the wait during long steps
        return await self._observe({"type": "reset", "data": data})

    async def step(self, action: dict[str, Any], wait_s: float | None = None) -> StepResult:
        """Any action, as a dict (``{"type": "exec", "command": ...}``)."""
        return await self._observe({"type": "step", "data": action}, wait_s)

    async def exec(self, command: str, timeout: float | None = None) -> StepResult:
        """A command in the episode's shell: ``stdout``, ``stderr``, ``exit_code``, ``timed_out``."""
        return await self.step(_action("exec", command=command, timeout=timeout), self._wait_for(timeout))

    async def write_file(self, path: str, content: str | bytes, mode: int | None = None) -> StepResult:
        """``content`` into ``path``: text as UTF-8, bytes exactly (base64 on the wire)."""
        if isinstance(content, str):
            return await self.step(_action("write_file", path=path, content=content, mode=mode))
        return await self.step(
            _action(
                "write_file", path=path, content=base64.b64encode(content).decode("ascii"), encoding="base64", mode=mode
            )
        )

    async def read_file(self, path: str, limit: int | None = None) -> bytes:
        """The file's bytes (its first ``limit`` bytes if given)."""
        result = await self.step(_action("read_file", path=path, encoding="base64", limit=limit))
        return base64.b64decode(result.observation.get("content", ""))

    async def evaluate(self) -> StepResult:
        """The verdict: ``reward``, ``done=True``, ``observation["verifier"]`` (structured)."""
        return await self.step({"type": "evaluate"})

    async def checkpoint(self) -> StepResult:
        """Seal the episode's files: ``observation["checkpoint"]`` is its id (fork it from
        another session with ``reset(checkpoint=ID)``), ``not_restored`` what did not come back."""
        return await self.step({"type": "checkpoint"})

    async def rollback(self, checkpoint: str) -> StepResult:
        """Start the episode again on ``checkpoint``."""
        return await self.step({"type": "rollback", "checkpoint": checkpoint})

    async def release(self, checkpoint: str) -> StepResult:
        """Let ``checkpoint`` go (it goes with its session's close anyway)."""
        return await self.step({"type": "release", "checkpoint": checkpoint})

    async def cell(self, code: str, timeout: float | None = None) -> StepResult:
        """A code cell in a kernel session: ``stdout``, ``value``, ``error``, ..."""
        return await self.step(_action("cell", code=code, timeout=timeout), self._wait_for(timeout))

    async def state(self) -> dict[str, Any]:
        """The session's state (``session_id``, ``kind``, ``task``, ``steps``, ``done``, ...)."""
        reply = await self._request({"type": "state"})
        return reply.get("data") or {}

    async def close(self) -> None:
        """End the session and the connection. Returns once the server has closed the
        connection, which it does after the session's episode or kernel is gone (at most
        ``_CLOSE_WAIT_S``): so its slot is free again, and a new session can take it."""
        if self._closed:
            return
        self._closed = True
        if self._ws is not None:
            try:
                await self._ws.send(json.dumps({"type": "close"}))
                await asyncio.wait_for(self._ws.wait_closed(), _CLOSE_WAIT_S)
            except Exception:  # noqa: BLE001 - gone already, or slow: closed from here
                pass
            await self._drop()


def _blocking(name: str) -> Any:
    method = getattr(AsyncSequesterClient, name)

    @functools.wraps(method)
    def call(self: SequesterClient, *args: Any, **kwargs: Any) -> Any:
        return self._run(getattr(self._client, name)(*args, **kwargs))

    return call


class SequesterClient:
    """:class:`AsyncSequesterClient` for plain code: the same methods, blocking. Runs the
    connection on an event loop in a thread of its own (stopped by :meth:`close`)."""

    def __init__(self, base_url: str, token: str | None = None, **options: Any):
        self._client = AsyncSequesterClient(base_url, token, **options)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sequester-client", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"SequesterClient({self._client.url!r})"

    def _run(self, coro: Any) -> Any:
        if not self._thread.is_alive():
            coro.close()
            raise ClientError("the client is closed (a new session needs a new client)")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:  # Ctrl-C: the request is abandoned (and its connection closed)
            future.cancel()
            raise

    reset = _blocking("reset")
    step = _blocking("step")
    exec = _blocking("exec")
    write_file = _blocking("write_file")
    read_file = _blocking("read_file")
    evaluate = _blocking("evaluate")
    checkpoint = _blocking("checkpoint")
    rollback = _blocking("rollback")
    release = _blocking("release")
    cell = _blocking("cell")
    state = _blocking("state")

    def connect(self) -> SequesterClient:
        self._run(self._client.connect())
        return self

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        try:
            self._run(self._client.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> SequesterClient:
        try:
            return self.connect()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
