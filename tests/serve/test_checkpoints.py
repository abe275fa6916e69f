"""``sequester serve``'s checkpoints over raw WebSocket frames: ``checkpoint``,
``rollback`` and ``release`` actions, and a ``reset`` with a checkpoint that forks it into
a new session (counted against ``max_sessions``); the checkpoint goes with its session's
close, the forks keep their files; bad ids and host-mode sessions are refused clearly.
A real server on 127.0.0.1 (tests/helpers/serve_harness.py), episodes on the busybox image."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
from images import busybox_task_folder
from serve_harness import Server, ask, connect, obs, step, wait_until


pytestmark = pytest.mark.slow
TASK = "ck"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tasks, images = busybox_task_folder(tmp_path_factory.mktemp("serve-ck"), "serve-ck")
    with Server(tasks_dir=tasks, images=images, max_sessions=3) as s:
        yield s


def test_checkpoint_fork_rollback_and_release_over_the_wire(server):
    async def go():
        async with connect(server) as a, connect(server) as b, connect(server) as c, connect(server) as d:
            obs(await ask(a, {"type": "reset", "data": {"task": TASK}}))
            await ask(a, step({"type": "exec", "command": "echo one > /app/x; cd /tmp; export K=v"}))
            made = obs(await ask(a, step({"type": "checkpoint"})))
            cp = made["checkpoint"]
            forked = obs(await ask(b, {"type": "reset", "data": {"checkpoint": cp}}))
            seen_b = obs(await ask(b, step({"type": "exec", "command": "cat /app/x; pwd; echo $K"})))["stdout"]
            await ask(b, step({"type": "exec", "command": "echo fork > /app/x"}))
            await ask(a, step({"type": "exec", "command": "echo two > /app/x"}))
            rolled = obs(await ask(a, step({"type": "rollback", "checkpoint": cp})))
            seen_a = obs(await ask(a, step({"type": "exec", "command": "cat /app/x"})))["stdout"]
            third = obs(await ask(c, {"type": "reset", "data": {"checkpoint": cp}}))
            full = await ask(d, {"type": "reset", "data": {"checkpoint": cp}})  # a 4th session: max_sessions 3
            verdict_b = await ask(b, step({"type": "evaluate"}))
            released = obs(await ask(a, step({"type": "release", "checkpoint": cp})))
            await c.send(json.dumps({"type": "close"}))
            await c.wait_closed()
            after_release = await ask(d, {"type": "reset", "data": {"checkpoint": cp}})
            verdict_a = await ask(a, step({"type": "evaluate"}))
            return made, forked, seen_b, rolled, seen_a, third, full, verdict_b, released, after_release, verdict_a

    made, forked, seen_b, rolled, seen_a, third, full, verdict_b, released, after_release, verdict_a = asyncio.run(go())
    assert made["depth"] == 1 and made["bytes"] > 0 and isinstance(made["not_restored"], list)
    assert forked["kind"] == "episode" and forked["task"] == TASK and forked["session_id"]
    assert seen_b == "one\n/tmp\nv\n"
    assert rolled["checkpoint"] == made["checkpoint"] and seen_a == "one\n"
    assert third["task"] == TASK
    assert full["type"] == "error" and full["data"]["code"] == "CAPACITY_REACHED"
    assert verdict_b["data"]["reward"] == 0.0  # the fork wrote "fork"
    assert released == {"checkpoint": made["checkpoint"], "released": True}
    assert after_release["type"] == "error" and "not held" in after_release["data"]["message"], after_release
    assert verdict_a["data"]["reward"] == 1.0


def test_a_checkpoint_goes_with_its_session_and_its_forks_keep_their_files(server):
    async def go():
        async with connect(server) as a, connect(server) as b:
            await ask(a, {"type": "reset", "data": {"task": TASK}})
            await ask(a, step({"type": "exec", "command": "echo one > /app/x"}))
            cp = obs(await ask(a, step({"type": "checkpoint"})))["checkpoint"]
            await ask(b, {"type": "reset", "data": {"checkpoint": cp}})
            await a.send(json.dumps({"type": "close"}))
            await a.wait_closed()
            still = obs(await ask(b, step({"type": "exec", "command": "cat /app/x"})))["stdout"]
            async with connect(server) as c:
                gone = await ask(c, {"type": "reset", "data": {"checkpoint": cp}})
            return still, gone

    still, gone = asyncio.run(go())
    assert still == "one\n"
    assert gone["type"] == "error" and gone["data"]["code"] == "VALIDATION_ERROR" and "closed" in gone["data"]["message"]
    state = server.config.episodes.state_dir
    # Everything that held it is closed (the server closes a session just after its connection).
    assert wait_until(lambda: not list(state.glob(f"{os.getpid()}-ckpt-*")), 30)


@pytest.mark.parametrize("data, field", [
    ({"checkpoint": "../../etc"}, "data.checkpoint"),
    ({"checkpoint": 5}, "data.checkpoint"),
    ({"task": TASK, "checkpoint": "ab-cd"}, "data.task"),
    ({}, "data.task"),
])
def test_bad_fork_resets_name_the_field(server, data, field):
    async def go():
        async with connect(server) as ws:
            return await ask(ws, {"type": "reset", "data": data})

    answer = asyncio.run(go())
    assert answer["type"] == "error" and answer["data"]["code"] == "VALIDATION_ERROR", answer
    assert answer["data"]["message"].startswith(field), answer


def test_bad_checkpoint_actions_are_refused_and_the_session_goes_on(server):
    async def go():
        async with connect(server) as ws:
            await ask(ws, {"type": "reset", "data": {"task": TASK}})
            bad = await ask(ws, step({"type": "rollback", "checkpoint": "0123-abcd"}))
            worse = await ask(ws, step({"type": "rollback"}))
            ok = await ask(ws, step({"type": "exec", "command": "echo ok"}))
            return bad, worse, ok

    bad, worse, ok = asyncio.run(go())
    assert bad["data"]["code"] == "EXECUTION_ERROR", bad
    assert worse["data"]["code"] == "VALIDATION_ERROR" and "checkpoint" in worse["data"]["message"], worse
    assert obs(ok)["stdout"] == "ok\n"
