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
from dataclasses import dataclass

__all__ = ["ExecResult", "Shell", "SHELL_SETUP"]

log = logging.getLogger("sequester.episodes")

# trap : INT -- a job killed by ^C must not make the (non-interactive) shell exit.
SHELL_SETUP = "set -m\ntrap : INT\n"
_KILL_GRACE = 2.0


@dataclass(frozen=True)
class ExecResult:
    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    duration: float
    note: str = ""

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def to_dict(self) -> dict[str, object]:
        return {"stdout": self.stdout, "stderr": self.stderr, "exit_code": self.exit_code,
                "timed_out": self.timed_out, "duration": self.duration, "note": self.note}


class Shell:
    """A running bash; :meth:`run` one command at a time (not thread-safe)."""

    def __init__(self, pid: int, control: int, stdout: int, master: int):
        self.pid = pid
        self._control = control
        self._stdout = stdout
        self._master = master
        self.alive = True

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
        note = ""
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
            if (out.truncated or err.truncated) and not note:
                note = f"output over {output_limit} bytes per stream: the rest was dropped"
            code_text = out.after(out_mark)
            if code_text is not None and b"\x1e" in code_text and err.after(err_mark) is not None:
                code_text = code_text.split(b"\x1e", 1)[0]
                code = int(code_text) if code_text.isdigit() else None
                return self._result(out.before(out_mark), err.before(err_mark), code, stage != "running", started, note)

    def _interrupt(self) -> None:
        try:
            os.write(self._master, b"\x03")
        except OSError:
            pass

    def _kill_foreground(self) -> None:
        """SIGKILL the terminal's foreground job; if that is the shell itself (a builtin
        loop), the shell goes and is restarted by the episode."""
        try:
            group = os.tcgetpgrp(self._master)
        except OSError:
            group = 0
        target = group if group > 1 else self.pid
        try:
            os.killpg(target, signal.SIGKILL) if target != self.pid else os.kill(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    @staticmethod
    def _result(out: bytes | _Capture, err: bytes | _Capture, code: int | None, timed_out: bool, started: float,
                note: str) -> ExecResult:
        out_b = out.text() if isinstance(out, _Capture) else out
        err_b = err.text() if isinstance(err, _Capture) else err
        return ExecResult(out_b.decode(errors="replace"), err_b.decode(errors="replace"), code, timed_out,
                          time.monotonic() - started, note)


class _Capture:
    """One stream's output: the first ``limit`` bytes, plus a short tail in which the
    end-of-command marker is looked for even when the middle was dropped."""

    _TAIL = 4096

    def __init__(self, limit: int):
        self.limit = limit
        self.head = bytearray()
        self.tail = bytearray()
        self.truncated = False

    def add(self, data: bytes) -> None:
        room = self.limit - len(self.head)
        if room > 0 and not self.truncated:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.truncated = True
            self.tail += data
            del self.tail[:-self._TAIL]

    def _all(self) -> bytes:
        return bytes(self.tail if self.truncated else self.head)

    def after(self, mark: bytes) -> bytes | None:
        data = self._all()
        i = data.rfind(mark)
        return None if i < 0 else data[i + len(mark):]

    def before(self, mark: bytes) -> bytes:
        if not self.truncated:
            return bytes(self.head[: self.head.rfind(mark)])
        return bytes(self.head) + b"\n[... output dropped ...]\n" + self._all()[: self._all().rfind(mark)]

    def text(self) -> bytes:
        return bytes(self.head) + (b"\n[... output dropped ...]\n" + bytes(self.tail) if self.truncated else b"")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
