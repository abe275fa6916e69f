"""sequester as an Inspect sandbox, through Inspect's own CLI and classes (inspect-ai 0.3.285).

A real ``inspect eval`` (Inspect's ``mockllm`` model, a scripted solver) on an example task,
with ``sandbox=("sequester", TASK)`` found through the ``inspect_ai`` entry point group and
``task_verdict`` as the scorer: 1.0 when the solver solves the task, 0.0 when it does not.
Then the sandbox's contract, by Inspect's own classes against real episodes: a fresh
process per ``exec`` (concurrent calls run at once), ``TimeoutError``,
``OutputLimitExceededError``, users, input, files.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import inspect_venv
import pytest
from paths import EXAMPLES

pytestmark = pytest.mark.slow

TASK = EXAMPLES / "c-word-count"

EVAL = textwrap.dedent(f'''
    from pathlib import Path

    from inspect_ai import Task, task
    from inspect_ai._util.registry import registry_lookup
    from inspect_ai.dataset import Sample
    from inspect_ai.solver import solver
    from inspect_ai.util import sandbox

    TASK = Path({str(TASK)!r})


    @solver
    def scripted(solve: bool = True):
        async def run(state, generate):
            if solve:
                await sandbox().write_file("/tmp/solve.sh", (TASK / "solution" / "solve.sh").read_text())
                result = await sandbox().exec(["bash", "/tmp/solve.sh"])
                assert result.success, result.stderr
            return state
        return run


    @task
    def word_count(solve: bool = True):
        # (nothing of sequester is imported: the sandbox and the scorer come from the entry point)
        verdict = registry_lookup("scorer", "sequester/task_verdict")
        return Task(dataset=[Sample(input=(TASK / "instruction.md").read_text())], solver=scripted(solve),
                    scorer=verdict(), sandbox=("sequester", str(TASK)))
''')

CONTRACT = textwrap.dedent(f'''
    import asyncio, json, time
    from inspect_ai.util import OutputLimitExceededError
    from sequester.inspect.sandbox import SequesterSandbox

    TASK = {str(TASK)!r}

    async def main():
        out = {{}}
        await SequesterSandbox.task_init("t", TASK)
        envs = await SequesterSandbox.sample_init("t", TASK, {{}})
        other = await SequesterSandbox.sample_init("t", TASK, {{}})
        box = envs["default"]
        try:
            r = await box.exec(["sh", "-c", "pwd; cd /; export LEFT=1; echo $GREETING"], env={{"GREETING": "hi"}})
            out["first"] = [r.success, r.returncode, r.stdout]
            r = await box.exec(["sh", "-c", "pwd; echo ${{LEFT-unset}}"])
            out["second"] = r.stdout
            out["status"] = (await box.exec(["sh", "-c", "exit 3"])).returncode
            out["input"] = (await box.exec(["cat"], input="fed in")).stdout
            out["user"] = (await box.exec(["id", "-u"], user="nobody")).stdout.strip()
            r = await box.exec(["true"], user="no-such-user")
            out["no_user"] = [r.returncode, r.stderr]
            out["missing"] = (await box.exec(["no-such-command"])).returncode
            started = time.monotonic()
            await asyncio.gather(*(box.exec(["sleep", "1"]) for _ in range(4)))
            out["four_in"] = time.monotonic() - started
            try:
                await box.exec(["sleep", "30"], timeout=1)
                out["timeout"] = "none"
            except TimeoutError as exc:
                out["timeout"] = str(exc)
            try:
                await box.exec(["sh", "-c", "head -c 20000000 /dev/zero"])
                out["limit"] = "none"
            except OutputLimitExceededError as exc:
                out["limit"] = str(exc)
            await box.write_file("/app/sub/dir/file.bin", bytes(range(256)))
            out["binary"] = list(await box.read_file("/app/sub/dir/file.bin", text=False)) == list(range(256))
            await box.write_file("notes.txt", "relative")
            out["relative"] = (await box.exec(["cat", "notes.txt"])).stdout
            for name, path in (("read_missing", "/nope/file"), ("read_dir", "/app")):
                try:
                    await box.read_file(path)
                    out[name] = "none"
                except Exception as exc:
                    out[name] = type(exc).__name__
            out["isolated"] = (await other["default"].exec(["cat", "/app/notes.txt"])).returncode
        finally:
            await SequesterSandbox.sample_cleanup("t", TASK, envs, False)
            await SequesterSandbox.sample_cleanup("t", TASK, other, False)
        print(json.dumps(out))

    asyncio.run(main())
''')


@pytest.fixture(scope="module")
def python() -> str:
    return inspect_venv.inspect_python()


def eval_score(python: str, tmp_path: Path, solve: bool) -> float:
    (tmp_path / "seq_eval.py").write_text(EVAL)
    logs = tmp_path / f"logs-{solve}"
    inspect = Path(python).parent / "inspect"
    r = subprocess.run([str(inspect), "eval", "seq_eval.py", "--model", "mockllm/model", "-T", f"solve={solve}",
                        "--log-dir", str(logs), "--display", "plain"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (log,) = logs.glob("*.eval")
    dump = subprocess.run([str(inspect), "log", "dump", str(log)], capture_output=True, text=True, timeout=300)
    data = json.loads(dump.stdout)
    assert data["status"] == "success", data.get("error")
    (sample,) = data["samples"]
    (score,) = sample["scores"].values()
    return float(score["value"])


def test_inspect_eval_scores_a_solved_task_one_and_an_unsolved_one_zero(python, tmp_path):
    assert eval_score(python, tmp_path, True) == 1.0
    assert eval_score(python, tmp_path, False) == 0.0


def test_the_sandbox_keeps_inspects_contract(python):
    r = subprocess.run([python, "-c", CONTRACT], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-5000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["first"] == [True, 0, "/app\nhi\n"]
    assert out["second"] == "/app\nunset\n"  # a fresh process: nothing of the first call stayed
    assert out["status"] == 3 and out["input"] == "fed in" and out["user"] == "65534"
    assert out["no_user"][0] == 126 and "unable to find user no-such-user" in out["no_user"][1]
    assert out["missing"] == 127
    assert out["four_in"] < 3.5, out["four_in"]  # four 1 s commands at once, not one after the other
    assert out["timeout"].startswith("Command timed out")
    assert "limit" in out["limit"] and out["limit"] != "none"
    assert out["binary"] and out["relative"] == "relative"
    assert out["read_missing"] == "FileNotFoundError" and out["read_dir"] != "none"
    assert out["isolated"] != 0  # another sample's episode does not see this one's files
