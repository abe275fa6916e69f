"""One fresh process in an episode, beside the agent's shell: started by the namespace
helper with the agent's restrictions, its output and status read on pipes, bounded, under
a deadline the host keeps (:meth:`~sequester.environments.local.episode.Episode.run`).

The process is a session leader of its own (the helper's ``setsid``); the helper's worker,
outside the episode's PID namespace (no agent process can see, trace or signal it), is its
parent and writes its exit status on a pipe of the host's when it ends. At the deadline,
or once a stream passes its limit, its whole process group is killed. Once the status is
in, output still held open by a background process is read only while it keeps coming
(:data:`LINGER` of quiet ends it), as ``docker exec`` ends with its command.
"""

from __future__ import annotations

import os
import selectors
import signal
import time
from collections.abc import Mapping, Sequence

from sequester.environments.base import ExecResult
from sequester.guard import seccomp
from sequester.sandbox.bwrap import close_fd
from sequester.sandbox.nsexec.client import NsExec

__all__ = ["run_process", "LINGER"]

LINGER = 0.1  # seconds of quiet after the status before the output is taken as it is


def run_process(
    nsexec: NsExec,
    target: int,
    argv: Sequence[str],
    *,
    env: dict[str, str],
    cwd: str,
    input: bytes | None,
    timeout: float,
    output_limit: int,
    caps: Sequence[str],
    cgroup: str | Sequence[str] | None,
    rlimits: Mapping[str, int | list[int]],
    ids: tuple[int, int] | None,
) -> ExecResult:
    """Run ``argv`` in the episode of ``target``; see the module."""
    started = time.monotonic()
    pipes = [os.pipe() for _ in range(4)]  # stdin, stdout, stderr, status
    (in_r, in_w), (out_r, out_w), (err_r, err_w), (st_r, st_w) = pipes
    for fd in (in_w, out_r, err_r, st_r):
        os.set_inheritable(fd, False)
    try:
        pid = nsexec.run(
            target,
            list(argv),
            env=env,
            cwd=cwd,
            stdin=in_r,
            stdout=out_w,
            stderr=err_w,
            status=st_w,
            caps=caps,
            seccomp_bpf=seccomp.compile_filter("agent"),
            seccomp_nr=seccomp.syscall_number("seccomp"),
            cgroup=cgroup,
            rlimits=rlimits,
            ids=ids,
        )
    except BaseException:
        for fd in (in_w, out_r, err_r, st_r):
            close_fd(fd)
        raise
    finally:
        for fd in (in_r, out_w, err_w, st_w):
            close_fd(fd)
    # The input is written from this loop, never a thread of its own: a process (or a
    # background child holding its stdin) that never reads it cost a blocked thread per
    # call until the episode closed. What is not taken by the end is dropped.
    pending = memoryview(input or b"")
    out, err, status = bytearray(), bytearray(), bytearray()
    timed_out = cut = False
    deadline = started + timeout
    sel = selectors.DefaultSelector()
    stdin_open = True
    try:
        for fd, buf in ((out_r, out), (err_r, err), (st_r, status)):
            sel.register(fd, selectors.EVENT_READ, buf)
        if pending:
            os.set_blocking(in_w, False)
            sel.register(in_w, selectors.EVENT_WRITE, None)
        else:
            os.close(in_w)
            stdin_open = False
        done_at: float | None = None
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            wait = deadline - now
            if done_at is not None:
                wait = min(wait, max(0.0, done_at + LINGER - now))
            events = sel.select(wait)
            if not events and done_at is not None and time.monotonic() >= done_at + LINGER:
                break  # the command is over; what a background process holds open is not waited for
            for key, _ in events:
                if key.fd == in_w:
                    try:
                        pending = pending[os.write(in_w, pending[: 1 << 16]) :]
                    except BlockingIOError:
                        continue
                    except OSError:  # the reader went away (EPIPE): the rest is not taken
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(in_w)
                        os.close(in_w)
                        stdin_open = False
                    continue
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fd)
                    if key.fd == st_r:
                        done_at = time.monotonic()
                    continue
                buf = key.data
                room = output_limit - len(buf) if buf is not status else 64 - len(buf)
                buf += chunk[: max(room, 0)]
                if len(chunk) > room and buf is not status:
                    cut = True
            if cut:
                break
            if done_at is not None:
                done_at = time.monotonic() if events else done_at
            if done_at is not None and stdin_open and len(sel.get_map()) == 1:
                break  # the command is over and only its unread input is left
    finally:
        sel.close()
        if timed_out or cut or not status:
            _kill_group(pid)
        for fd in (out_r, err_r, st_r, *((in_w,) if stdin_open else ())):
            close_fd(fd)
    code = int(status) if status.strip().isdigit() and not timed_out else None
    notes = []
    if cut:
        notes.append(f"the output passed {output_limit} bytes: the command was ended there")
    return ExecResult(
        out.decode(errors="replace"),
        err.decode(errors="replace"),
        code,
        timed_out,
        time.monotonic() - started,
        "; ".join(notes),
    )


def _kill_group(pid: int) -> None:
    """Kill the process group the process leads (it called setsid), and the process."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
