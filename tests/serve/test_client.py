"""``sequester serve`` driven by real clients over real sockets: OpenEnv's and ours
(:mod:`sequester.serve.client`).

A real server (``sequester serve --port 0 --tasks-dir examples/tasks --image-source host``,
its token in ``$SEQUESTER_SERVE_TOKEN``) runs as a subprocess on 127.0.0.1. OpenEnv's own
client (``openenv==0.10.0``: ``GenericEnvClient(..., headers={"Authorization": ...}).sync()``)
runs in a venv of its own (it pulls in gradio, fastmcp, ...: never the project's venv),
cached in ``$SEQUESTER_OPENENV_VENV`` (default ``/var/cache/sequester-ci/openenv-venv``
where that can be written, else ``~/.cache/sequester-test/openenv-venv``), made from PyPI
when missing and skipped when the package index cannot be reached. It plays the oracle
(the task's solve.sh, written with write_file and run with exec) and nop, and checks every
frame it gets against the server's ``/schema``. :mod:`sequester.serve.client` (sync and
async) then does the same, plus a kernel cell and the errors a client is told about.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from paths import EXAMPLES

pytestmark = pytest.mark.skipif(os.geteuid() != 0 and not Path("/proc/self/ns/user").exists(),
                                reason="needs namespaces")

TASK = "python-csv-stats"
SOLVE = (EXAMPLES / TASK / "solution" / "solve.sh").read_text()
TOKEN = "test-token-" + base64.urlsafe_b64encode(os.urandom(18)).decode()
OPENENV = "openenv==0.10.0"
# What pip prints when the package index cannot be reached (or has no such release).
_OFFLINE = re.compile(r"NewConnectionError|Max retries exceeded|Temporary failure in name resolution|"
                      r"Network is unreachable|No matching distribution found|Could not find a version")


def _default_venv() -> Path:
    ci = Path("/var/cache/sequester-ci")
    parent = ci if ci.is_dir() else ci.parent
    if os.access(parent, os.W_OK | os.X_OK):
        return ci / "openenv-venv"
    return Path.home() / ".cache" / "sequester-test" / "openenv-venv"


VENV = Path(os.environ.get("SEQUESTER_OPENENV_VENV") or _default_venv())

# Runs in OpenEnv's venv: argv[1] the server's URL; prints one JSON document.
OPENENV_SCRIPT = textwrap.dedent('''
    import json, os, sys
    import httpx, jsonschema
    from openenv.core import GenericEnvClient

    url, solve = sys.argv[1], sys.argv[2]
    headers = {"Authorization": "Bearer " + os.environ["SEQUESTER_SERVE_TOKEN"]}
    schema = httpx.get(url + "/schema", headers=headers).json()
    out = {"health": httpx.get(url + "/health").json(), "schema_keys": sorted(schema), "checked": 0}

    def check(result):
        jsonschema.validate(result.observation, schema["observation"])
        out["checked"] += 1
        return {"observation": result.observation, "reward": result.reward, "done": result.done}

    with GenericEnvClient(base_url=url, headers=headers).sync() as env:
        reset = check(env.reset(task="python-csv-stats"))
        out["oracle_reset"] = {k: reset["observation"].get(k) for k in ("kind", "task", "workdir")}
        out["oracle_instruction"] = bool(reset["observation"].get("instruction"))
        out["oracle_write"] = check(env.step({"type": "write_file", "path": "/tmp/solve.sh", "content": solve}))
        out["oracle_exec"] = check(env.step({"type": "exec", "command": "bash /tmp/solve.sh", "timeout": 120}))
        state = env.state()
        jsonschema.validate(state, schema["state"])
        out["oracle_state"] = state
        try:
            env.step({"type": "exec", "command": 5})
        except RuntimeError as exc:  # how OpenEnv's client reports an error frame
            out["bad_action"] = str(exc)
        out["oracle"] = check(env.step({"type": "evaluate"}))
    with GenericEnvClient(base_url=url, headers=headers).sync() as env:
        check(env.reset(task="python-csv-stats"))
        out["nop"] = check(env.step({"type": "evaluate"}))
    try:
        with GenericEnvClient(base_url=url).sync() as env:
            env.reset(task="python-csv-stats")
        out["no_token"] = "connected"
    except ConnectionError as exc:
        out["no_token"] = str(exc)
    print(json.dumps(out))
''')


def _venv_ready(python: Path) -> bool:
    if not python.exists():
        return False
    r = subprocess.run([str(python), "-c", "import importlib.metadata as m, openenv.core, jsonschema, httpx;"
                        "print(m.version('openenv'))"], capture_output=True, text=True, timeout=300)
    return r.returncode == 0 and r.stdout.strip() == OPENENV.split("==")[1]


@pytest.fixture(scope="session")
def openenv_python() -> str:
    """The venv's Python, with OpenEnv's client installed (made once, reused between runs)."""
    python = VENV / "bin" / "python"
    VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{VENV}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _venv_ready(python):
            return str(python)
        subprocess.run(["rm", "-rf", "--one-file-system", str(VENV)], check=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, timeout=300)
        r = subprocess.run([str(python), "-m", "pip", "install", "--quiet", OPENENV], capture_output=True, text=True,
                           timeout=1200)
        if r.returncode != 0 and _OFFLINE.search(r.stderr):
            subprocess.run(["rm", "-rf", "--one-file-system", str(VENV)], check=False)
            pytest.skip(f"the package index cannot be reached for {OPENENV}: {_OFFLINE.search(r.stderr)[0]}")
        assert r.returncode == 0 and _venv_ready(python), f"pip install {OPENENV} failed:\n{r.stderr[-3000:]}"
    return str(python)


class Server:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path):
        self.proc, self.url, self.log = proc, url, log


@contextlib.contextmanager
def serving(log: Path, *flags: str) -> Iterator[Server]:
    """A real ``sequester serve`` on a free loopback port, stopped (SIGTERM) at the end."""
    env = {**os.environ, "SEQUESTER_SERVE_TOKEN": TOKEN}
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "sequester.cli", "serve", "--host", "127.0.0.1", "--port", "0",
                                 "--tasks-dir", str(EXAMPLES), "--image-source", "host", *flags],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=env)
    try:
        deadline, url = time.monotonic() + 60, None
        while url is None:
            found = re.search(r"sequester serve: (http://127\.0\.0\.1:\d+)", log.read_text(errors="replace"))
            if found:
                url = found[1]
            elif proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"sequester serve did not start (exit {proc.poll()}):\n{log.read_text()[-3000:]}")
            else:
                time.sleep(0.05)
        yield Server(proc, url, log)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # graceful: every session closed first
        try:
            # uvicorn re-raises the signal it shut down on, so -SIGTERM is a clean end too
            assert proc.wait(60) in (0, -signal.SIGTERM), log.read_text()[-3000:]
            assert "Traceback" not in log.read_text(errors="replace"), log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(tmp_path_factory.mktemp("serve") / "stderr.log") as running:
        yield running


# -- OpenEnv's client ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def openenv_run(openenv_python: str, server: Server) -> dict:
    r = subprocess.run([openenv_python, "-c", OPENENV_SCRIPT, server.url, SOLVE], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "SEQUESTER_SERVE_TOKEN": TOKEN})
    assert r.returncode == 0, r.stderr[-5000:] + "\nserver:\n" + server.log.read_text()[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_openenv_oracle_reaches_1_and_nop_0(openenv_run):
    assert openenv_run["health"] == {"status": "healthy"}
    assert openenv_run["schema_keys"] == ["action", "observation", "state"]
    assert openenv_run["oracle_reset"] == {"kind": "episode", "task": TASK, "workdir": "/app"}
    assert openenv_run["oracle_instruction"]
    assert openenv_run["oracle_write"]["observation"] == {"path": "/tmp/solve.sh", "bytes": len(SOLVE.encode())}
    run = openenv_run["oracle_exec"]
    assert run["observation"]["exit_code"] == 0 and '"rows": 24' in run["observation"]["stdout"], run
    assert (run["reward"], run["done"]) == (None, False)
    state = openenv_run["oracle_state"]
    assert (state["kind"], state["task"], state["steps"], state["done"]) == ("episode", TASK, 2, False)
    oracle, nop = openenv_run["oracle"], openenv_run["nop"]
    assert (oracle["reward"], oracle["done"]) == (1.0, True), oracle
    assert oracle["observation"]["verifier"]["reward"] == 1.0 and oracle["observation"]["verifier"]["tampering"] == []
    assert (nop["reward"], nop["done"]) == (0.0, True), nop
    assert nop["observation"]["verifier"]["reward"] == 0.0
    assert openenv_run["checked"] == 6  # every observation matched /schema


@pytest.mark.slow
def test_openenv_client_is_told_the_error_code_and_refused_without_token(openenv_run):
    assert "data.command" in openenv_run["bad_action"] and "(code: VALIDATION_ERROR)" in openenv_run["bad_action"]
    assert "401" in openenv_run["no_token"], openenv_run["no_token"]


# -- sequester's own client ----------------------------------------------------------------


def test_sync_client_oracle(server):
    from sequester.serve.client import SequesterClient, ServerError

    with SequesterClient(server.url, TOKEN) as env:
        reset = env.reset(TASK)
        assert reset.observation["task"] == TASK and reset.observation["instruction"] and not reset.done
        assert env.write_file("/tmp/solve.sh", SOLVE).observation["bytes"] == len(SOLVE.encode())
        run = env.exec("bash /tmp/solve.sh", timeout=120)
        assert run.observation["exit_code"] == 0, run
        assert json.loads(env.read_file("/app/report.json"))["rows"] == 24
        blob = bytes(range(256)) * 4
        env.write_file("/tmp/blob.bin", blob)
        assert env.read_file("/tmp/blob.bin") == blob and env.read_file("/tmp/blob.bin", limit=10) == blob[:10]
        state = env.state()
        assert (state["kind"], state["task"], state["done"]) == ("episode", TASK, False)
        result = env.evaluate()
        assert (result.reward, result.done) == (1.0, True) and result.observation["verifier"]["reward"] == 1.0
        with pytest.raises(ServerError) as done:
            env.exec("true")  # the episode is over
        assert done.value.code == "SESSION_ERROR"
        assert env.state()["done"] is True


def test_async_client_nop_and_concurrent_sessions(server):
    from sequester.serve.client import AsyncSequesterClient

    async def nop() -> tuple[float | None, bool]:
        async with AsyncSequesterClient(server.url, TOKEN, message_timeout_s=120) as env:
            await env.reset(TASK)
            result = await env.evaluate()
            return result.reward, result.done

    async def echo(n: int) -> list[str]:
        async with AsyncSequesterClient(server.url, TOKEN) as env:
            await env.reset(TASK)
            return [(await env.exec(f"echo {n}-{i}")).observation["stdout"] for i in range(5)]

    async def main() -> tuple[list, list]:
        return await asyncio.gather(nop(), nop()), await asyncio.gather(*(echo(n) for n in range(4)))

    nops, echoes = asyncio.run(main())
    assert nops == [(0.0, True), (0.0, True)]
    assert echoes == [[f"{n}-{i}\n" for i in range(5)] for n in range(4)]


def test_kernel_cell(server):
    from sequester.serve.client import AsyncSequesterClient, SequesterClient, ServerError

    with SequesterClient(server.url, TOKEN, message_timeout_s=60) as kernel:
        assert kernel.reset(kind="kernel").observation["kind"] == "kernel"
        cell = kernel.cell("x = 6 * 7\nprint('hi')\nx").observation
        assert (cell["stdout"], cell["value"], cell["error"]) == ("hi\n", "42", None)
        assert kernel.cell("x + 1").observation["value"] == "43"  # state kept between cells
        error = kernel.cell("1 / 0").observation["error"]
        assert error["type"] == "ZeroDivisionError"
        with pytest.raises(ServerError) as wrong:
            kernel.exec("true")  # not a kernel's action
        assert wrong.value.code == "SESSION_ERROR"

    async def slow() -> dict:
        async with AsyncSequesterClient(server.url, TOKEN) as kernel:
            await kernel.reset(kind="kernel")
            return (await kernel.cell("while True: pass", timeout=0.5)).observation

    assert asyncio.run(slow())["timed_out"] is True


def test_server_errors_carry_their_code(server):
    from sequester.serve.client import ClientError, SequesterClient, ServerError

    with SequesterClient(server.url, TOKEN) as env:
        with pytest.raises(ServerError) as first:
            env.exec("true")  # no reset yet
        assert first.value.code == "SESSION_ERROR"
        for bad, field in (({"type": "exec", "command": 5}, "data.command"),
                           ({"type": "exec", "command": "true", "timeout": -1}, "data.timeout"),
                           ({"type": "launch_missiles"}, "data.type"),
                           ({"type": "write_file", "path": "/tmp/x", "content": "!", "encoding": "base64"},
                            "data.content")):
            with pytest.raises(ServerError) as caught:
                env.step(bad)
            assert caught.value.code == "VALIDATION_ERROR" and field in caught.value.message, caught.value
        for task in ("../../etc", "/etc", "no-such-task"):
            with pytest.raises(ServerError) as outside:
                env.reset(task)
            assert outside.value.code == "VALIDATION_ERROR" and "data.task" in outside.value.message
        env.reset(TASK)  # the connection is still good
        assert env.exec("echo still-here").observation["stdout"] == "still-here\n"

    for token in ("wrong-token-0123456789abcdef", ""):
        with pytest.raises(ClientError, match="401"), SequesterClient(server.url, token):
            pass
        client = SequesterClient(server.url.replace("http://", "ws://") + "/ws", token)
        with pytest.raises(ClientError, match="401"):
            client.reset(TASK)  # connects on first use
        client.close()


@pytest.mark.slow
def test_close_frees_the_slot_for_the_next_session(tmp_path):
    """At capacity a reset is refused at once; our client's close returns once the server
    has closed the session, so a session opened right after gets the slot."""
    from sequester.serve.client import SequesterClient, ServerError

    with serving(tmp_path / "stderr.log", "--max-sessions", "1") as one:
        for _ in range(3):
            with SequesterClient(one.url, TOKEN) as first, SequesterClient(one.url, TOKEN) as second:
                first.reset(TASK)
                started = time.monotonic()
                with pytest.raises(ServerError) as full:
                    second.reset(TASK)
                assert full.value.code == "CAPACITY_REACHED" and time.monotonic() - started < 5
                first.close()
                assert second.reset(TASK).observation["task"] == TASK
                assert second.exec("echo mine").observation["stdout"] == "mine\n"


@pytest.mark.slow
def test_message_timeout_progress_frames_and_a_late_reply(server, tmp_path):
    """A step longer than ``message_timeout_s`` goes on while the server's progress frames
    come (the client asks for them, and skips them); without them the client gives up,
    closes the connection (a late reply must not answer the next request), and a new reset
    on the same client opens a new session."""
    from sequester.serve.client import ClientError, SequesterClient, ServerError

    config = tmp_path / "serve.toml"
    config.write_text("[serve]\nprogress_interval = 0.2\n")
    with serving(tmp_path / "stderr.log", "--config", str(config)) as chatty:
        with SequesterClient(chatty.url, TOKEN, message_timeout_s=1) as env:
            env.reset(TASK)
            run = env.exec("sleep 2.5; echo woke")
            assert run.observation["stdout"] == "woke\n" and env.state()["steps"] == 1

    with SequesterClient(server.url, TOKEN, message_timeout_s=1) as env:  # progress every 10 s
        env.reset(TASK)
        started = time.monotonic()
        with pytest.raises(ClientError, match="no reply in 1 s"):
            env.exec("sleep 5")
        assert time.monotonic() - started < 3
        with pytest.raises(ServerError) as gone:
            env.exec("true")  # a new connection: its session was the old one's
        assert gone.value.code == "SESSION_ERROR"
        env.reset(TASK)
        run = env.exec("sleep 2; echo late", timeout=5)  # a step's own timeout extends the wait
        assert run.observation["stdout"] == "late\n"
