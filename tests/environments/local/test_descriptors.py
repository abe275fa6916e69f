"""Episodes and the calling process's descriptors (issue #25): an episode works when the
process holds more than 1024 of them (every wait is poll, not select); one idle episode
holds the number docs/running-tasks.md gives, and gives them all back; and a process whose
open-file limit cannot hold another episode gets a clear error from ``reset`` before
anything starts."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from many_fds import descriptors_above
from paths import EXAMPLES
from tasks import make_task

from sequester.agents import load_agent
from sequester.environments.local.episode import EPISODE_DESCRIPTORS, Episode
from sequester.environments.settings import EpisodeSettings
from sequester.sandbox.fdlimit import open_descriptors

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 and not Path("/proc/self/ns/user").exists(), reason="needs namespaces"
)

TASK = EXAMPLES / "python-csv-stats"
_NETWORK = shutil.which("slirp4netns") is not None and os.path.exists("/dev/net/tun")


def _next_fd() -> int:
    fd = os.open("/dev/null", os.O_RDONLY)
    os.close(fd)
    return fd


@pytest.mark.parametrize("verifier_env", ["shared", "separate"])
def test_an_episode_runs_and_scores_above_select_bound(verifier_env):
    """select() refused the 1024th descriptor: the reset failed with 'filedescriptor out of
    range in select()'. Every step here waits on descriptors above it: the init's start, the
    shell, a process beside it, the namespace helper's files and its evaluation."""
    with descriptors_above():
        assert _next_fd() > 1024
        with Episode(EpisodeSettings(verifier_env=verifier_env)) as ep:
            ep.reset(TASK, image=None)
            assert ep.exec("echo hi; echo err >&2").stdout == "hi\n"
            done = ep.run(["sh", "-c", "echo beside"], timeout=30)
            assert (done.exit_code, done.stdout) == (0, "beside\n"), done
            ep.write_file("/tmp/note.txt", "kept")
            assert ep.read_file("/tmp/note.txt") == b"kept"
            assert ep.exec("sleep 5", timeout=0.5).timed_out  # the deadline, on a high descriptor
            load_agent("oracle").run(ep.instruction, ep)
            result = ep.evaluate()
            assert result.reward == 1.0, result.output[-2000:]


@pytest.mark.skipif(not _NETWORK, reason="needs slirp4netns and /dev/net/tun")
def test_an_episode_with_a_network_starts_above_select_bound(tmp_path):
    """The network stack's ready descriptor and the helper's router pipes, above the bound
    (no packet leaves the machine: the agent runs nothing that reaches out)."""
    task = make_task(tmp_path, "net", toml="[environment]\nallow_internet = true\n")
    with descriptors_above():
        assert _next_fd() > 1024
        with Episode() as ep:
            ep.reset(task, image=None)
            assert ep.exec("grep -q eth0: /proc/net/dev && echo linked").stdout == "linked\n"
            assert ep.evaluate().reward == 1.0


def _fds() -> set[tuple[int, str]]:
    """This process's descriptors with what each is (a pipe's, socket's, file's identity)."""
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            out.add((int(name), os.readlink(f"/proc/self/fd/{name}")))
        except OSError:
            pass  # (the listing's own, closed by now)
    return out


def _held_while_idle(task: Path, settings: EpisodeSettings) -> tuple[int, int]:
    """Descriptors one idle episode holds in this process, and those of them left after its
    close (a first episode, not counted, starts the process's shared namespace helper).
    Counted by identity, not by number: a descriptor of an earlier test's closed meanwhile
    (its objects collected) does not count against this one (CI: 41 closed in the window)."""
    with Episode(settings) as warm:
        warm.reset(task, image=None)
        warm.exec("true")
        warm.evaluate()
    time.sleep(0.2)  # the last episode's threads gone
    before = _fds()
    ep = Episode(settings)
    try:
        ep.reset(task, image=None)
        ep.exec("true")
        time.sleep(0.2)
        opened = _fds() - before
    finally:
        ep.close()
    time.sleep(0.2)
    return len(opened), len(opened & _fds())


def test_an_idle_episode_holds_six_descriptors():
    """docs/running-tasks.md's count: the shell's pty and its two pipes, pidfds on the init
    and on the shell, the PID namespace."""
    held, left = _held_while_idle(TASK, EpisodeSettings())
    assert held == 6 and held <= EPISODE_DESCRIPTORS, held
    assert left == 0


