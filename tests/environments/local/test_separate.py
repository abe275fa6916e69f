"""A separate verifier environment (:mod:`sequester.environments.local.separate`): the task's pristine view plus its artifacts only."""

from __future__ import annotations

import pytest

from sequester.environments.local.episode import Episode
from sequester.errors import TaskError
from sequester.tasks.task_toml import parse_task_config
from tasks import make_task

# 1 only if the artifact arrived and nothing else of the agent's did.
CHECK = ('if [ "$(cat /app/out 2>/dev/null)" = ok ] && [ ! -e /app/other ] && [ ! -e /usr/local/bin/planted ]'
         '; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n')


def _task(tmp_path, artifacts: str, mode: str = ""):
    task = make_task(tmp_path, test_sh=CHECK)
    (task / "task.toml").write_text(f'version = "1.0"\nartifacts = {artifacts}\n[verifier]\ntimeout_sec = 30\n{mode}')
    return task


def test_only_declared_artifacts_reach_a_separate_verifier(tmp_path):
    with Episode() as ep:
        ep.reset(_task(tmp_path, '["/app/out", "/app/link"]'))
        ep.exec("echo ok > /app/out; touch /app/other /usr/local/bin/planted; ln -s /etc /app/link")
        shared = ep.evaluate(verifier_env="shared")
        separate = ep.evaluate(verifier_env="separate")
    assert shared.reward == 0.0  # control: in the shared view the agent's other changes are there
    assert separate.reward == 1.0 and any("separate environment" in n for n in separate.notes)


def test_the_task_can_ask_for_separate_mode_and_missing_artifacts_are_noted(tmp_path):
    with Episode() as ep:
        ep.reset(_task(tmp_path, '["/app/out", "/app/nothing"]', 'environment_mode = "separate"\n'))
        # (its pristine view is started with the episode: what the agent does after that
        # must not be in it)
        ep.exec("echo ok > /app/out; touch /app/other /usr/local/bin/planted")
        result = ep.evaluate()
    assert result.reward == 1.0 and any("/app/nothing does not exist" in n for n in result.notes)


def test_no_agent_process_is_in_a_separate_verifier(tmp_path):
    script = "ps -eo comm | grep -c '^sleep$' > /logs/verifier/sleeps.txt\necho 1 > /logs/verifier/reward.txt\n"
    task = make_task(tmp_path, test_sh=script)
    with Episode() as ep:
        ep.reset(task)
        ep.exec("sleep 300 &")
        result = ep.evaluate(verifier_env="separate")
    assert result.files["sleeps.txt"].strip() == b"0"


def test_artifact_links_are_kept_as_links(tmp_path):
    script = '{ test -L /app/d/link && echo 1 || echo 0; } > /logs/verifier/reward.txt\n'
    task = make_task(tmp_path, test_sh=script)
    (task / "task.toml").write_text('version = "1.0"\nartifacts = ["/app/d"]\n[verifier]\ntimeout_sec = 30\n')
    with Episode() as ep:
        ep.reset(task)
        ep.exec("mkdir -p /app/d && ln -s /etc /app/d/link")
        result = ep.evaluate(verifier_env="separate")
    assert result.reward == 1.0


@pytest.mark.parametrize("text, message", [
    ('artifacts = ["app/out"]\n', "absolute path"),
    ('artifacts = ["/app/../etc"]\n', "'..'"),
    ('artifacts = [{exclude = ["x"]}]\n', "needs 'source'"),
    ('[verifier]\nenvironment_mode = "elsewhere"\n', "environment_mode"),
])
def test_bad_artifact_declarations_name_the_field(text, message):
    with pytest.raises(TaskError, match=message):
        parse_task_config(text, "task.toml")


