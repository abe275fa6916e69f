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


# Red team: the status was a wrapper's, on a pipe it held as fd 3; an agent process reopened
# it through /proc/PID/fd/3, wrote "0" and killed the wrapper, so a failing command read as
# passed. Now the helper's worker, outside the episode's PID namespace, is the parent.
FORGER = r"""
import os, signal, time
end = time.time() + 30
while time.time() < end:
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) == os.getpid():
            continue
        try:
            argv = open(f"/proc/{p}/cmdline", "rb").read()
        except OSError:
            continue
        if b"VICTIM" in argv:
            for fd in os.listdir(f"/proc/{p}/fd"):
                try:
                    w = os.open(f"/proc/{p}/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK)
                    os.write(w, b"0")
                    os.close(w)
                except OSError:
                    pass
            try:
                os.kill(int(p), signal.SIGKILL)
            except OSError:
                pass
    time.sleep(0.005)
"""


def test_no_agent_process_can_forge_a_calls_status(episode):
    episode.start(TASK)
    episode.write_file("/tmp/forger.py", FORGER)
    episode.exec("setsid nohup python3 /tmp/forger.py >/dev/null 2>&1 </dev/null & sleep 0.3")
    r = episode.run(["sh", "-c", "sleep 1; exit 1", "VICTIM"], timeout=10)
    assert r.exit_code in (1, 137) and not r.timed_out, r  # its own status, or killed: never a forged 0


def test_input_nobody_reads_costs_no_thread_and_no_wait(episode):
    """Attack on the host: a command whose background child holds its stdin and never reads
    it. The input was written by a thread per call, which blocked until the episode closed:
    an agent's tool calls could pile up threads without end. The host writes it from the
    call's own loop and drops what is not taken when the command is over."""
    episode.start(TASK)
    before = threading.active_count()
    for _ in range(5):
        # (an asynchronous list's stdin is /dev/null unless redirected: fd 3 is the pipe)
        r = episode.run(["sh", "-c", "exec 3<&0; sleep 30 <&3 >/dev/null 2>&1 & echo started"],
                        input=b"x" * (4 << 20), timeout=20)
        assert r.stdout == "started\n" and r.exit_code == 0 and r.duration < 5
    assert threading.active_count() <= before


def test_input_is_delivered_whole(episode):
    episode.start(TASK)
    data = bytes(range(256)) * 8192  # 2 MiB: many times a pipe's buffer
    r = episode.run(["sh", "-c", "wc -c; echo done"], input=data, timeout=30)
    assert r.stdout.split() == [str(len(data)), "done"] and r.exit_code == 0
