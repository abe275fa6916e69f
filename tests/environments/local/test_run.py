"""``Episode.run``: a fresh process of the episode beside the agent's shell, with the same
restrictions, bounded in time and output, its whole process group ended at the deadline."""

from __future__ import annotations

import threading
import time

from paths import EXAMPLES

TASK = EXAMPLES / "c-word-count"
STATUS = "grep -E '^(CapEff|CapBnd|Seccomp|NoNewPrivs|Uid)' /proc/self/status; cat /proc/self/cgroup; ulimit -u"


def test_a_process_gets_what_the_agents_shell_gets(episode):
    episode.start(TASK)
    shell = episode.exec(STATUS).stdout
    fresh = episode.run(["bash", "-c", STATUS]).stdout
    assert "Seccomp:\t2" in fresh and fresh == shell


def test_nothing_of_one_call_stays_and_the_shell_is_untouched(episode):
    episode.start(TASK)
    episode.exec("cd /tmp && export IN_SHELL=1")
    r = episode.run(["sh", "-c", "echo ${IN_SHELL-unset}; pwd; cd /; export X=1"])
    assert r.stdout == "unset\n/app\n" and r.exit_code == 0
    assert episode.exec("pwd; echo $IN_SHELL").stdout == "/tmp\n1\n"


def test_the_deadline_ends_the_whole_process_group(episode):
    episode.start(TASK)
    started = time.monotonic()
    r = episode.run(["sh", "-c", "sleep 300 & sleep 300"], timeout=1)
    assert r.timed_out and r.exit_code is None and time.monotonic() - started < 5
    left = episode.exec("ps -eo args | grep -c '^sleep 300'").stdout.strip()
    assert left == "0"


def test_output_past_the_limit_ends_the_command(episode):
    episode.start(TASK)
    r = episode.run(["sh", "-c", "yes | head -c 50000000; echo after"], output_limit=4096)
    assert len(r.stdout) == 4096 and "after" not in r.stdout and "passed 4096 bytes" in r.note


def test_calls_run_at_once(episode):
    episode.start(TASK)
    took: list[float] = []
    threads = [threading.Thread(target=lambda: took.append(episode.run(["sleep", "1"]).duration)) for _ in range(4)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(took) == 4 and time.monotonic() - started < 3


def test_a_background_process_holding_the_output_does_not_hold_the_call(episode):
    episode.start(TASK)
    r = episode.run(["sh", "-c", "sleep 30 & echo started"], timeout=20)
    assert r.stdout == "started\n" and r.exit_code == 0 and r.duration < 5
