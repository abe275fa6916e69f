"""One WebSocket connection of ``sequester serve``: its frames, its session, its end.

A connection reads one frame at a time and answers each (OpenEnv's clients send a frame
and wait for its answer). While a step runs it keeps listening, so that a client that goes
away mid-step (a closed socket, or a half-open one the server's pings find) has its session
closed and its processes killed at once rather than when a 10-minute command ends; a frame
that arrives meanwhile is held and answered after the step (one frame at most: the server
reads no more until then, so a flooding client is held back by TCP, not buffered).

Idle connections (no frame and no step for ``idle_timeout``) are closed with code 4000
and their session with them. Every exception of a session's call is that frame's
``EXECUTION_ERROR``; nothing of one connection reaches another.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.types import Message
from starlette.websockets import WebSocket, WebSocketDisconnect

from sequester.serve import protocol
from sequester.serve.sessions import Session, SessionManager, log_event

__all__ = ["Connection", "IDLE_CLOSE_CODE"]

log = logging.getLogger("sequester.serve")

T = TypeVar("T")
IDLE_CLOSE_CODE = 4000
_MESSAGE_CHARS = 4000  # an error message (an exception's text) is cut here


class _Gone(Exception):
    """The client went away (or the server is shutting down): end the connection."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Connection:
    def __init__(self, ws: WebSocket, manager: SessionManager):
        self.ws, self.manager = ws, manager
        self.settings = manager.settings
        self.session: Session | None = None
        self.progress = False
        self._receiver: asyncio.Future[Message] | None = None
        self._held: Message | None = None
        self._task: asyncio.Task[Any] | None = None
        self._ended_by: str | None = None

    # -- the loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        self._task = asyncio.current_task()
        await self.ws.accept()
        self.manager.connections.add(self)
        reason = "client closed"
        try:
            while True:
                message = await self._next(self.settings.idle_timeout)
                if message is None:
                    reason = f"idle for {self.settings.idle_timeout:g} s"
                    await self._close_ws(IDLE_CLOSE_CODE, reason)
                    break
                if message["type"] == "websocket.disconnect":
                    reason = f"disconnected ({message.get('code', 1006)})"
                    break
                if not await self._handle(message):
                    break
        except _Gone as gone:
            reason = gone.reason
        except asyncio.CancelledError:
            reason = self._ended_by or "cancelled"
            raise
        except Exception:  # noqa: BLE001 - this connection ends; the server and the others go on
            log.exception("connection failed")
            reason = "server error"
        finally:
            self.manager.connections.discard(self)
            if self._receiver is not None:
                self._receiver.cancel()
            await self._end_session(reason)
            await self._close_ws(1000, "")

    async def shutdown(self) -> None:
        """Server shutdown: end the loop (its ``finally`` closes the session) and wait for it."""
        self._ended_by = "server shutdown"
        task = self._task
        if task is not None and not task.done():
            task.cancel()  # its finally closes the session: a step in flight is killed first
            await asyncio.wait([task], timeout=60)

    async def _next(self, timeout: float | None) -> Message | None:
        """The next ASGI message (``None``: ``timeout`` passed without one)."""
        if self._held is not None:
            message, self._held = self._held, None
            return message
        if self._receiver is None:
            self._receiver = asyncio.ensure_future(self.ws.receive())
        done, _ = await asyncio.wait({self._receiver}, timeout=timeout)
        if not done:
            return None
        return self._take_received()

    def _take_received(self) -> Message:
        assert self._receiver is not None
        receiver, self._receiver = self._receiver, None
        try:
            return receiver.result()
        except Exception:  # noqa: BLE001 - receive() after the peer went: the same as a disconnect
            return {"type": "websocket.disconnect", "code": 1006}

    async def _watched(self, work: Awaitable[T]) -> T:
        """Await ``work`` while watching the client: a disconnect ends the connection
        (:class:`_Gone`; the session's close then kills what runs), and with ``progress``
        a ``progress`` frame goes out every ``progress_interval`` seconds."""
        job = asyncio.ensure_future(work)
        started = time.monotonic()
        interval = self.settings.progress_interval if self.progress else None
        try:
            while True:
                waiting: set[asyncio.Future[Any]] = {job}
                if self._held is None:
                    if self._receiver is None:
                        self._receiver = asyncio.ensure_future(self.ws.receive())
                    waiting.add(self._receiver)
                done, _ = await asyncio.wait(waiting, timeout=interval, return_when=asyncio.FIRST_COMPLETED)
                if job in done:
                    return job.result()
                if self._receiver is not None and self._receiver in done:
                    message = self._take_received()
                    if message["type"] == "websocket.disconnect":
                        raise _Gone(f"disconnected during a step ({message.get('code', 1006)})")
                    self._held = message  # answered after this step
                if not done:
                    await self._send(protocol.progress_frame(time.monotonic() - started))
        finally:
            if not job.done():  # the connection ends first: nobody will read the result
                job.add_done_callback(lambda f: f.cancelled() or f.exception())

    # -- frames ---------------------------------------------------------------------------

    async def _handle(self, message: Message) -> bool:
        """Answer one message; ``False``: the client asked to close."""
        text = message.get("text")
        if text is None:
            # Binary frames carry nothing of this protocol; refused rather than guessed at.
            await self._error(
                protocol.ErrorCode.INVALID_JSON, "binary frames are not accepted: send JSON as a text frame"
            )
            return True
        try:
            frame = protocol.parse_frame(text)
            if frame.type == "close":
                return False
            if frame.type == "state":
                state = self.session.state() if self.session is not None else protocol.SessionState()
                await self._send(protocol.state_frame(state))
            elif frame.type == "reset":
                await self._reset(frame.data)
            else:
                await self._step(frame.data)
        except protocol.FrameError as exc:
            await self._error(exc.code, exc.message)
        return True

    async def _reset(self, data: dict[str, Any]) -> None:
        request = protocol.parse_reset(data)
        acquired = self.session is None  # else the new session takes over this connection's slot
        if acquired and not self.manager.try_acquire():
            log_event("refused", reason="capacity", active=self.manager.active, max=self.manager.max_sessions)
            raise protocol.FrameError(
                protocol.ErrorCode.CAPACITY_REACHED,
                f"all {self.manager.max_sessions} sessions are in use; try again later",
            )
        session_id = secrets.token_hex(8)
        started = time.monotonic()
        try:
            session = self.manager.new_session(session_id, request)  # a task that cannot be named: the old one goes on
        except BaseException as exc:
            if acquired:
                self.manager.release()
            if isinstance(exc, Exception) and not isinstance(exc, protocol.FrameError):
                raise protocol.FrameError(
                    protocol.ErrorCode.FACTORY_ERROR, _cut(f"the session could not be made: {exc}")
                ) from None
            raise
        await self._end_session("reset", release=False)
        self.progress = request.progress
        try:
            observation = await self._watched(session.start())
        except BaseException as exc:  # the client went, the server is shutting down, or it did not start
            await session.close()
            self.manager.release()
            if not isinstance(exc, Exception) or isinstance(exc, _Gone):
                raise
            log_event(
                "factory_error",
                session=session_id,
                kind=session.kind,
                task=session.task,
                duration_ms=_ms(started),
                error=_cut(str(exc), 500),
            )
            raise protocol.FrameError(
                protocol.ErrorCode.FACTORY_ERROR, _cut(f"the {session.kind} could not start: {exc}")
            ) from None
        self.session = session
        log_event("reset", session=session_id, kind=session.kind, task=session.task, duration_ms=_ms(started))
        await self._send(protocol.observation_frame(observation))

    async def _step(self, data: dict[str, Any]) -> None:
        action = protocol.parse_action(data)
        session = self.session
        if session is None:
            raise protocol.FrameError(protocol.ErrorCode.SESSION_ERROR, "no session: send a reset first")
        if action.type not in session.actions:
            raise protocol.FrameError(
                protocol.ErrorCode.SESSION_ERROR,
                f"this {session.kind} session takes {', '.join(sorted(session.actions))} actions, not {action.type!r}",
            )
        if session.done:
            raise protocol.FrameError(
                protocol.ErrorCode.SESSION_ERROR, "the episode is done (it was evaluated): reset to start another"
            )
        started = time.monotonic()
        try:
            observation, reward, done = await self._watched(session.step(action))
        except (_Gone, protocol.FrameError):
            raise
        except Exception as exc:  # noqa: BLE001 - this step's error; the session goes on
            log.debug("session %s: %s failed", session.id, action.type, exc_info=True)
            log_event(
                "step",
                session=session.id,
                task=session.task,
                action=action.type,
                duration_ms=_ms(started),
                error=_cut(str(exc), 500),
            )
            raise protocol.FrameError(
                protocol.ErrorCode.EXECUTION_ERROR, _cut(f"{action.type} failed: {exc}")
            ) from None
        log_event(
            "step", session=session.id, task=session.task, action=action.type, duration_ms=_ms(started), reward=reward
        )
        await self._send(protocol.observation_frame(observation, reward, done))

    # -- ends -----------------------------------------------------------------------------

    async def _end_session(self, reason: str, *, release: bool = True) -> None:
        session, self.session = self.session, None
        if session is None:
            return
        await session.close()
        if release:
            self.manager.release()
        log_event("close", session=session.id, kind=session.kind, task=session.task, steps=session.steps, reason=reason)

    async def _send(self, frame: dict[str, Any]) -> None:
        try:
            await self.ws.send_text(protocol.encode_frame(frame))
        except (OSError, RuntimeError, WebSocketDisconnect) as exc:  # the client is gone
            raise _Gone(f"disconnected (a send failed: {type(exc).__name__})") from None

    async def _error(self, code: protocol.ErrorCode, message: str) -> None:
        await self._send(protocol.error_frame(code, message))

    async def _close_ws(self, code: int, reason: str) -> None:
        try:
            await self.ws.close(code, reason)
        except Exception:  # noqa: BLE001 - already closed, or the client is gone
            pass


def _ms(started: float) -> float:
    return round((time.monotonic() - started) * 1000, 1)


def _cut(text: str, limit: int = _MESSAGE_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
