"""``sequester serve``'s protocol (:mod:`sequester.serve.protocol`) under 1,000 malformed
and hostile frames.

Invalid JSON, wrong types, unknown frame and action types, NaN, lone surrogates, NULs,
deeply nested JSON, binary frames, values near and over the size limit, floods sent
without reading: each is answered with an error frame (or, over the size limit or not
UTF-8, a clean close of that connection), the server stays up, and meanwhile another
session plays the oracle to a 1.0.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import urllib.request

import pytest
import websockets

from serve_harness import EXAMPLES, Server, ask, connect, raw_websocket, wait_until

TASK = "python-csv-stats"
SOLVE = (EXAMPLES / TASK / "solution" / "solve.sh").read_text()
LIMIT = 1 << 20  # the hostile server's message limit (1 MiB, to keep over-size frames cheap)
ERROR_CODES = {"INVALID_JSON", "UNKNOWN_TYPE", "VALIDATION_ERROR", "SESSION_ERROR"}


def hostile_frames(rng: random.Random) -> list[str | bytes]:
    """Every kind at least a few times; ``bytes`` are sent as binary frames."""
    nested = {"type": "step", "data": {"type": "exec", "command": 5, "metadata": {}}}
    deep = nested["data"]["metadata"]
    for _ in range(500):  # under the parser's limit: parsed, then refused for command
        deep["x"] = {}
        deep = deep["x"]
    kinds: list = [
        lambda: "".join(rng.choice('{}[]":,\\ abc019\n') for _ in range(rng.randint(0, 60))) + "{",
        lambda: '{"type": "step", "data": {"type": "exec", "command": "ls"',  # cut short
        lambda: "[" * rng.randint(2_000, 200_000),  # deeper than any parser should go
        lambda: '{"a":' * 5_000 + "1" + "}" * 5_000,
        lambda: json.dumps(nested),
        lambda: "NaN", lambda: '{"type": "step", "data": {"type": "exec", "command": "ls", "timeout": Infinity}}',
        lambda: "1" * 5_000,  # an integer Python refuses to convert
        lambda: json.dumps(rng.choice([None, 1, "reset", [], True, 1.5])),
        lambda: json.dumps({"type": rng.choice([None, 1, [], {}, True])}),
        lambda: json.dumps({"type": "".join(rng.choice("abcxyz_") for _ in range(rng.randint(1, 30)))}),
        lambda: json.dumps({"type": "step", "data": rng.choice([None, [], "exec", 5])}),
        lambda: json.dumps({"type": "step", "data": {"type": rng.choice(["rm", "shell", "EXEC", "", "eval"])}}),
        lambda: json.dumps({"type": "step", "data": {"type": "exec", "command": rng.choice([None, 1, [], {}])}}),
        lambda: json.dumps({"type": "step", "data": {"type": "exec", "command": "ls", "timeout": rng.choice(
            ["5", -1, 0, 1e300, True, [], {}])}}),
        lambda: json.dumps({"type": "step", "data": {"type": "exec", "command": "ls", "extra": 1}}),
        lambda: json.dumps({"type": "step", "data": {"type": "exec", "command": "ls\u0000rm -rf /"}}),
        lambda: '{"type": "step", "data": {"type": "write_file", "path": "a", "content": "\\ud800"}}',
        lambda: json.dumps({"type": "step", "data": {"type": "write_file", "path": "a", "content": "!!",
                                                     "encoding": "base64"}}),
        lambda: json.dumps({"type": "step", "data": {"type": "write_file", "path": "", "content": "x"}}),
        lambda: json.dumps({"type": "step", "data": {"type": "read_file", "path": "a", "limit": rng.choice(
            [-1, "10", 1.5, True])}}),
        lambda: json.dumps({"type": "step", "data": {"type": "read_file", "path": "a", "encoding": "latin-1"}}),
        lambda: json.dumps({"type": "step", "data": {"type": "exec", "command": "echo hi"}}),  # a kernel session's
        lambda: json.dumps({"type": "step", "data": {"type": "evaluate"}}),  # wrong kind too
        lambda: json.dumps({"type": "step", "data": {"type": "cell", "code": 1}}),
        lambda: json.dumps({"type": "step", "data": {"type": "cell", "code": "1", "timeout": "never"}}),
        lambda: json.dumps({"type": "reset", "data": {"task": rng.choice(["../../etc", "/etc", "..", "x" * 2000,
                                                                          f"{TASK}/../..", ""])}}),
        lambda: json.dumps({"type": "reset", "data": {"kind": rng.choice(["vm", 1, None, "KERNEL"])}}),
        lambda: json.dumps({"type": "reset", "data": {"kind": "kernel", "progress": "yes"}}),
        lambda: json.dumps({"type": "reset", "data": []}),
        lambda: json.dumps({"type": "close", "data": 5}), lambda: json.dumps({"type": "state", "x": 1}),
        lambda: json.dumps({"type": "step", "data": {"type": "exec", "command": 7, "pad": "x" * (LIMIT - 200)}}),
        lambda: os.urandom(rng.randint(0, 2000)),  # binary
        lambda: b'{"type": "state"}',  # binary, even when it holds JSON
    ]
    frames = [kind() for kind in kinds]  # each at least once
    while len(frames) < 960:
        frames.append(rng.choice(kinds)())
    return frames


async def hostile(server: Server, rng: random.Random) -> dict[str, int]:
    """960 frames on one connection (in floods of up to 100 sent before any is read), then
    over-size and invalid-UTF-8 frames on connections of their own: 1,000 in all."""
    counts = {"sent": 0, "errors": 0}
    frames = hostile_frames(rng)
    async with connect(server) as ws:
        assert (await ask(ws, {"type": "reset", "data": {"kind": "kernel"}}))["type"] == "observation"
        i = 0
        while i < len(frames):
            flood = frames[i:i + rng.choice([1, 5, 100])]
            for frame in flood:
                await ws.send(frame)
            for frame in flood:
                answer = json.loads(await asyncio.wait_for(ws.recv(), 30))
                assert answer["type"] == "error" and answer["data"]["code"] in ERROR_CODES, (frame[:200], answer)
                assert len(answer["data"]["message"]) < 1000  # never the input echoed back
                counts["errors"] += 1
            counts["sent"] += len(flood)
            i += len(flood)
        # The hostile connection's own session is intact.
        cell = await ask(ws, {"type": "step", "data": {"type": "cell", "code": "6 * 7"}})
        assert cell["data"]["observation"]["value"] == "42"
    for n in range(30):  # over the limit: that connection is closed with 1009, nothing else is
        async with connect(server) as ws:
            # The server may close while the frame is still being written (the send then
            # fails on the broken pipe, after the 1009 close frame arrived).
            with pytest.raises(websockets.exceptions.ConnectionClosed) as info:
                await ws.send("x" * (LIMIT + 1 + n))
                await asyncio.wait_for(ws.recv(), 30)
            # 1009 when its close frame was read before the pipe broke; never another code
            assert info.value.rcvd is None or info.value.rcvd.code == 1009, info.value
        counts["sent"] += 1
    for _ in range(10):  # a text frame that is not UTF-8: 1007, by hand (a client library will not send one)
        assert await asyncio.to_thread(_invalid_utf8, server) == 1007
        counts["sent"] += 1
    return counts


def _invalid_utf8(server: Server) -> int:
    """A text frame that is not UTF-8 (sent by hand): the close code the server answers with."""
    with raw_websocket(server.port, server.token) as sock:
        payload, mask = b'{"type": "\xff\xfe"}', os.urandom(4)
        sock.sendall(bytes([0x81, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))
        data = b""
        while len(data) < 4:
            more = sock.recv(4096)
            if not more:
                break
            data += more
        assert data[0] & 0x0F == 0x8, data  # a close frame
        return int.from_bytes(data[2:4], "big")


async def honest(server: Server, flood_done: asyncio.Event) -> tuple[float, float]:
    """The oracle, side by side with the flood; its evaluation once the flood is over."""
    async with connect(server) as ws:
        await ask(ws, {"type": "reset", "data": {"task": TASK}})
        await ask(ws, {"type": "step", "data": {"type": "write_file", "path": "/tmp/solve.sh", "content": SOLVE}})
        slowest = 0.0
        while not flood_done.is_set():
            started = asyncio.get_running_loop().time()
            answer = await ask(ws, {"type": "step", "data": {"type": "exec", "command": "echo alive"}})
            assert answer["data"]["observation"]["stdout"] == "alive\n"
            slowest = max(slowest, asyncio.get_running_loop().time() - started)
            await asyncio.sleep(0.05)
        ran = await ask(ws, {"type": "step", "data": {"type": "exec", "command": "bash /tmp/solve.sh"}})
        assert ran["data"]["observation"]["exit_code"] == 0
        verdict = await ask(ws, {"type": "step", "data": {"type": "evaluate"}})
        return verdict["data"]["reward"], slowest


@pytest.mark.slow
def test_a_thousand_hostile_frames_each_get_an_error_and_another_session_goes_on():
    with Server(max_message_bytes=LIMIT) as server:
        async def both():
            done = asyncio.Event()

            async def flood():
                try:
                    return await hostile(server, random.Random(10))
                finally:
                    done.set()

            return await asyncio.gather(flood(), honest(server, done))

        counts, (reward, slowest) = asyncio.run(both())
        assert counts["sent"] >= 1000 and counts["errors"] == 960, counts
        assert reward == 1.0
        assert slowest < 5.0, f"the honest session waited {slowest:.1f} s for an echo during the flood"
        with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
            assert json.loads(r.read()) == {"status": "healthy"}
        assert wait_until(lambda: server.manager.active == 0 and not server.manager.connections)
