"""``sequester serve`` as a command (:mod:`sequester.cli.serve`) and over plain HTTP: its input checks (exit 2), its manual's
synopsis, OpenEnv's stateless ``/reset`` and ``/step``, bounded bodies, and a real server
process stopped with SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conditions import visible_tempdir
from serve_harness import EXAMPLES, ROOT, TOKEN, Server, ask, connect, http, pid_alive
from sequester.sandbox.procs import descendants

TASK = "python-csv-stats"


@pytest.fixture(scope="module")
def server():
    with Server() as s:
        yield s


@pytest.mark.slow  # the first test of the serve server (module fixture): pays its start
def test_http_reset_is_stateless_and_step_points_to_the_websocket(server):
    status, body = http(server, "POST", "/reset", json.dumps({"task": TASK}).encode())
    assert status == 200 and body["reward"] is None and body["done"] is False
    assert body["observation"]["task"] == TASK and body["observation"]["instruction"]
    assert server.manager.active == 0  # the throw-away session is closed before the answer
    for payload, field in (({}, "body.task"), ({"task": 5}, "body.task"), ({"task": TASK, "bogus": 1}, "body.bogus"),
                           ({"task": "../etc"}, "body.task"), ({"kind": "nope"}, "body.kind")):
        status, body = http(server, "POST", "/reset", json.dumps(payload).encode())
        assert status == 422 and body["code"] == "VALIDATION_ERROR" and field in body["detail"], (payload, body)
    assert http(server, "POST", "/reset", b"{not json")[0] == 400
    assert http(server, "POST", "/reset", b"[" * 100_000)[0] == 400
    assert _huge_body(server, chunked=False).startswith(b"HTTP/1.1 413")
    assert _huge_body(server, chunked=True).startswith(b"HTTP/1.1 413")
    status, body = http(server, "POST", "/step", json.dumps({"action": {"type": "exec", "command": "ls"}}).encode())
    assert status == 400 and body["code"] == "SESSION_ERROR" and "/ws" in body["detail"]
    for payload, field in (({"action": {"type": "exec"}}, "body.action.command"), ({}, "body.action"),
                           ({"action": {"type": "fly"}}, "body.action.type"),
                           ({"action": {"type": "exec", "command": "ls"}, "timeout_s": "5"}, "body.timeout_s")):
        status, body = http(server, "POST", "/step", json.dumps(payload).encode())
        assert status == 422 and field in body["detail"], (payload, body)


def _huge_body(server: Server, *, chunked: bool) -> bytes:
    """POST /reset with a body over the limit (declared, or streamed in chunks): the answer."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        size = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {17 << 20}"
        sock.sendall(f"POST /reset HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.token}\r\n{size}\r\n\r\n"
                     .encode())
        if chunked:
            chunk = b"x" * (1 << 20)
            try:
                for _ in range(20):
                    sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except OSError:  # the server answered and closed before it had all of it
                pass
        return sock.recv(4096)


def test_the_manual_documents_every_serve_option_in_its_synopsis():
    from sequester.cli import build_parser

    manual = (ROOT / "docs" / "server.md").read_text()
    synopsis = next(b for b in re.findall(r"^```sh\n(.*?)^```", manual, flags=re.S | re.M)
                    if "sequester serve [" in b)
    action = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    for option in action.choices["serve"]._actions:
        if option.option_strings and "-h" not in option.option_strings:
            assert any(o in synopsis for o in option.option_strings), option.option_strings


@pytest.mark.parametrize("argv, said", [
    (["--tasks-dir", "/no/such/folder"], "not a folder"),
    (["--tasks-dir", str(EXAMPLES / TASK)], "is a task"),
    (["--host", "0.0.0.0"], "not a loopback address"),
    (["--token-file", "/no/such/token"], "--token-file"),
    (["--max-sessions", "0"], "not a positive number"),
    (["--episode-pool", "python-csv-stats"], "is not TASK=N"),
    (["--episode-pool", "python-csv-stats=-1"], "is not TASK=N"),
    (["--tasks-dir", str(EXAMPLES), "--episode-pool", "no-such=1"], "no task 'no-such'"),
    (["--tasks-dir", str(EXAMPLES), "--max-sessions", "2", "--episode-pool", f"{TASK}=3"], "more than max_sessions"),
    (["--episode-pool", f"{TASK}=1"], "serves no tasks"),
    (["--kernel-pool", "1", "--kernel-init", "/no/such/init.py"], "--kernel-init '/no/such/init.py'"),
    (["--kernel-init", str(ROOT / "benchmarks" / "_report.py")], "needs serve.kernel_pool"),
    (["--kernel-init", str(ROOT / "README.md")], "not valid Python"),
])
def test_bad_input_is_exit_2_with_a_message(argv, said, capsys):
    from sequester.cli import main

    try:
        code = main(["serve", *argv])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    assert code == 2
    assert said in capsys.readouterr().err


