"""The host side of a kernel: :class:`Kernel`.

    with Kernel(policy) as k:
        r = k.run("x = 1\\nx + 1")      # r.value == "2"

Everything the kernel sends is untrusted: messages are size-limited and validated,
output is capped, and the deadlines are kept here, on the host, whatever the kernel
does with its own timers.
"""

from __future__ import annotations

import codecs
import enum
import logging
import os
import selectors
import threading
import time
from collections.abc import Callable
from typing import Any

from sequester.errors import KernelClosedError, KernelError, SandboxError
from sequester.kernel.launch import KernelProcess, launch_kernel
from sequester.kernel.protocol import MessageReader, ProtocolError, frame_limit, write_message
from sequester.kernel.results import CellError, CellResult
from sequester.kernel.start_timing import phases as _phases
from sequester.policy import Isolation, Policy
from sequester.sandbox.bwrap import read_pending

__all__ = ["Kernel"]

log = logging.getLogger("sequester")

OutputCallback = Callable[[str, str], None]

_START_TIMEOUT = 30.0
# After a cell's timeout the kernel interrupts itself; the host waits this much longer
# before it kills and restarts the kernel.
_INTERRUPT_GRACE = 2.0
# Output past the cap that the host tolerates (written below Python, e.g. os.write)
# before it kills the kernel.
_OUTPUT_SLACK = 64 * 1024


class _State(enum.Enum):
    UNOPENED = "unopened"
    OPEN = "open"
    CLOSED = "closed"


class _CellFailure(Exception):
    """The kernel must be killed to recover from this cell."""

    def __init__(self, error: CellError, *, timed_out: bool = False, stdout: str = "", stderr: str = ""):
        super().__init__(str(error))
        self.error = error
        self.timed_out = timed_out
        self.stdout, self.stderr = stdout, stderr  # what the cell wrote before it failed