@pytest.mark.skipif(not _NETWORK, reason="needs slirp4netns and /dev/net/tun")
def test_an_idle_episode_with_a_network_holds_seventeen(tmp_path):
    """docs/running-tasks.md's count with a network: the router's namespaces, the DNS
    responder's sockets and wake-up pipe, the stack's pipes, the relays'."""
    task = make_task(tmp_path, "net", toml="[environment]\nallow_internet = true\n")
    held, left = _held_while_idle(task, EpisodeSettings())
    assert held == 17 and held <= EPISODE_DESCRIPTORS, held
    assert left == 0


@pytest.mark.skipif(not _NETWORK, reason="needs slirp4netns and /dev/net/tun")
def test_no_process_holds_the_router_once_the_stack_is_up(tmp_path):
    """A process held the router's namespaces for the episode's whole life (the stack joins
    them through a pid, but only while it starts): a forked copy of the namespace helper's
    Python per episode with a network, 1 to 2 MB each, outside this process's tree. Now the
    host's descriptors hold them once the stack is up (tests/net/test_episode_refusals.py:
    the network works as before)."""
    task = make_task(tmp_path, "net", toml="[environment]\nallow_internet = true\n")
    with Episode() as ep:
        ep.reset(task, image=None)
        router = ep._run.network.router  # noqa: SLF001 - what holds the router
        router_net = os.readlink(f"/proc/self/fd/{router.netns}")
        deadline = time.monotonic() + 5
        while True:  # the holder's exit may take a moment
            inside = []
            for name in os.listdir("/proc"):
                try:
                    if name.isdigit() and os.readlink(f"/proc/{name}/ns/net") == router_net:
                        inside.append(name)
                except OSError:
                    pass
            if not inside or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert inside == [] and router.lifeline == -1, inside
        assert ep.exec("grep -q eth0: /proc/net/dev && echo linked").stdout == "linked\n"


# -- the open-file limit ---------------------------------------------------------------------

_LIMITED = """
import json, os, resource, sys
from pathlib import Path
from sequester.environments.local.episode import Episode
from sequester.errors import SandboxError
from sequester.sandbox.fdlimit import open_descriptors
task = Path(sys.argv[1])
"""


def _limited(body: str, task: Path = TASK) -> dict:
    code = _LIMITED + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", code, str(task)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_reset_refuses_up_front_when_the_limit_cannot_hold_another_episode():
    """A hard limit the process cannot raise, 100 descriptors short of it free: episodes
    start while there is room, then the next reset is a clear error, before anything of it
    starts; the running ones still work."""
    out = _limited("""
        limit = 256  # (the namespace helper, started below, places descriptors at 100 and up)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
        held = [os.open("/dev/null", os.O_RDONLY) for _ in range(limit - 100 - open_descriptors())]
        episodes, said, children = [], None, None
        while len(episodes) < 30:
            ep = Episode()
            try:
                ep.reset(task, image=None)
            except SandboxError as exc:
                said = str(exc)
                break
            episodes.append(ep)
            children = set()
            for tid in os.listdir("/proc/self/task"):
                children |= set(open(f"/proc/self/task/{tid}/children").read().split())
        after = set()
        for tid in os.listdir("/proc/self/task"):
            after |= set(open(f"/proc/self/task/{tid}/children").read().split())
        working = [e.exec("echo ok").stdout for e in episodes]
        for e in episodes:
            e.close()
        print(json.dumps({"started": len(episodes), "said": said, "limit": limit, "working": working,
                          "nothing_new": after == children}))
    """)
    assert out["said"] is not None, out
    assert 1 <= out["started"] < 30 and out["working"] == ["ok\n"] * out["started"], out
    assert out["said"].startswith("another episode needs 64 free file descriptors"), out["said"]
    assert f"RLIMIT_NOFILE: soft {out['limit']}, hard {out['limit']}" in out["said"]
    assert "ulimit -n 4096" in out["said"], out["said"]
    assert out["nothing_new"]  # the refused reset started no process


@pytest.mark.skipif(resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 4096, reason="needs a hard open-file limit of 4096")
def test_the_first_reset_raises_a_low_soft_limit():
    out = _limited("""
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 4096))
        with Episode() as ep:
            ep.reset(task, image=None)
            print(json.dumps({"limits": resource.getrlimit(resource.RLIMIT_NOFILE),
                              "agent": ep.exec("ulimit -Sn; ulimit -Hn").stdout.split()}))
    """)
    assert out["limits"] == [4096, 4096]
    assert out["agent"] == ["1024", "4096"]  # the agent's: a container's, whatever the caller's