def test_a_short_or_odd_token_is_refused(monkeypatch, capsys, tmp_path):
    from sequester.cli import main

    monkeypatch.setenv("SEQUESTER_SERVE_TOKEN", "short")
    assert main(["serve"]) == 2 and "at least 16" in capsys.readouterr().err
    monkeypatch.delenv("SEQUESTER_SERVE_TOKEN")
    config = tmp_path / "c.toml"
    config.write_text('[serve]\ntoken = "has spaces in it, and more"\n')
    assert main(["serve", "--config", str(config)]) == 2 and "serve.token" in capsys.readouterr().err
    config.write_text('[serve]\nmax_session = 3\n')
    assert main(["serve", "--config", str(config)]) == 2 and "serve.max_session" in capsys.readouterr().err


@pytest.mark.slow
def test_sigterm_closes_every_session_and_agents_cannot_read_the_token(tmp_path):
    """The CLI itself: its token file (in a folder agents see) hidden from every episode,
    and SIGTERM closing every session before it exits 0, their processes gone."""
    folder = visible_tempdir("serve", tmp_path)
    token_file = folder / "token"
    token_file.write_text(TOKEN + "\n")
    try:
        proc = subprocess.Popen([sys.executable, "-m", "sequester.cli", "serve", "--port", "0", "--tasks-dir",
                                 str(EXAMPLES), "--image-source", "host", "--token-file", str(token_file)],
                                stderr=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            first = proc.stderr.readline()
            port = int(re.search(r"127\.0\.0\.1:(\d+)", first).group(1))
            assert "token from --token-file" in first and TOKEN not in first

            async def go():
                server = type("S", (), {"ws_url": f"ws://127.0.0.1:{port}/ws", "token": TOKEN})()
                async with connect(server) as a, connect(server) as b:
                    await ask(a, {"type": "reset", "data": {"task": TASK}})
                    await ask(b, {"type": "reset", "data": {"kind": "kernel"}})
                    peek = await ask(a, {"type": "step", "data": {"type": "exec", "command": f"cat {token_file}"}})
                    await a.send(json.dumps({"type": "step", "data": {"type": "exec", "command": "sleep 600"}}))
                    await asyncio.sleep(0.5)
                    pids = descendants(proc.pid)
                    proc.send_signal(signal.SIGTERM)
                    code = await asyncio.to_thread(proc.wait, 60)
                    return peek, pids, code

            peek, pids, code = asyncio.run(go())
            assert TOKEN not in json.dumps(peek) and peek["data"]["observation"]["exit_code"] != 0
            assert pids and code == 0
            assert not [pid for pid in pids if pid_alive(pid)]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_ctrl_c_is_a_clean_stop_exit_0(tmp_path):
    """Ctrl-C (SIGINT) closes every session and exits 0, as the docs say (it was 130:
    uvicorn re-raised SIGINT into Python's KeyboardInterrupt)."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    proc = subprocess.Popen([sys.executable, "-m", "sequester.cli", "serve", "--port", "0", "--token-file",
                             str(token_file)], stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        first = proc.stderr.readline()
        port = int(re.search(r"127\.0\.0\.1:(\d+)", first).group(1))

        async def go():
            server = type("S", (), {"ws_url": f"ws://127.0.0.1:{port}/ws", "token": TOKEN})()
            async with connect(server) as k:
                await ask(k, {"type": "reset", "data": {"kind": "kernel"}})
                proc.send_signal(signal.SIGINT)
                return await asyncio.to_thread(proc.wait, 60)

        assert asyncio.run(go()) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_more_sessions_than_the_open_file_limit_holds_is_said_at_start(tmp_path):
    """--max-sessions 1000 under a hard open-file limit of 1024 (about 150 idle sessions):
    a warning naming the limit and how to raise it, before any session (issue #25); the
    server still serves what fits."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    proc = subprocess.Popen([sys.executable, "-m", "sequester.cli", "serve", "--port", "0", "--token-file",
                             str(token_file), "--max-sessions", "1000"], stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            preexec_fn=low_limit)
    try:
        first, second = proc.stderr.readline(), proc.stderr.readline()
        assert "up to 1000 sessions" in first, first
        assert second.startswith("sequester serve: warning: 1000 sessions with an episode each would not fit"), second
        assert "the open-file limit: " in second and "hard 1024" in second and "ulimit -n 8192" in second, second
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
