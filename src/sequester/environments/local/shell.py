"""The agent's persistent shell: one bash per episode, driven over pipes and a pty.

bash reads its commands from a pipe (``/dev/fd/3``); each command is ``eval``'d in the
shell itself, so ``cd`` and ``export`` persist. The shell's controlling terminal is a pty
we hold the master of: with job control on (``set -m``), each command runs as the
terminal's foreground job, so a timeout writes ``^C`` to the pty and interrupts exactly
that job (background processes the agent started live on), then kills the foreground
process group if it ignores the interrupt. stdout comes back over a pipe, stderr over
the pty; a random marker after each command, on both, tells where its output ends.
"""

from __future__ import annotations

import logging
import os
import secrets
import select
import signal
import termios
import time

from sequester.environments.base import ExecResult
from sequester.sandbox.procs import pid_namespace, signal_group_in

__all__ = ["Shell", "SHELL_SETUP"]

log = logging.getLogger("sequester.environments.local")

# trap : INT -- a job killed by ^C must not make the (non-interactive) shell exit.
SHELL_SETUP = "set -m\ntrap : INT\n"
_KILL_GRACE = 2.0


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

    @staticmethod
    def make_pty() -> tuple[int, int]:
        """A pty with raw output (no ``\\n`` to ``\\r\\n``) and no echo: (master, slave)."""
        master, slave = os.openpty()
        attrs = termios.tcgetattr(slave)
        attrs[1] &= ~termios.OPOST
        attrs[3] &= ~(termios.ECHO | termios.ICANON)
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
        os.set_inheritable(master, False)
        return master, slave

    def close(self) -> None:
        for fd in (self._control, self._stdout, self._master):
            try:
                os.close(fd)
            except OSError:
                pass
        self.alive = False

    def run(self, command: str, timeout: float, output_limit: int) -> ExecResult:
        started = time.monotonic()
        nonce = secrets.token_hex(8)
        out_mark, err_mark = f"\x1eSEQ{nonce} ".encode(), f"\x1eSEQ{nonce}\x1e".encode()
        script = (
            f"IFS= read -r -d '' __seq_cmd <<'__SEQ_{nonce}'\n{command}\n__SEQ_{nonce}\n"
            'eval "$__seq_cmd" </dev/null\n__seq_rc=$?\n'
            f"printf '\\036SEQ{nonce} %d\\036' \"$__seq_rc\"\nprintf '\\036SEQ{nonce}\\036' >&2\n"
        )
        try:
            _write_all(self._control, script.encode())
        except OSError:
            self.alive = False
            return ExecResult("", "", None, False, 0.0, "the shell is gone")
        out, err = _Capture(output_limit), _Capture(output_limit)
        deadline = started + timeout
        stage = "running"  # -> "interrupted" -> "killed"
        note = ""  # nothing to add yet (the output cap's note comes from the captures)
        while True:
            now = time.monotonic()
            if now >= deadline:
                if stage == "running":
                    stage, deadline = "interrupted", now + _KILL_GRACE
                    self._interrupt()
                    continue
                if stage == "interrupted":
                    stage, deadline = "killed", now + _KILL_GRACE
                    self._kill_foreground()
                    continue
                self.alive = False  # the shell itself does not come back
                return self._result(out, err, None, True, started, "the shell stopped answering and was restarted")
            ready, _, _ = select.select([self._stdout, self._master], [], [], deadline - now)
            for fd in ready:
                try:
                    data = os.read(fd, 1 << 16)
                except OSError:
                    data = b""
                if not data:
                    self.alive = False
                    return self._result(out, err, None, stage != "running", started, "the shell exited")
                (out if fd == self._stdout else err).add(data)
            code_text = out.after(out_mark)
            if code_text is not None and b"\x1e" in code_text and err.after(err_mark) is not None:
                code_text = code_text.split(b"\x1e", 1)[0]
                code = int(code_text) if code_text.isdigit() else None
                return self._result(out, err, code, stage != "running", started, note, (out_mark, err_mark))

    def _interrupt(self) -> None:
        try:
            os.write(self._master, b"\x03")
        except OSError:
            pass

    def _kill_foreground(self) -> None:
        """SIGKILL the terminal's foreground job; if that is the shell itself (a builtin
        loop), the shell goes and is restarted by the episode.

        Attack: the agent sets its terminal's foreground group to one that has died; a
        ``killpg`` by that number from the host would hit whatever host group reuses it.
        So each process is found in the episode's PID namespace, held by a pidfd (which
        cannot come to mean another process), checked again, and signalled through it."""
        try:
            group = os.tcgetpgrp(self._master)
        except OSError:
            group = 0
        if group > 1 and group != self.pid and signal_group_in(self._pid_ns, group, signal.SIGKILL):
            return
        # The shell itself, or a foreground group with no process of the episode (a
        # dead one the agent named): the shell's whole session goes, the shell with it.
        signal_group_in(self._pid_ns, self.pid, signal.SIGKILL, session=True)

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

    def after(self, mark: bytes) -> bytes | None:
        """What follows the last ``mark`` in the stream's recent output (None: no mark yet)."""
        recent = bytes(self.window[-self._SLACK :])
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
