"""A real ``sequester serve`` app on uvicorn in a thread, on 127.0.0.1, and a raw client.

In-process (not a subprocess) so that tests can look at what the server holds (its
sessions, their episodes' init pids); the server is the one the CLI runs
(:func:`sequester.serve.app.uvicorn_config`), on a socket bound to port 0.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import uvicorn
import websockets
from procs import pid_alive, wait_until  # noqa: F401 - re-exported for the serve tests

from sequester.config import load_config
from sequester.serve.app import create_app, uvicorn_config

ROOT = Path(__file__).resolve().parent.parent.parent
EXAMPLES = ROOT / "examples" / "tasks"
TOKEN = "serve-test-" + os.urandom(12).hex()


class Server:
    def __init__(self, tasks_dir: Path | None = EXAMPLES, token: str = TOKEN, images: Any = None, **serve: Any):
        """``images``: the episodes' ImageSettings (default: host mode, nothing pulled)."""
        config = load_config(None)
        settings = dataclasses.replace(config.serve, tasks_dir=tasks_dir, **serve)
        episodes = dataclasses.replace(config.episodes, images=images or dataclasses.replace(config.episodes.images,
                                                                                             source="host"))
        self.config = dataclasses.replace(config, serve=settings, episodes=episodes)
        self.token = token
        self.app = create_app(self.config, token=token)
        self.manager = self.app.state.manager
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/ws"
        self.server = uvicorn.Server(uvicorn_config(self.app, settings))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.01)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def sessions(self) -> list[Any]:
        """The live sessions (on the server's side)."""
        return [c.session for c in list(self.manager.connections) if c.session is not None]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(90)
        assert not self.thread.is_alive(), "the server did not stop"

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def connect(server: Server, token: str | None = None, **kwargs: Any) -> Any:
    """A raw ``websockets`` connection to ``/ws`` with the token (or ``token``)."""
    headers = {"Authorization": f"Bearer {server.token if token is None else token}"}
    return websockets.connect(server.ws_url, additional_headers=headers, max_size=None, **kwargs)


async def ask(ws: Any, frame: dict[str, Any] | str, *, timeout: float = 180, seen: list | None = None) -> dict:
    """Send one frame, return the first answer that is not ``progress`` (kept in ``seen``)."""
    await ws.send(frame if isinstance(frame, str) else json.dumps(frame))
    while True:
        answer = json.loads(await asyncio.wait_for(ws.recv(), timeout))
        if seen is not None:
            seen.append(answer)
        if answer.get("type") != "progress":
            return answer


def step(action: dict[str, Any]) -> dict[str, Any]:
    """A ``step`` frame of ``action``."""
    return {"type": "step", "data": action}


def obs(answer: dict[str, Any]) -> dict[str, Any]:
    """The observation of an answer that must be one."""
    assert answer["type"] == "observation", answer
    return answer["data"]["observation"]


def wait_gone(pid: int, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return False



def raw_websocket(port: int, token: str) -> socket.socket:
    """A WebSocket handshake by hand, for clients no library would be: half-open, or sending bad UTF-8."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall((f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nAuthorization: Bearer {token}\r\n\r\n")
                 .encode())
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 101"), answer
    return sock


def masked_text(text: str) -> bytes:
    payload, mask = text.encode(), os.urandom(4)
    assert len(payload) < 126
    return bytes([0x81, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def http(server: Server, method: str, path: str, body: bytes | None = None, token: str | None = "default"):
    headers = {} if token is None else {"Authorization": f"Bearer {server.token if token == 'default' else token}"}
    request = urllib.request.Request(server.url + path, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
