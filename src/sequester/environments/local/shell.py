"""The agent's persistent shell: one bash per episode, driven over pipes and a pty.

bash reads its commands from a pipe (``/dev/fd/3``); each command is ``eval``'d in the
shell itself, so its state persists (the list is in docs/running-tasks.md). The shell's
controlling terminal is a pty we hold the master of, and job control is on (``set -m``,
asserted before each command), so each command's programs run as the terminal's
foreground job. stdout comes back over a pipe, stderr over the pty; a random marker after
each command, on both, tells where its output ends.

**A timeout ends the whole command**, not only the program running at that moment: its
foreground processes and the rest of its command line, with the shell's state kept.
bash abandons the rest of a command line and reads on (``DISCARD``) when a foreground
job it waits for dies of SIGINT and SIGINT is trapped in the shell (the shell's own trap,
``:``). That alone is not enough: a job that ignores or catches ``^C`` (``trap '' INT``,
pytest), the ``^C`` reaching the shell before the job took the terminal (a loaded
machine), a loop of builtins, all let the command line go on. So at the deadline:

1. The shell is sent :data:`ABORT_SIGNAL` (first: pending before the job it waits for
   ends), then SIGINT goes to the terminal's foreground job, as a ``^C`` would (programs
   may clean up; never to the shell itself). The shell traps the abort with ``__seq_abort``: while a command runs
   (``__seq_busy``, set when the command starts, cleared before its marker), that runs a
   foreground ``bash -c 'kill -INT $$'`` (run once the job it waits for has ended), whose
   death by SIGINT makes bash abandon the rest of the command line. Between commands it
   does nothing. Then a fresh *sync* line is written after the command's; its marker is
   what the host waits for (the abandoned line may have been the command's own marker).
2. After :data:`_KILL_GRACE`, if the sync marker is not in: once more the abort signal
   and a sync line, then SIGKILL the foreground job (the shell's own process group but
   the shell, for a command substitution).
3. After :data:`_ANSWER_GRACE` more: the shell itself does not answer (the agent replaced the trap,
   say): its whole session is killed and the episode starts a new shell (state lost,
   said in the result's note).

Each signal goes through a pidfd of a process checked to be in the episode's PID
namespace. Jobs the command put in the background (``&``, ``nohup``, ``setsid``) are in
process groups of their own and keep running.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import termios
import time

from sequester.environments.base import ExecResult
from sequester.sandbox.hostlimits import no_pty_left
from sequester.sandbox.procs import open_pidfd, pid_namespace, signal_group_in, signal_in
from sequester.sandbox.readiness import readable_among

__all__ = ["Shell", "SHELL_SETUP", "ABORT_SIGNAL"]

log = logging.getLogger("sequester.environments.local")

ABORT_SIGNAL = signal.SIGRTMAX - 2
"""Sent to the shell at a timeout (a real-time signal: no program of the agent's traps it)."""

# trap : INT -- a job killed by ^C must not make the (non-interactive) shell exit, and
# with SIGINT trapped bash abandons the command line instead. expand_aliases: the agent's
# aliases work as in a terminal (the protocol's own words are quoted against them).
SHELL_SETUP = f"""set -m
trap : INT
shopt -s expand_aliases
__seq_bash=${{BASH:-bash}}
__seq_abort() {{
  [[ -n ${{__seq_busy-}} ]] || return 0
  __seq_busy=
  case $(trap -p INT) in
    "") trap : INT ;;
    "trap -- '' SIGINT") trap : INT; __seq_int_ignored=1 ;;
  esac
  "$__seq_bash" -c 'kill -INT $$' || :
}}
trap __seq_abort {int(ABORT_SIGNAL)}
"""
_KILL_GRACE = 2.0
# After the kill: the shell needs only to run its trap and print a line. A shell that does
# not within this long does not answer (its trap replaced), and goes; generous, so that a
# loaded machine never costs an agent its shell's state.
_ANSWER_GRACE = 10.0


def command_script(command: str, nonce: str) -> str:
    """What the shell is sent for ``command``: one line that starts it (``__seq_busy``,
    job control and the abort trap asserted, the command read from a here-document and
    ``eval``'d), then :func:`marker_line`. Pure."""
    return (
        f"__seq_busy=1; [[ $- == *m* ]] || \\set -m; \\trap __seq_abort {int(ABORT_SIGNAL)}; __seq_cmd=; "
        f"IFS= \\read -r -d '' __seq_cmd <<'__SEQ_{nonce}' || :; \\eval \"$__seq_cmd\" </dev/null\n"
        f"{command}\n__SEQ_{nonce}\n" + marker_line(nonce)
    )


def marker_line(nonce: str) -> str:
    """The line that ends a command: its status, then a marker on stdout (with the status)
    and on stderr. Also a sync line after an abort. Pure."""
    return (
        '__seq_rc=$? __seq_busy=; if [[ -n ${__seq_int_ignored-} ]]; then __seq_int_ignored=; \\trap "" INT; fi; '
        f"\\printf '\\036SEQ{nonce} %d\\036' \"$__seq_rc\"; \\printf '\\036SEQ{nonce}\\036' >&2\n"
    )


def _marks(nonce: str) -> tuple[bytes, bytes]:
    return f"\x1eSEQ{nonce} ".encode(), f"\x1eSEQ{nonce}\x1e".encode()


class Shell:
    """A running bash; :meth:`run` one command at a time (not thread-safe)."""

    def __init__(self, pid: int, control: int, stdout: int, master: int, pid_ns: str | None = None):
        """``pid_ns``: the episode's PID namespace (``readlink /proc/INIT/ns/pid``): only
        processes in it are ever signalled."""
        self.pid = pid
        self._control = control
        self._stdout = stdout
        self._master = master
        self.alive = True
        self._pid_ns = pid_ns or pid_namespace(pid)
        # Readable once the shell has exited (its pipes may stay open: background jobs hold them).
        self._pidfd = open_pidfd(pid, self._pid_ns) if self._pid_ns else None

    @staticmethod
    def make_pty() -> tuple[int, int]:
        """A pty with raw output (no ``\\n`` to ``\\r\\n``) and no echo: (master, slave).
        The machine's last pty taken (``kernel.pty.max``) is a :class:`SandboxError` naming it."""
        try:
            master, slave = os.openpty()
        except OSError as exc:
            full = no_pty_left(exc, "the episode's shell")
            if full is None:
                raise
            raise full from None
        attrs = termios.tcgetattr(slave)
        attrs[1] &= ~termios.OPOST
        attrs[3] &= ~(termios.ECHO | termios.ICANON)
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
        os.set_inheritable(master, False)
        return master, slave

    def close(self) -> None:
        for fd in (self._control, self._stdout, self._master, self._pidfd):
            if fd is None:
                continue
            try:
                os.close(fd)
            except OSError:
                pass
        self.alive = False

    def run(self, command: str, timeout: float, output_limit: int) -> ExecResult:
        started = time.monotonic()
        nonce = secrets.token_hex(8)
        try:
            _write_all(self._control, command_script(command, nonce).encode())
        except OSError:
            self.alive = False
            return ExecResult("", "", None, False, 0.0, "the shell is gone")
        out, err = _Capture(output_limit), _Capture(output_limit)
        marks = [_marks(nonce)]  # the command's, then one per sync line; the last one ends the wait
        deadline = started + timeout
        stage = "running"  # -> "interrupted" -> "killed"
        while True:
            now = time.monotonic()
            if now >= deadline:
                if stage in ("running", "interrupted"):
                    # The abort first: pending in the shell before the job it waits for ends,
                    # so the first trap point after that end runs it (see the module).
                    if not self._sync(marks):
                        self.alive = False
                        return self._result(out, err, None, True, started, "the shell is gone")
                    if stage == "running":
                        stage, deadline = "interrupted", now + _KILL_GRACE
                        self._interrupt()
                    else:
                        stage, deadline = "killed", now + _ANSWER_GRACE
                        self._kill_foreground()
                    continue
                # The shell did not answer its sync line: it goes, and the episode starts another.
                signal_group_in(self._pid_ns, self.pid, signal.SIGKILL, session=True)
                self.alive = False
                return self._result(
                    out,
                    err,
                    None,
                    True,
                    started,
                    "the command did not end and the shell was killed and restarted (its state was lost)",
                )
            watched = [self._stdout, self._master] + ([self._pidfd] if self._pidfd is not None else [])
            ready = readable_among(watched, deadline - now)
            gone = self._pidfd is not None and self._pidfd in ready
            for fd in ready if not gone else self._drain(out, err):
                try:
                    data = os.read(fd, 1 << 16)
                except OSError:
                    data = b""
                if not data:
                    gone = True
                    break
                (out if fd == self._stdout else err).add(data)
            if gone:
                self.alive = False
                return self._result(out, err, None, stage != "running", started, "the shell exited")
            last_out, last_err = marks[-1]
            code_text = out.after(last_out)
            if code_text is not None and b"\x1e" in code_text and err.after(last_err) is not None:
                # The command's own marker if it got to print it, else the first sync line's.
                for out_mark, err_mark in marks:
                    found = out.after(out_mark, whole=True)
                    if found is not None and b"\x1e" in found and err.after(err_mark, whole=True) is not None:
                        code_text = found
                        break
                code_text = code_text.split(b"\x1e", 1)[0]
                code = int(code_text) if code_text.isdigit() else None
                return self._result(out, err, code, stage != "running", started, "", (out_mark, err_mark))

    def _drain(self, out: _Capture, err: _Capture) -> list[int]:
        """The shell has exited: what it wrote before is read (the pipes do not end while a
        background job holds them, so only what is there now). Returns no descriptor."""
        open_fds = [self._stdout, self._master]
        for _ in range(64):
            ready = readable_among(open_fds, 0)
            if not ready:
                break
            for fd in ready:
                try:
                    data = os.read(fd, 1 << 16)
                except OSError:
                    data = b""
                if not data:
                    open_fds.remove(fd)
                (out if fd == self._stdout else err).add(data)
            if not open_fds:
                break
        return []

    def _sync(self, marks: list[tuple[bytes, bytes]]) -> bool:
        """Send the shell the abort signal, then a sync line after it (see the module)."""
        signal_in(self.pid, self._pid_ns, ABORT_SIGNAL)
        nonce = secrets.token_hex(8)
        try:
            _write_all(self._control, marker_line(nonce).encode())
        except OSError:
            return False
        marks.append(_marks(nonce))
        return True

    def _foreground(self) -> int:
        """The terminal's foreground process group (host pid numbering; 0: none)."""
        try:
            return os.tcgetpgrp(self._master)
        except OSError:
            return 0

    def _interrupt(self) -> None:
        """What ``^C`` does to the foreground job, but never to the shell itself: SIGINT to
        every process of the terminal's foreground group but the shell. (A ``^C`` through
        the terminal would reach the shell too while it runs a builtin, such as ``wait``,
        and bash then loses the abort signal that arrives with it.)"""
        group = self._foreground()
        if group > 1:
            signal_group_in(self._pid_ns, group, signal.SIGINT, spare=self.pid)

    def _kill_foreground(self) -> None:
        """SIGKILL the terminal's foreground job; when that is the shell's own process group
        (a command substitution, a builtin loop), every process of it but the shell.

        Attack: the agent sets its terminal's foreground group to one that has died; a
        ``killpg`` by that number from the host would hit whatever host group reuses it.
        So each process is found in the episode's PID namespace, held by a pidfd (which
        cannot come to mean another process), checked again, and signalled through it."""
        group = self._foreground()
        if group > 1:
            signal_group_in(self._pid_ns, group, signal.SIGKILL, spare=self.pid)

    @staticmethod
    def _result(
        out: _Capture,
        err: _Capture,
        code: int | None,
        timed_out: bool,
        started: float,
        note: str,
        marks: tuple[bytes | None, bytes | None] = (None, None),
    ) -> ExecResult:
        notes = [note] if note else []
        texts = []
        for name, capture, mark in (("stdout", out, marks[0]), ("stderr", err, marks[1])):
            kept, size = capture.content(mark)
            texts.append(kept.decode(errors="replace"))
            if len(kept) < size:
                notes.append(
                    f"{name} was {size} bytes, over the cap of {capture.limit} per stream (output_bytes): "
                    f"{capture.describe_cut()}"
                )
        return ExecResult(texts[0], texts[1], code, timed_out, time.monotonic() - started, "; ".join(notes))


DROPPED = b"\n[... output dropped ...]\n"
"""What stands for the dropped middle of a stream's output; counted in the cap."""


class _Capture:
    """One stream's output, capped at exactly ``limit`` bytes.

    Output that fits is kept whole. Longer output becomes its first bytes, :data:`DROPPED`,
    and its last bytes: ``limit`` bytes in all, the marker included (the head gets the odd
    byte). A ``limit`` too small to hold the marker and a byte on each side keeps only the
    first ``limit`` bytes. The cap counts bytes as written; decoding turns a character cut
    at an edge into U+FFFD.

    Memory stays near ``limit``: beyond the head, only a window of the last
    ``tail_size + _SLACK`` bytes (up to twice that between trims) is kept, in which the
    end-of-command mark, written after the output, is found.
    """

    _SLACK = 4096

    def __init__(self, limit: int):
        self.limit = max(int(limit), 1)
        room = self.limit - len(DROPPED)
        self.head_size = (room + 1) // 2 if room >= 2 else self.limit
        self.tail_size = self.limit - len(DROPPED) - self.head_size if room >= 2 else 0
        self.window = bytearray()  # the whole stream, until it outgrows limit + _SLACK; then its end
        self.head = b""  # the first head_size bytes, once the stream has outgrown that
        self.total = 0
        self.truncated = False

    def add(self, data: bytes) -> None:
        self.total += len(data)
        self.window += data
        if not self.truncated:
            if len(self.window) <= self.limit + self._SLACK:
                return
            self.truncated = True
            self.head = bytes(self.window[: self.head_size])
            del self.window[: self.head_size]
        keep = self.tail_size + self._SLACK
        if len(self.window) > 2 * keep:  # trimmed in batches: amortised O(1) per byte
            del self.window[: len(self.window) - keep]

    def after(self, mark: bytes, *, whole: bool = False) -> bytes | None:
        """What follows the last ``mark`` in the stream's recent output (``whole``: anywhere
        in what is kept of its end), or None: no mark yet."""
        recent = bytes(self.window if whole else self.window[-self._SLACK :])
        i = recent.rfind(mark)
        return None if i < 0 else recent[i + len(mark) :]

    def content(self, mark: bytes | None = None) -> tuple[bytes, int]:
        """(what is kept of the output before ``mark``, the output's full size in bytes);
        ``mark`` None: everything written."""
        window = bytes(self.window)
        end = window.rfind(mark) if mark is not None else -1
        if end >= 0:
            window = window[:end]
        size = len(self.head) + (self.total - len(self.head) - len(self.window)) + len(window)
        if not self.truncated and len(window) <= self.limit:
            return window, size
        head, rest = (self.head, window) if self.truncated else (window[: self.head_size], window[self.head_size :])
        if self.tail_size == 0:
            return head[: self.limit], size
        return head + DROPPED + rest[len(rest) - self.tail_size :], size

    def describe_cut(self) -> str:
        if self.tail_size == 0:
            return f"kept its first {self.limit} bytes"
        return (
            f"kept its first {self.head_size} and last {self.tail_size} bytes around the marker "
            f"{DROPPED.strip().decode()!r} ({self.limit} bytes in all)"
        )


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