class Kernel:
    """A persistent Python process, confined by ``policy``, that runs code cells.

    ``init``: a *warm kernel*. It runs this cell once when it starts (imports, loaded
    data) and then runs no other: :meth:`fork` hands out kernels that are copy-on-write
    copies of it, each with what init left and its own namespaces, workspace and network
    (see ``docs/kernels.md``)."""

    def __init__(self, policy: Policy | None = None, *, init: str | None = None):
        if init is not None and not isinstance(init, str):
            raise TypeError(f"init must be a str of Python code, not {type(init).__name__}")
        self._init = init
        self._warm_parent: Kernel | None = None  # a fork's warm kernel
        self._in_init = False
        self._fork_lock = threading.Lock()
        self.init_result: CellResult | None = None
        self.policy = policy if policy is not None else Policy()
        self._state = _State.UNOPENED
        self._process: KernelProcess | None = None
        self._report: dict[str, Any] = {}
        self._deadline = 0.0
        self._next_id = 0
        self._start_timing: dict[str, float] = {}
        self._owner = os.getpid()  # the process whose kernel this is (see _kill)

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> Kernel:
        if self._state is _State.CLOSED:
            raise KernelClosedError("this kernel was closed; make a new one")
        if self._state is _State.OPEN:
            return self
        self._deadline = time.monotonic() + self.policy.limits.kernel_timeout
        self._spawn()
        self._state = _State.OPEN
        return self

    def restart(self) -> None:
        """Kill the kernel process and start a fresh one (state and workspace are lost)."""
        self._ensure_open()
        self._kill()
        self._spawn()

    def close(self) -> None:
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        if self._process is not None:
            try:
                write_message(self._process.to_kernel, {"op": "shutdown"})
            except OSError:
                pass
        self._kill()

    def __enter__(self) -> Kernel:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_process", None) is not None:
            self._kill()

    @property
    def closed(self) -> bool:
        return self._state is _State.CLOSED

    def alive(self) -> bool:
        """Started, not closed, and its process still running."""
        return self._state is _State.OPEN and self._process is not None and self._process.popen.poll() is None

    def begin_lifetime(self) -> None:
        """Start ``limits.kernel_timeout`` over from now: a pooled kernel's lifetime counts
        from when it is handed out (:class:`~.pool.KernelPool`), not from its start."""
        self._ensure_open()
        self._deadline = time.monotonic() + self.policy.limits.kernel_timeout

    def resident_bytes(self) -> int:
        """Bytes resident in all of the kernel's processes (bwrap, init, Python); 0 when gone."""
        total = 0
        for pid in self._process.host_pids() if self._process is not None else ():
            try:
                with open(f"/proc/{pid}/statm", "rb") as f:
                    total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except (OSError, ValueError, IndexError):
                continue
        return total

    @property
    def mode(self) -> Isolation:
        """The isolation in force: ``SANDBOX``, ``GUARD`` or ``OFF`` (``AUTO`` resolved)."""
        if self._process is None:
            raise KernelError("the kernel is not started")
        return self._process.mode

    @property
    def report(self) -> dict[str, Any]:
        """What the kernel's bootstrap reported: uid, capabilities, seccomp, Landlock."""
        return dict(self._report)

    @property
    def start_timing(self) -> dict[str, float]:
        """Milliseconds of each phase of the last start, in order (see :func:`.start_timing.phases`): the
        host's steps, bwrap's, and those the kernel timestamped (its clock is the host's
        CLOCK_MONOTONIC). Diagnostics only: the kernel's timestamps are its word."""
        return dict(self._start_timing)

    @property
    def process(self) -> KernelProcess | None:
        """The running process (its host pids, workspace, broker); for diagnostics."""
        return self._process

    def _ensure_open(self) -> None:
        if self._state is not _State.OPEN:
            raise KernelClosedError(f"the kernel is {self._state.value}")

    def _kill(self) -> None:
        if self._process is not None:
            if os.getpid() == self._owner:
                self._process.terminate()
            else:
                # Attack (red team): a forked child that finalizes (or closes) its copy of
                # this Kernel killed its parent's kernel through the inherited handles. In
                # another process only that process's copies of the pipes are closed.
                self._process.forget()
            self._process = None

    # -- warm kernels -----------------------------------------------------------------

    @property
    def warm(self) -> bool:
        """This is a warm kernel (``init=``): it forks kernels and runs no cells."""
        return self._init is not None

    def fork(self) -> Kernel:
        """A kernel that is a copy-on-write fork of this warm kernel as its init cell left
        it: started, ready for its first cell, with namespaces, workspace and network of
        its own and every isolation property of a kernel; nothing another fork does
        reaches it. Its lifetime counts from now. A fork's ``restart`` is a fresh fork."""
        self._ensure_open()
        if not self.warm:
            raise KernelError("only a warm kernel forks: make it with Kernel(policy, init=CODE)")
        child = Kernel(self.policy)
        child._warm_parent = self
        child._deadline = time.monotonic() + self.policy.limits.kernel_timeout
        child._spawn()
        child._state = _State.OPEN
        return child

    def _fork_process(self) -> KernelProcess:
        """A fork's process, ready for its handshake (the warm kernel's answer read). A fork
        channel that can no longer pair a request with its answer closes the warm kernel
        (and its forks): it would hand the next fork another's process."""
        from sequester.kernel.fork import ForkChannelBroken, fork_kernel

        self._ensure_open()
        with self._fork_lock:
            process = self._process
            if process is None or process.fork_channel is None or process.popen.poll() is not None:
                raise KernelClosedError("the warm kernel is not running")
            timing = {"launch": time.monotonic_ns()}
            write_message(process.to_kernel, {"op": "fork"})
            try:
                forked = fork_kernel(process, self.policy, process.fork_channel, timing)
            except ForkChannelBroken:
                self.close()
                raise
            except BaseException:
                self._fork_answer(process)  # it answered that it could not: read that, keep in step
                raise
            answer = self._fork_answer(process)
            if answer != "forked":
                forked.terminate()
                raise SandboxError(f"the warm kernel could not fork: {answer}")
            return forked

    def _fork_answer(self, process: KernelProcess) -> str:
        """The warm kernel's own answer to a fork request on its pipe (``forked`` or why not);
        none in time closes it."""
        try:
            message, _, _ = self._wait_message(process, time.monotonic() + _START_TIMEOUT, None, startup=True)
        except _CellFailure as failure:
            self.close()
            raise SandboxError(f"the warm kernel did not answer a fork request: {failure.error}") from None
        if message.get("op") == "forked":
            return "forked"
        return str(message.get("error", message.get("op")))

    def _spawn(self) -> None:
        if self._warm_parent is not None:
            process = self._warm_parent._fork_process()
        else:
            process = launch_kernel(self.policy, warm=self.warm)
        self._owner = os.getpid()
        self._process = process
        try:
            try:
                process.send_config()
            except BrokenPipeError:
                pass  # the first stage is gone: its own words (or its death) come next
            message, _, err = self._wait_message(process, time.monotonic() + _START_TIMEOUT, None, startup=True)
            ready_ns = time.monotonic_ns()
            if message.get("op") != "ready":
                reason = message.get("error", "no reason given")
                raise SandboxError(f"the kernel failed to confine itself: {reason}\n{err.strip()}".strip())
            report = message.get("report")
            if not isinstance(report, dict):
                raise SandboxError("the kernel's ready message has no report")
            if not report.get("warm"):  # its /proc is covered: its native plan checked itself
                _verify(process.mode, report, expect_uid=process.config.get("drop_to_uid"))
            if self._warm_parent is not None:
                self._check_fork(process)
        except _CellFailure as failure:
            self._kill()
            said = failure.stderr.strip()
            raise SandboxError(f"the kernel did not start: {failure.error}" + (f"\n{said}" if said else "")) from None
        except BaseException:
            self._kill()
            raise
        self._start_timing = _phases(process.timing, report.pop("timing", None), ready_ns)
        # Host-side fact, not the kernel's word: which first stage confined it.
        report["first_stage"] = (
            ("native" if process.native_stage else "python") if process.mode is not Isolation.OFF else "none"
        )
        # ... and whether the view was a template's (kept per policy) or bwrap's own.
        report["view"] = (
            ("template" if process.from_template else "bwrap") if process.mode is Isolation.SANDBOX else "none"
        )
        if self._warm_parent is not None:
            report["view"] = "fork"
        if process.view_note:
            report["view_note"] = process.view_note
        if process.native_stage and process.config.get("write_lock") and not self.warm:
            report.setdefault("landlock_abi", process.config["write_lock"]["abi"])
        self._report = report
        if process.mode is Isolation.OFF:
            log.warning("runtime.isolation = false: the kernel runs with NO isolation (debugging only)")
        if self._init is not None:
            self._in_init = True
            try:
                self.init_result = self._run_cell(self._init, None, "<init>", None)
            finally:
                self._in_init = False
            if self.init_result.error is not None:
                error = self.init_result.error
                self._kill()
                raise KernelError(f"the warm kernel's init cell failed: {error.type}: {error.message}")

    def _check_fork(self, process: KernelProcess) -> None:
        """The host's own look at a fork (:func:`~.fork.verify_fork`); a fork that is not one
        means the warm kernel lied: it is closed, and so are its forks."""
        from sequester.kernel.fork import verify_fork

        parent = self._warm_parent
        assert parent is not None and parent._process is not None
        try:
            verify_fork(process, parent._process)
        except SandboxError:
            parent.close()
            raise

    # -- cells ----------------------------------------------------------------------

    def run(
        self,
        code: str,
        *,
        timeout: float | None = None,
        filename: str | None = None,
        on_output: OutputCallback | None = None,
    ) -> CellResult:
        """Run one cell. Blocked or failing code is a result with ``error``, never an exception.

        ``timeout`` (seconds) defaults to the policy's ``cell_timeout`` and is clipped to
        what is left of ``kernel_timeout``. ``on_output(stream, text)`` receives output
        as it is written (``stream`` is ``"stdout"`` or ``"stderr"``).
        """
        self._ensure_open()
        if self.warm:
            raise KernelError("a warm kernel runs only its init cell: fork() it and run cells in the fork")
        return self._run_cell(code, timeout, filename, on_output)

    def _run_cell(
        self, code: str, timeout: float | None, filename: str | None, on_output: OutputCallback | None
    ) -> CellResult:
        started = time.monotonic()
        life_left = self._deadline - started
        if life_left <= 0:
            self.close()
            raise KernelClosedError(f"the kernel's {self.policy.limits.kernel_timeout:g} s lifetime is over")
        wanted = self.policy.limits.cell_timeout if timeout is None else timeout
        if wanted <= 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        budget = min(wanted, life_left)
        self._next_id += 1
        request = {
            "op": "run",
            "id": self._next_id,
            "code": code,
            "timeout": budget,
            "filename": filename or "<cell>",
            "stream": on_output is not None,
        }
        assert self._process is not None
        try:
            write_message(self._process.to_kernel, request)
            message, out, err = self._wait_message(self._process, started + budget + _INTERRUPT_GRACE, on_output)
        except _CellFailure as failure:
            return self._recover(failure, started, budget >= life_left)
        except OSError as exc:
            return self._recover(_CellFailure(CellError("KernelDied", f"the kernel went away: {exc}")), started, False)
        if message.get("op") != "result" or message.get("id") != self._next_id:
            return self._recover(
                _CellFailure(CellError("KernelError", "the kernel answered out of turn")), started, False
            )
        error = _cell_error(message.get("error"))
        timed_out = error is not None and error.type == "TimeoutError"
        if timed_out and budget >= life_left:
            self.close()
            error = CellError(
                "KernelTimeout",
                f"the kernel's {self.policy.limits.kernel_timeout:g} s lifetime ran out "
                "during this cell; the kernel is closed",
            )
        value = message.get("value")
        return CellResult(
            out, err, value if isinstance(value, str) else None, error, time.monotonic() - started, timed_out=timed_out
        )

    def _recover(self, failure: _CellFailure, started: float, lifetime_hit: bool) -> CellResult:
        """Kill the kernel; restart it unless its lifetime is over."""
        out, err = failure.stdout, failure.stderr
        error = failure.error
        if self._in_init:  # a warm kernel that dies in its init is not started again and again
            self._kill()
            raise KernelError(f"the warm kernel's init cell failed: {error.type}: {error.message}")
        if self._warm_parent is not None and not self._warm_parent.alive():
            # A fork whose warm kernel is gone cannot be forked again: closed, said as a result.
            self.close()
            error = CellError("KernelDied", f"{error.message}; its warm kernel is gone, so the fork is closed")
            return CellResult(out, err, None, error, time.monotonic() - started, timed_out=failure.timed_out)
        if lifetime_hit and failure.timed_out:
            self.close()
            error = CellError(
                "KernelTimeout",
                f"the kernel's {self.policy.limits.kernel_timeout:g} s lifetime ran out; "
                "the kernel was killed and is closed",
            )
            return CellResult(out, err, None, error, time.monotonic() - started, timed_out=True)
        self._kill()
        self._spawn()
        log.info("kernel restarted after: %s", error)
        return CellResult(
            out, err, None, error, time.monotonic() - started, timed_out=failure.timed_out, restarted=True
        )

    def _wait_message(
        self, process: KernelProcess, deadline: float, on_output: OutputCallback | None, *, startup: bool = False
    ) -> tuple[dict[str, Any], str, str]:
        """Read the kernel's pipes until one protocol message arrives, or fail.

        Raises :class:`_CellFailure` (with the output so far) on death, deadline or
        output over the cap.
        """
        # Frames too are untrusted input: bounded by what an honest result can hold.
        reader = MessageReader(frame_limit(self.policy.limits.output_bytes))
        chunks: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        decoders = {k: codecs.getincrementaldecoder("utf-8")("replace") for k in chunks}
        size = 0
        cap = self.policy.limits.output_bytes + _OUTPUT_SLACK
        names = {process.stdout: "stdout", process.stderr: "stderr"}
        with selectors.DefaultSelector() as sel:
            for fd in (process.from_kernel, process.stdout, process.stderr):
                sel.register(fd, selectors.EVENT_READ)

            def text(name: str) -> str:
                return b"".join(chunks[name]).decode("utf-8", "replace")

            def fail(error: CellError, timed_out: bool = False) -> _CellFailure:
                return _CellFailure(error, timed_out=timed_out, stdout=text("stdout"), stderr=text("stderr"))

            def take(name: str, data: bytes) -> None:
                nonlocal size
                chunks[name].append(data)
                size += len(data)
                if size > cap:
                    raise fail(
                        CellError(
                            "OutputLimitExceeded",
                            f"the cell wrote more than {self.policy.limits.output_bytes} "
                            "bytes outside Python's streams; the kernel was killed and restarted",
                        )
                    )
                if on_output is not None:
                    piece = decoders[name].decode(data)
                    if piece:
                        on_output(name, piece)

            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    if startup:
                        raise fail(CellError("TimeoutError", f"no answer within {_START_TIMEOUT:g} s"))
                    raise fail(
                        CellError(
                            "TimeoutError",
                            "the cell ran over its timeout and did not stop when "
                            "interrupted; the kernel was killed and restarted (its state is lost)",
                        ),
                        True,
                    )
                for key, _ in sel.select(left):
                    fd = key.fd
                    try:
                        data = os.read(fd, 65536)
                    except OSError:
                        data = b""
                    if fd == process.from_kernel:
                        if not data:
                            raise fail(CellError("KernelDied", _death_reason(process)))
                        try:
                            messages = reader.feed(data)
                        except ProtocolError as exc:
                            raise fail(
                                CellError(
                                    "KernelError", f"the kernel broke the protocol ({exc}); it was killed and restarted"
                                )
                            ) from None
                        if messages:
                            for out_fd, name in names.items():
                                # Written before the result message: already in the pipe.
                                if data := read_pending(out_fd, limit=1 << 20):  # the rest: next cell
                                    take(name, data)
                            return messages[0], text("stdout"), text("stderr")
                        continue
                    if not data:
                        sel.unregister(fd)
                        continue
                    take(names[fd], data)


