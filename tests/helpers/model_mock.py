"""A scripted OpenAI-compatible model API on the host's loopback, for agents that run
inside an episode and reach it through the operator's ``localhost:PORT`` relay.

``POST /v1/chat/completions`` answers with one ``bash`` tool call (mini-swe-agent's
protocol: it runs the command, and ``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` ends its
run). Which command is decided by how many assistant turns the request's conversation
already has, so a retried request gets the same answer: turn ``i`` gets ``commands[i]``,
every turn past the script the last one. Every request is kept (path, headers, body) for
the test to look at. Nothing else is served: any other path is a 404.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


@dataclass
class ModelMock:
    """The script and what was asked of it (``port`` once it listens)."""

    commands: list[str]
    port: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def base_url(self) -> str:
        return f"http://localhost:{self.port}/v1"

    def completions(self) -> list[dict[str, Any]]:
        """The chat-completion requests received (their JSON bodies), in order."""
        with self.lock:
            return [r["body"] for r in self.requests if r["path"].endswith("/chat/completions")]

    def reply(self, body: dict[str, Any]) -> dict[str, Any]:
        turn = sum(1 for m in body.get("messages", []) if m.get("role") == "assistant")
        command = self.commands[min(turn, len(self.commands) - 1)]
        call = {"id": f"call_{turn}", "type": "function",
                "function": {"name": "bash", "arguments": json.dumps({"command": command})}}
        return {
            "id": f"chatcmpl-mock-{turn}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "mock"),
            "choices": [{"index": 0, "finish_reason": "tool_calls",
                         "message": {"role": "assistant", "content": f"Turn {turn}: running a command.",
                                     "tool_calls": [call]}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        }


@contextmanager
def model_mock(commands: list[str]) -> Iterator[ModelMock]:
    """Serve a :class:`ModelMock` on 127.0.0.1 (a free port) until the block ends."""
    mock = ModelMock(commands=list(commands))

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # (quiet: the test reads mock.requests)
            pass

        def _answer(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                body = json.loads(raw or b"{}")
            except ValueError:
                body = {"unparsed": raw.decode(errors="replace")}
            with mock.lock:
                mock.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
            if self.path.rstrip("/").endswith("/chat/completions") and not body.get("stream"):
                self._answer(200, mock.reply(body))
            else:
                self._answer(404, {"error": {"message": f"the mock serves no {self.path} (stream: "
                                                        f"{body.get('stream')!r})", "type": "not_found"}})

        def do_GET(self) -> None:  # noqa: N802
            with mock.lock:
                mock.requests.append({"path": self.path, "headers": dict(self.headers), "body": None})
            self._answer(404, {"error": {"message": f"the mock serves no GET {self.path}", "type": "not_found"}})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    mock.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, name="model-mock", daemon=True)
    thread.start()
    try:
        yield mock
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