def test_unpacking_artifacts_writes_nothing_through_a_link(tmp_path):
    """A crafted tar (a link to /etc, then a file below the link) cannot write into the
    verifier's /etc: the link is kept, the file through it is refused."""
    import io
    import tarfile

    from sequester.errors import SandboxError

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        link = tarfile.TarInfo("app/link")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc"
        tar.addfile(link)
        evil = tarfile.TarInfo("app/link/written-through")
        evil.size = 1
        tar.addfile(evil, io.BytesIO(b"x"))
    with Episode() as ep:
        ep.reset(make_task(tmp_path))
        with pytest.raises(SandboxError):
            ep._nsexec_call().extract_artifacts(ep.init_pid, buf.getvalue())
        assert ep.exec("test -e /etc/written-through && echo THROUGH || echo no").stdout.strip() == "no"


@pytest.mark.parametrize("close_after", [None, 0.0])
def test_a_process_that_exits_right_after_a_separate_evaluation_leaves_no_environment(tmp_path, close_after):
    """The separate environment is removed a moment after the verdict (a timer): a process
    that ends before the timer fires removes it on its way out, and one that ends while the
    timer's removal is under way waits for it (found by CI, under load), not the next start."""
    import os
    import subprocess
    import sys

    state = tmp_path / "state"
    task = make_task(tmp_path, test_sh="echo 1 > /logs/verifier/reward.txt\n")
    script = (
        "import sys\n"
        "from sequester.environments.local.episode import Episode\n"
        "from sequester.environments.settings import EpisodeSettings\n"
        + (f"import sequester.environments.local.separate as s; s._CLOSE_AFTER = {close_after}\n"
           if close_after is not None else "")
        + f"ep = Episode(EpisodeSettings(state_dir={str(state)!r}))\n"
        f"ep.reset({str(task)!r})\n"
        # (folders in the work the separate environment gets: its removal takes a while)
        "ep.exec('mkdir -p /app/many && cd /app/many && seq 1 2000 | xargs mkdir')\n"
        "print(ep.evaluate(verifier_env='separate').reward)\n"
        "ep.close()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0 and done.stdout.strip() == "1.0", done.stderr[-2000:]
    left = [p.name for p in state.iterdir() if not p.name.startswith("skeleton-")] if state.exists() else []
    assert left == [], left


def _sandboxes() -> int:
    """The sandboxes (bwrap processes) this test process runs."""
    import os

    from sequester.sandbox.procs import descendants

    count = 0
    for pid in descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/comm") as f:
                count += f.read().strip() == "bwrap"
        except OSError:
            pass
    return count


def test_a_declared_separate_verifier_view_starts_with_the_episode_and_never_outlives_it(tmp_path):
    """A task that declares separate mode: its pristine view is started with the episode
    (one more sandbox while the agent works than a shared-mode task has), used by the
    evaluation, and removed by a reset to another task and by close. (Counted against a
    shared-mode episode: how many bwrap processes one sandbox is depends on the caller.)"""
    import time

    separate = _task(tmp_path / "s", '["/app/out"]', 'environment_mode = "separate"\n')
    shared = make_task(tmp_path / "h", test_sh=CHECK)  # (no artifacts: a task that declares some is separate)

    def settle(ok):
        deadline = time.monotonic() + 30
        while not ok() and time.monotonic() < deadline:
            time.sleep(0.05)
        return ok()

    before = _sandboxes()
    with Episode() as ep:
        ep.reset(shared)
        assert settle(lambda: _sandboxes() > before)
        time.sleep(0.3)
        base = _sandboxes()  # the agent's sandbox alone
        ep.reset(separate)
        assert settle(lambda: _sandboxes() > base)  # ... and the spare
        ep.exec("echo ok > /app/out")
        assert ep.evaluate().reward == 1.0
        ep.reset(shared)  # no spare for a shared-mode task; the used one is removed a moment later
        assert settle(lambda: _sandboxes() == base)
        ep.reset(separate)
        assert settle(lambda: _sandboxes() > base)
    assert settle(lambda: _sandboxes() == before)
