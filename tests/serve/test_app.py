"""``sequester serve``'s app (:mod:`sequester.serve.app`) over real sockets: raw WebSocket
frames and plain HTTP.

A real server (uvicorn, the CLI's configuration) on 127.0.0.1 in a thread
(:mod:`serve_harness`), the example tasks in host mode, and the ``websockets`` library as
a raw client (or a socket, for a half-open client). The command itself:
tests/cli/test_serve.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import base64
import json
import logging
import os
import shutil
import time

import pytest
import websockets

from serve_harness import (EXAMPLES, TOKEN, Server, ask, connect, http, masked_text, pid_alive, raw_websocket,
                           wait_gone, wait_until)
from sequester.serve import protocol as p

TASK = "python-csv-stats"
SOLVE = (EXAMPLES / TASK / "solution" / "solve.sh").read_text()


@pytest.fixture(scope="module")
def server():
    with Server() as s:
        yield s


def run(coro):
    return asyncio.run(coro)


# -- auth ------------------------------------------------------------------------------------


def test_health_needs_no_token_and_every_other_endpoint_does(server):
    assert http(server, "GET", "/health", token=None) == (200, {"status": "healthy"})
    for method, path in (("GET", "/metadata"), ("GET", "/schema"), ("GET", "/state"), ("POST", "/reset"),
                         ("POST", "/step"), ("GET", "/nothing-here"), ("GET", "/docs"), ("GET", "/openapi.json")):
        for token in (None, "wrong-" + TOKEN, TOKEN + "x", TOKEN[:-1], ""):
            status, body = http(server, method, path, b"{}" if method == "POST" else None, token=token)
            assert status == 401 and "Bearer" in body["detail"], (method, path, token, status)
    status, meta = http(server, "GET", "/metadata")
    assert status == 200 and meta["name"] == "sequester" and set(meta) == {
        "name", "description", "readme_content", "version", "author", "documentation_url"}
    status, state = http(server, "GET", "/state")
    assert status == 200 and state["sessions_max"] == 16 and state["tasks"] == 5
    assert http(server, "GET", "/docs")[0] == 404  # FastAPI's own pages are off


def test_the_websocket_handshake_is_refused_with_401_without_the_right_token(server):
    async def attempt(headers):
        with pytest.raises(websockets.exceptions.InvalidStatus) as info:
            async with websockets.connect(server.ws_url, additional_headers=headers):
                pass
        return info.value.response.status_code

    for headers in ({}, {"Authorization": "Bearer wrong-token-wrong-token"}, {"Authorization": TOKEN},
                    {"Authorization": f"Basic {TOKEN}"}, [("Authorization", f"Bearer {TOKEN}")] * 2):
        assert run(attempt(headers)) == 401, headers

    async def scheme_is_case_insensitive():
        async with websockets.connect(server.ws_url, additional_headers={"Authorization": f"bearer {TOKEN}"}) as ws:
            return (await ask(ws, {"type": "state"}))["type"]

    assert run(scheme_is_case_insensitive()) == "state"


# -- episodes ------------------------------------------------------------------------------------


async def oracle(server: Server, seen: list) -> dict:
    async with connect(server) as ws:
        reset = await ask(ws, {"type": "reset", "data": {"task": TASK}}, seen=seen)
        assert reset["type"] == "observation", reset
        obs = reset["data"]["observation"]
        assert obs["kind"] == "episode" and obs["task"] == TASK and "stats.py" in obs["instruction"]
        assert reset["data"]["reward"] is None and reset["data"]["done"] is False
        wrote = await ask(ws, {"type": "step", "data": {"type": "write_file", "path": "/tmp/solve.sh",
                                                        "content": SOLVE}}, seen=seen)
        assert wrote["data"]["observation"] == {"path": "/tmp/solve.sh", "bytes": len(SOLVE.encode())}
        ran = await ask(ws, {"type": "step", "data": {"type": "exec", "command": "bash /tmp/solve.sh",
                                                      "timeout": 120}}, seen=seen)
        assert ran["data"]["observation"]["exit_code"] == 0, ran
        return await ask(ws, {"type": "step", "data": {"type": "evaluate"}}, seen=seen)


def test_oracle_scores_one_and_nop_zero_over_raw_frames(server):
    seen: list = []
    verdict = run(oracle(server, seen))
    assert verdict["type"] == "observation" and verdict["data"]["reward"] == 1.0 and verdict["data"]["done"] is True
    verifier = verdict["data"]["observation"]["verifier"]
    assert set(verifier) == {"reward", "rewards", "zero_reason", "tampering", "notes", "error"}
    assert verifier["reward"] == 1.0 and verifier["error"] is None and verifier["rewards"] == {"reward": 1.0}

    async def nop():
        async with connect(server) as ws:
            await ask(ws, {"type": "reset", "data": {"task": TASK}})
            verdict = await ask(ws, {"type": "step", "data": {"type": "evaluate"}})
            after = await ask(ws, {"type": "step", "data": {"type": "exec", "command": "true"}})
            return verdict, after

    verdict, after = run(nop())
    assert verdict["data"]["reward"] == 0.0 and verdict["data"]["done"] is True
    # Nothing of the tests' output reaches the client (it may hand observations to the model).
    assert "test_" not in json.dumps(verdict) and "pytest" not in json.dumps(verdict)
    assert after["data"]["code"] == "SESSION_ERROR" and "reset" in after["data"]["message"]


def test_files_state_and_errors_of_one_session(server):
    async def go():
        async with connect(server) as ws:
            before = await ask(ws, {"type": "state"})
            early = await ask(ws, {"type": "step", "data": {"type": "exec", "command": "true"}})
            await ask(ws, {"type": "reset", "data": {"task": TASK}})
            blob = bytes(range(256)) * 4
            wrote = await ask(ws, {"type": "step", "data": {"type": "write_file", "path": "bin.dat",
                                                            "encoding": "base64",
                                                            "content": base64.b64encode(blob).decode()}})
            back = await ask(ws, {"type": "step", "data": {"type": "read_file", "path": "/app/bin.dat",
                                                           "encoding": "base64"}})
            head = await ask(ws, {"type": "step", "data": {"type": "read_file", "path": "data.csv", "limit": 5}})
            missing = await ask(ws, {"type": "step", "data": {"type": "read_file", "path": "/no/such/file"}})
            wrong_kind = await ask(ws, {"type": "step", "data": {"type": "cell", "code": "1"}})
            still = await ask(ws, {"type": "step", "data": {"type": "exec", "command": "cd /tmp; export X=1"}})
            persists = await ask(ws, {"type": "step", "data": {"type": "exec",
                                                               "command": "echo $PWD $X >&2; (exit 3)"}})
            state = await ask(ws, {"type": "state"})
            return before, early, wrote, back, head, missing, wrong_kind, still, persists, state, blob

    before, early, wrote, back, head, missing, wrong_kind, still, persists, state, blob = run(go())
    assert before["data"] == {"session_id": None, "kind": None, "task": None, "steps": 0, "done": False,
                              "started_at": None}
    assert early["data"]["code"] == "SESSION_ERROR"
    assert wrote["data"]["observation"]["bytes"] == len(blob)
    assert base64.b64decode(back["data"]["observation"]["content"]) == blob
    assert head["data"]["observation"]["truncated"] is True and len(head["data"]["observation"]["content"]) == 5
    assert missing["data"]["code"] == "EXECUTION_ERROR"
    assert wrong_kind["data"]["code"] == "SESSION_ERROR" and "'cell'" in wrong_kind["data"]["message"]
    assert still["data"]["observation"]["exit_code"] == 0
    obs = persists["data"]["observation"]
    assert obs["stderr"] == "/tmp 1\n" and obs["exit_code"] == 3  # the same shell: cwd and exports persist
    assert state["data"]["kind"] == "episode" and state["data"]["task"] == TASK
    assert state["data"]["steps"] == 5  # the steps answered with an observation (not the failed read)
    assert state["data"]["started_at"] > time.time() - 600 and state["data"]["done"] is False


def test_a_task_outside_the_tasks_folder_is_refused(tmp_path):
    tasks, outside = tmp_path / "tasks", tmp_path / "outside"
    shutil.copytree(EXAMPLES / TASK, tasks / TASK)
    shutil.copytree(EXAMPLES / TASK, outside / "evil")
    (tasks / "link-out").symlink_to(outside / "evil")
    (tasks / "nested").mkdir()
    (tasks / "nested" / "inside").symlink_to(tasks / TASK)  # a link that stays inside is fine
    refused = ["../outside/evil", str(outside / "evil"), "link-out", f"{TASK}/../../outside/evil", ".", "..",
               "", f"./{TASK}", f"{TASK}//x", "nested/../../outside/evil", "no-such-task", f"{TASK}/tests",
               "\\evil", "a\x00b"]
    with Server(tasks_dir=tasks) as server:
        async def go():
            answers = {}
            async with connect(server) as ws:
                for task in refused:
                    answers[task] = await ask(ws, {"type": "reset", "data": {"task": task}})
                good = await ask(ws, {"type": "reset", "data": {"task": f"{TASK}/"}})
                linked = await ask(ws, {"type": "reset", "data": {"task": "nested/inside"}})
            return answers, good, linked

        answers, good, linked = run(go())
    for task, answer in answers.items():
        assert answer["type"] == "error" and answer["data"]["code"] == "VALIDATION_ERROR", (task, answer)
        assert "data.task" in answer["data"]["message"], (task, answer)
    assert good["data"]["observation"]["task"] == TASK
    assert linked["data"]["observation"]["task"] == TASK


def test_the_capacity_limit_refuses_at_once_and_frees_on_close():
    with Server(max_sessions=2) as server:
        async def go():
            async with connect(server) as a, connect(server) as b, connect(server) as c:
                for ws in (a, b):
                    assert (await ask(ws, {"type": "reset", "data": {"kind": "kernel"}}))["type"] == "observation"
                started = time.monotonic()
                refused = await ask(c, {"type": "reset", "data": {"task": TASK}})
                took = time.monotonic() - started
                await a.send(json.dumps({"type": "close"}))
                await a.wait_closed()
                for _ in range(100):  # the close is seen by the server a moment later
                    if server.manager.active < 2:
                        break
                    await asyncio.sleep(0.05)
                again = await ask(c, {"type": "reset", "data": {"task": TASK}})
                return refused, took, again

        refused, took, again = run(go())
        assert refused["data"]["code"] == "CAPACITY_REACHED" and took < 1.0
        assert again["type"] == "observation"
        assert wait_until(lambda: http(server, "GET", "/state")[1]["sessions_active"] == 0)


def test_a_second_reset_replaces_the_session_and_keeps_its_slot(server):
    async def go():
        async with connect(server) as ws:
            await ask(ws, {"type": "reset", "data": {"task": TASK}})
            first = server.sessions()[0].init_pid
            refused = await ask(ws, {"type": "reset", "data": {"task": "../x"}})  # a bad reset leaves it be
            alive = pid_alive(first)
            await ask(ws, {"type": "reset", "data": {"task": TASK}})
            return first, refused, alive, server.manager.active

    first, refused, alive, active = run(go())
    assert refused["data"]["code"] == "VALIDATION_ERROR" and alive
    assert wait_gone(first) and active == 1


def test_an_abandoned_connection_is_reaped_with_its_processes(server):
    state_dir = server.config.episodes.state_dir

    def layers() -> set:  # the writable layers of this process's episodes (see sequester.environments.local.state)
        return set(state_dir.glob(f"{os.getpid()}-*"))

    async def abandon(command: str | None):
        ws = await connect(server)
        await ask(ws, {"type": "reset", "data": {"task": TASK}})
        pid = next(s for s in server.sessions()).init_pid
        assert layers()
        if command is not None:  # mid-step: the server must not wait for the command to end
            await ws.send(json.dumps({"type": "step", "data": {"type": "exec", "command": command}}))
            await asyncio.sleep(0.5)
        ws.transport.abort()  # no close frame: the socket just goes
        return pid

    for command in (None, "sleep 600"):
        assert wait_until(lambda: server.manager.active == 0)
        pid = run(abandon(command))
        assert wait_gone(pid, 20), f"the episode's init {pid} outlived its connection ({command})"
        assert wait_until(lambda: server.manager.active == 0)
        assert wait_until(lambda: not layers()), layers()


def test_a_half_open_connection_is_found_by_pings_and_reaped():
    with Server(ping_interval=0.5, ping_timeout=0.5) as server:
        sock = raw_websocket(server.port, server.token)
        try:
            sock.sendall(masked_text(json.dumps({"type": "reset", "data": {"task": TASK}})))
            deadline = time.monotonic() + 30
            while not server.sessions() and time.monotonic() < deadline:
                time.sleep(0.02)
            pid = server.sessions()[0].init_pid
            assert wait_gone(pid, 15), "a client that stopped answering pings kept its episode"
        finally:
            sock.close()


@pytest.mark.slow
def test_idle_connections_are_closed_with_their_session():
    with Server(idle_timeout=1.0) as server:
        async def go():
            async with connect(server) as ws:
                await ask(ws, {"type": "reset", "data": {"task": TASK}})
                pid = server.sessions()[0].init_pid
                await ask(ws, {"type": "step", "data": {"type": "exec", "command": "sleep 1.5"}})  # a step is not idle
                with pytest.raises(websockets.exceptions.ConnectionClosed) as info:
                    await asyncio.wait_for(ws.recv(), 10)
                return pid, info.value.rcvd.code if info.value.rcvd else None

        pid, code = run(go())
        assert code == 4000 and wait_gone(pid)


@pytest.mark.slow
def test_progress_frames_only_for_clients_that_ask():
    with Server(progress_interval=0.3) as server:
        async def go(progress: bool):
            seen: list = []
            async with connect(server) as ws:
                await ask(ws, {"type": "reset", "data": {"task": TASK, "progress": progress}})
                answer = await ask(ws, {"type": "step", "data": {"type": "exec", "command": "sleep 1.2; echo ok"}},
                                   seen=seen)
            return answer, [f for f in seen if f["type"] == "progress"]

        answer, progress = run(go(True))
        assert answer["data"]["observation"]["stdout"] == "ok\n" and len(progress) >= 2
        assert all(f["data"]["elapsed_s"] > 0 for f in progress)
        answer, progress = run(go(False))  # OpenEnv's client takes any frame as the answer: none unasked
        assert answer["data"]["observation"]["stdout"] == "ok\n" and progress == []


@pytest.mark.slow
def test_sessions_run_side_by_side_and_one_failing_leaves_the_others(server):
    async def go():
        async with connect(server) as slow, connect(server) as quick:
            await ask(slow, {"type": "reset", "data": {"task": TASK}})
            await ask(quick, {"type": "reset", "data": {"kind": "kernel"}})
            await slow.send(json.dumps({"type": "step", "data": {"type": "exec", "command": "sleep 3; echo done"}}))
            started = time.monotonic()
            answers = [await ask(quick, {"type": "step", "data": {"type": "cell", "code": f"{i} * 2"}})
                       for i in range(20)]
            took = time.monotonic() - started
            failing = await ask(quick, {"type": "step", "data": {"type": "cell", "code": "1/0"}})
            slow_answer = json.loads(await asyncio.wait_for(slow.recv(), 30))
            return answers, took, failing, slow_answer

    answers, took, failing, slow_answer = run(go())
    assert [a["data"]["observation"]["value"] for a in answers] == [str(i * 2) for i in range(20)]
    assert took < 2.5  # not behind the other session's 3 s command
    assert failing["data"]["observation"]["error"]["type"] == "ZeroDivisionError"
    assert slow_answer["data"]["observation"]["stdout"] == "done\n"


def test_kernel_sessions_round_trip_cells(server):
    async def go():
        async with connect(server) as ws:
            reset = await ask(ws, {"type": "reset", "data": {"kind": "kernel"}})
            cells = [await ask(ws, {"type": "step", "data": {"type": "cell", "code": code}})
                     for code in ("x = 41\nprint('hi')", "x + 1", "import subprocess; subprocess.run(['ls'])")]
            wrong = await ask(ws, {"type": "step", "data": {"type": "exec", "command": "ls"}})
            state = await ask(ws, {"type": "state"})
            return reset, cells, wrong, state

    reset, cells, wrong, state = run(go())
    assert reset["data"]["observation"]["kind"] == "kernel"
    assert cells[0]["data"]["observation"]["stdout"] == "hi\n"
    assert cells[1]["data"]["observation"]["value"] == "42" and cells[1]["data"]["reward"] is None
    assert cells[2]["data"]["observation"]["error"]["type"] == "PermissionError"
    assert wrong["data"]["code"] == "SESSION_ERROR"
    assert state["data"]["kind"] == "kernel" and state["data"]["steps"] == 3


def test_the_schema_validates_what_the_server_sends(server):
    seen: list = []
    run(oracle(server, seen))

    async def more():
        async with connect(server) as ws:
            await ask(ws, {"type": "reset", "data": {"task": TASK}}, seen=seen)
            await ask(ws, {"type": "step", "data": {"type": "read_file", "path": "data.csv"}}, seen=seen)
            await ask(ws, {"type": "step", "data": {"type": "exec", "command": "sleep 5", "timeout": 0.2}}, seen=seen)
            await ask(ws, {"type": "state"}, seen=seen)
            await ask(ws, {"type": "reset", "data": {"kind": "kernel"}}, seen=seen)
            for code in ("1 + 1", "raise ValueError('x')"):
                await ask(ws, {"type": "step", "data": {"type": "cell", "code": code}}, seen=seen)
            await ask(ws, {"type": "state"}, seen=seen)

    run(more())
    status, schema = http(server, "GET", "/schema")
    assert status == 200 and set(schema) == {"action", "observation", "state"}
    observations = [f["data"]["observation"] for f in seen if f["type"] == "observation"]
    states = [f["data"] for f in seen if f["type"] == "state"]
    assert len(observations) >= 10 and len(states) == 2
    try:
        import jsonschema
    except ImportError:  # pydantic, the schema's source, checks the same shapes
        from pydantic import TypeAdapter
        for obs in observations:
            TypeAdapter(p.Observation).validate_python(obs)
        for state in states:
            p.SessionState.model_validate(state)
    else:
        for obs in observations:
            jsonschema.validate(obs, schema["observation"])
        for state in states:
            jsonschema.validate(state, schema["state"])
        for action in ({"type": "exec", "command": "ls"}, {"type": "cell", "code": "1", "timeout": 2.5},
                       {"type": "write_file", "path": "a", "content": "x", "encoding": "base64"}):
            jsonschema.validate(action, schema["action"])
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"type": "exec"}, schema["action"])


def test_one_structured_log_line_per_session_event(server, caplog):
    caplog.set_level(logging.INFO, logger="sequester.serve")
    run(oracle(server, []))
    time.sleep(0.5)  # the close is logged once the server has seen the connection go
    events = [json.loads(r.getMessage()) for r in caplog.records if r.name == "sequester.serve"
              and r.getMessage().startswith("{")]
    kinds = [e["event"] for e in events]
    assert kinds[:1] == ["reset"] and kinds.count("step") == 3 and "close" in kinds, kinds
    evaluate = next(e for e in events if e.get("action") == "evaluate")
    assert evaluate["reward"] == 1.0 and evaluate["task"] == TASK and evaluate["duration_ms"] > 0
    assert len({e["session"] for e in events}) == 1
    assert TOKEN not in caplog.text


def test_a_kernel_session_closed_mid_cell_kills_its_kernel_at_once(server):
    """The close interrupts the running step: the kernel (a view template's child, or
    bwrap's) is killed from the event loop without its pipes being closed under the worker
    reading them, and is gone well before the step's own timeout."""
    from sequester.kernel import template

    async def busy():
        async with connect(server) as ws:
            await ask(ws, {"type": "reset", "data": {"kind": "kernel"}})
            await ws.send(json.dumps({"type": "step", "data": {"type": "cell", "code": "while True: pass",
                                                               "timeout": 120}}))
            await asyncio.sleep(0.5)  # the cell runs

    keepers = lambda: [t for t in template._templates.values() if t.alive]  # noqa: E731
    before = time.monotonic()
    run(busy())
    from sequester.sandbox.procs import descendants

    def kernels_left() -> list[int]:
        return [pid for t in keepers() for pid in descendants(t.host_pids()[-1])]

    assert wait_until(lambda: not kernels_left(), timeout=10), kernels_left()
    assert time.monotonic() - before < 20


def test_a_task_that_is_not_calibrated_is_refused_at_reset(tmp_path, monkeypatch):
    """With records in the store (sequester calibrate with the server's settings): a task
    whose oracle scored 0 is refused (FACTORY_ERROR, TaskNotCalibrated); a calibrated one
    starts and says so; with `required`, one without a record is refused too."""
    from sequester.environments.settings import EpisodeSettings
    from sequester.jobs.job import calibrate_tasks

    monkeypatch.setenv("SEQUESTER_CALIBRATION_DIR", str(tmp_path / "store"))
    tasks = tmp_path / "tasks"
    for name in ("good", "broken", "unknown"):
        shutil.copytree(EXAMPLES / TASK, tasks / name)
    (tasks / "broken" / "solution" / "solve.sh").write_text("true\n")
    (tasks / "unknown" / "instruction.md").write_text("A task of its own (a copy of the same files is the same task).\n")
    settings = dataclasses.replace(EpisodeSettings(), images=dataclasses.replace(EpisodeSettings().images, source="host"))
    calibrate_tasks([tasks / "good", tasks / "broken"], jobs_dir=tmp_path / "jobs", settings=settings)

    async def resets(server):
        async with connect(server) as ws:
            return {name: await ask(ws, {"type": "reset", "data": {"task": name}}) for name in ("good", "broken", "unknown")}

    with Server(tasks_dir=tasks) as server:
        auto = run(resets(server))
    with Server(tasks_dir=tasks, calibration="required") as server:
        required = run(resets(server))
    assert auto["good"]["data"]["observation"]["calibration"]["state"] == "calibrated"
    assert auto["broken"]["type"] == "error" and auto["broken"]["data"]["code"] == "FACTORY_ERROR"
    assert "not calibrated" in auto["broken"]["data"]["message"] and "oracle scored 0" in auto["broken"]["data"]["message"]
    assert auto["unknown"]["data"]["observation"]["calibration"]["state"] == "uncalibrated"
    assert required["good"]["type"] != "error" and required["unknown"]["type"] == "error"
    assert required["unknown"]["data"]["code"] == "FACTORY_ERROR", required["unknown"]
