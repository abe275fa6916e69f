"""Red-team round 2 on ``sequester serve``'s checkpoints: what one session can do with a
checkpoint id of another session (another connection, another task). A real server on
127.0.0.1 (tests/helpers/serve_harness.py), episodes on the busybox image. Both were WINs
of the round (a rollback onto another task's checkpoint scored by that task; a session
releasing another's checkpoint): both hold now."""

from __future__ import annotations

import asyncio

import pytest
from images import busybox_task_folder
from serve_harness import Server, ask, connect, obs, step

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # hard: the answer is a word the agent must find; easy: any file at /app/done.
    tasks, images = busybox_task_folder(tmp_path_factory.mktemp("serve-ck2"), "serve-ck2", {
        "hard": "grep -qx 42 /app/answer && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n",
        "easy": "test -e /app/done && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n",
    })
    with Server(tasks_dir=tasks, images=images, max_sessions=4) as s:
        yield s


def test_a_session_cannot_take_another_tasks_checkpoint_for_its_verdict(server):
    async def go():
        async with connect(server) as a, connect(server) as b:
            started_a = obs(await ask(a, {"type": "reset", "data": {"task": "hard"}}))
            await ask(b, {"type": "reset", "data": {"task": "easy"}})
            await ask(b, step({"type": "exec", "command": "touch /app/done"}))
            cp = obs(await ask(b, step({"type": "checkpoint"})))["checkpoint"]
            rolled = await ask(a, step({"type": "rollback", "checkpoint": cp}))
            answer = obs(await ask(a, step({"type": "exec", "command": "cat /app/answer 2>&1"})))["stdout"]
            verdict = await ask(a, step({"type": "evaluate"}))
            return started_a, rolled, answer, verdict

    started_a, rolled, answer, verdict = asyncio.run(go())
    print(started_a, rolled, answer, verdict)
    assert started_a["task"] == "hard" and "No such file" in answer
    # Either the rollback is refused (another task's checkpoint), or the verdict is hard's.
    assert rolled["type"] == "error" or verdict["data"]["reward"] == 0.0, (rolled, verdict)


def test_a_session_cannot_release_another_sessions_checkpoint(server):
    async def go():
        async with connect(server) as a, connect(server) as b:
            await ask(a, {"type": "reset", "data": {"task": "easy"}})
            await ask(b, {"type": "reset", "data": {"task": "hard"}})
            cp = obs(await ask(a, step({"type": "checkpoint"})))["checkpoint"]
            other = await ask(b, step({"type": "release", "checkpoint": cp}))
            mine = await ask(a, step({"type": "rollback", "checkpoint": cp}))
            return other, mine

    other, mine = asyncio.run(go())
    print(other, mine)
    assert other["type"] == "error" or mine["type"] == "observation", (other, mine)