# (phase, from mark, to mark): host marks are plain names, the kernel's "k:" names.
def _death_reason(process: KernelProcess) -> str:
    try:
        code = process.popen.wait(timeout=2)
    except Exception:  # noqa: BLE001
        return "the kernel process died"
    if code < 0:
        return f"the kernel process was killed by signal {-code}"
    if process.mode is Isolation.SANDBOX and code > 128:
        # bwrap reports its child's death by signal N as status 128 + N.
        return f"the kernel process was killed by signal {code - 128}"
    return f"the kernel process exited with status {code}"


def _cell_error(raw: Any) -> CellError | None:
    if not isinstance(raw, dict):
        return None
    return CellError(str(raw.get("type", "Error")), str(raw.get("message", "")), str(raw.get("traceback", "")))


def _verify(mode: Isolation, report: dict[str, Any], expect_uid: int | None = None) -> None:
    """Fail closed unless the kernel's own report shows the confinement in place.
    ``expect_uid``: the uid and gid a root caller's kernel must have dropped to."""
    if mode is Isolation.OFF:
        return
    problems = []
    if expect_uid is not None and (report.get("uid"), report.get("gid")) != (expect_uid, expect_uid):
        problems.append(f"uid/gid are {report.get('uid')}/{report.get('gid')}, not {expect_uid}")
    if report.get("seccomp") != "2":
        problems.append(f"seccomp mode is {report.get('seccomp')!r}, not 2 (filter)")
    if report.get("no_new_privs") != "1":
        problems.append("no_new_privs is not set")
    caps = report.get("caps", {})
    if mode is Isolation.SANDBOX:
        nonzero = {k: v for k, v in caps.items() if int(v or "0", 16)}
        if nonzero:
            problems.append(f"capabilities remain: {nonzero}")
    elif any(int(caps.get(k) or "0", 16) for k in ("CapEff", "CapPrm", "CapAmb")):
        problems.append(f"capabilities remain: {caps}")
    if problems:
        raise SandboxError("the kernel is not confined as required: " + "; ".join(problems))
