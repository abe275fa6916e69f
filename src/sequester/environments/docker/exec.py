"""One command in a container: ``exec_create`` + ``exec_start(socket=True)``, the
multiplexed stream read here, bounded, under a deadline the host enforces.

Why not ``exec_run``: it reads until the stream ends, without a deadline and without a
bound -- a command that prints for ever fills the host's memory, one that hangs holds
the caller for ever, and one that starts ``sleep 100 &`` (which keeps the stream's write
end open) never returns. Here the command is done when its *own* process exits (its
pidfd, or the engine's ``exec_inspect``); its background processes live on.

The timeout: an image need not have a ``timeout`` binary, and one the agent could write
would be the agent's to disarm. With the engine on this host the exec's process is a host
pid (``exec_inspect()["Pid"]``): at the deadline its whole tree is killed from the host,
through pidfds (:mod:`sequester.sandbox.procs`). An engine elsewhere: the command is started through a
one-line ``sh`` wrapper that reports its pid inside the container, and a second exec
kills that tree (best effort: that second exec runs the container's own ``sh``).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

from sequester.environments.docker.engine import EngineError
from sequester.sandbox.procs import kill_tree, open_pidfd
from sequester.sandbox.readiness import readable

__all__ = ["RawExec", "run_exec", "Demux"]

_DRAIN_IDLE, _DRAIN_MAX = 0.1, 2.0  # after the process ended: read what is still in flight
_EXIT_WAIT = 5.0  # the engine records the exit code shortly after the exit
_ASK_EVERY = 0.1  # seconds between "does it still run?" while the stream stays open
_MARK = b"\x1esequester-pid:"
# Reports the shell's pid on stderr (its first line, removed by the reader), then becomes the command.
_WRAPPER = ["/bin/sh", "-c", 'printf "\\036sequester-pid:%s\\n" "$$" >&2; exec "$@"', "sh"]
# Enters the working directory in the shell, not by the engine's exec option: the agent can
# remove or replace the folder, and the engine would then refuse the exec (an error the
# agent caused). A folder that is gone leaves the command in /.
_CD = ["/bin/sh", "-c", 'cd -- "$0" 2>/dev/null || cd /; exec "$@"']
# Kills a process tree inside the container with nothing but sh builtins (stop first, then kill).
_KILL_SCRIPT = (
    'k() { kill -STOP "$1" 2>/dev/null; for f in /proc/"$1"/task/*/children; do '
    '[ -r "$f" ] || continue; read -r l < "$f" || l=$l; for c in $l; do k "$c"; done; done; '
    'kill -KILL "$1" 2>/dev/null; }; k "$0"'
)


@dataclass
class Capture:
    """One stream's bytes, the first ``limit`` kept; the rest counted and dropped (read on
    so the writer never blocks on a full pipe)."""

    limit: int
    data: bytearray = field(default_factory=bytearray)
    dropped: int = 0

    def add(self, chunk: bytes) -> None:
        room = self.limit - len(self.data)
        if room > 0:
            self.data += chunk[:room]
        self.dropped += max(0, len(chunk) - max(room, 0))


class Demux:
    """The engine's multiplexed stream: frames of an 8-byte header (stream id: 1 stdout,
    2 stderr; three zero bytes; big-endian payload length) and the payload."""

    def __init__(self, limit: int):
        self.out, self.err = Capture(limit), Capture(limit)
        self._buf = bytearray()
        self._left = 0  # payload bytes of the current frame still to come
        self._target: Capture | None = None

    def feed(self, chunk: bytes) -> None:
        self._buf += chunk
        while self._buf:
            if self._left == 0:
                if len(self._buf) < 8:
                    return
                head = bytes(self._buf[:8])
                del self._buf[:8]
                self._left = int.from_bytes(head[4:8], "big")
                self._target = self.err if head[0] == 2 else self.out
                continue
            take = bytes(self._buf[: self._left])
            del self._buf[: len(take)]
            self._left -= len(take)
            assert self._target is not None
            self._target.add(take)


@dataclass(frozen=True)
class RawExec:
    stdout: bytes
    stderr: bytes
    exit_code: int | None
    timed_out: bool
    duration: float
    notes: tuple[str, ...] = ()


def _api_call(what: str, fn: Any, *args: Any, **kw: Any) -> Any:
    try:
        return fn(*args, **kw)
    except Exception as exc:  # noqa: BLE001 - APIError, requests' errors: the engine's failure
        raise EngineError(f"the engine failed to {what}: {exc}") from exc


def _inspect(api: Any, exec_id: str) -> dict[str, Any]:
    return _api_call("inspect an exec", api.exec_inspect, exec_id)


def run_exec(
    client: Any,
    container_id: str,
    argv: list[str],
    *,
    timeout: float,
    output_bytes: int,
    env: dict[str, str] | None = None,
    workdir: str | None = None,
    namespace: str | None = None,
    wrap: bool | None = None,
) -> RawExec:
    """Run ``argv`` in the container (see the module). ``namespace``: the container's PID
    namespace as seen from here (``pid:[N]``), None when its processes are not visible
    (a remote engine); ``wrap`` (default: without a namespace) starts it through the
    pid-reporting wrapper. Raises :class:`EngineError` when the engine fails a request."""
    api = client.api
    started = time.monotonic()
    deadline = started + timeout
    wrap = namespace is None if wrap is None else wrap
    wrapped = [*_CD, workdir, *argv] if workdir else list(argv)
    wrapped = [*_WRAPPER, *wrapped] if wrap else wrapped
    # workdir "/": the engine's default is the container's WorkingDir, which the agent can remove.
    exec_id = _api_call("create an exec", api.exec_create, container_id, wrapped, environment=env, workdir="/")["Id"]
    sock = _api_call("start an exec", api.exec_start, exec_id, socket=True)
    raw = getattr(sock, "_sock", sock)  # SocketIO wraps the connected socket; recv on it directly
    demux, notes = Demux(output_bytes), []
    pid, pidfd = None, None
    try:
        # The command's end is its stream's end, or (a background process holding the
        # stream) the engine saying it no longer runs. Its pid is asked only at the
        # deadline: asking at once cost ~40 ms of every exec on podman.
        timed_out = _wait(api, exec_id, raw, demux, deadline)
        if timed_out:
            notes.append(
                f"the command ran over its {timeout:g} s and was killed, with every process still below it "
                "(one it detached, e.g. by setsid and a double fork, keeps running until the episode closes)"
            )
            if namespace:
                pid, pidfd = _running_pid(api, exec_id, namespace)
            if pid:
                assert namespace is not None  # a pid is only asked for in a namespace (above)
                kill_tree(pid, namespace, pidfd=pidfd)
            elif wrap:
                _kill_in_container(client, container_id, demux, notes)
            else:
                notes.append("the engine never said the command's pid, so it could not be killed")
        _drain(raw, demux)
    finally:
        with contextlib.suppress(OSError):
            sock.close()
        if pidfd is not None:
            os.close(pidfd)
    duration = time.monotonic() - started
    exit_code = _exit_code(api, exec_id)
    stderr = bytes(demux.err.data)
    if wrap:
        stderr = re.sub(rb"\A" + re.escape(_MARK) + rb"\d+\n", b"", stderr, count=1)
    for name, cap in (("stdout", demux.out), ("stderr", demux.err)):
        if cap.dropped:
            notes.append(f"{name} was cut at {cap.limit} bytes ({cap.dropped} more were dropped)")
    return RawExec(bytes(demux.out.data), stderr, exit_code, timed_out, duration, tuple(notes))


def _running_pid(api: Any, exec_id: str, namespace: str) -> tuple[int | None, int | None]:
    """The exec's host pid and a pidfd on it, if it still runs (else ``(None, None)``)."""
    pid = _inspect(api, exec_id).get("Pid") or None
    pidfd = open_pidfd(pid, namespace) if pid else None  # None: it already ended (or not ours)
    if pidfd is not None:
        # Attack/accident: the exec ended and its pid was reused (in the container) before
        # the pidfd was opened. Still running under that pid after the open: the pidfd is
        # the exec's process.
        again = _inspect(api, exec_id)
        if not again.get("Running") or again.get("Pid") != pid:
            os.close(pidfd)
            return None, None
    return (pid, pidfd) if pidfd is not None else (None, None)


def _wait(api: Any, exec_id: str, raw: Any, demux: Demux, deadline: float) -> bool:
    """Read the stream until the command's process ends (True: the deadline came first).
    Its end is the stream's end, or, when a process it left in the background holds the
    stream open (and may keep writing to it), the engine saying the exec no longer runs:
    asked at most ten times a second, whatever the stream does."""
    ask_at = time.monotonic() + _ASK_EVERY
    while True:
        now = time.monotonic()
        if now >= deadline:
            return True
        ready = readable(raw, max(0.0, min(deadline, ask_at) - now))
        if ready:
            chunk = raw.recv(65536)
            if not chunk:
                return False
            demux.feed(chunk)
        if time.monotonic() >= ask_at:
            if not _inspect(api, exec_id).get("Running"):
                return False
            ask_at = time.monotonic() + _ASK_EVERY


def _drain(raw: Any, demux: Demux) -> None:
    """What the process wrote just before it ended is still on its way: read until the
    stream ends, or is idle a moment (a background process holds it open), bounded."""
    end = time.monotonic() + _DRAIN_MAX
    while (left := end - time.monotonic()) > 0:
        ready = readable(raw, min(_DRAIN_IDLE, left))
        if not ready:
            return
        try:
            chunk = raw.recv(65536)
        except OSError:
            return
        if not chunk:
            return
        demux.feed(chunk)


def _exit_code(api: Any, exec_id: str) -> int | None:
    end = time.monotonic() + _EXIT_WAIT
    while True:
        info = _inspect(api, exec_id)
        if not info.get("Running"):
            code = info.get("ExitCode")
            return code if isinstance(code, int) else None
        if time.monotonic() > end:
            return None
        time.sleep(0.02)


def _kill_in_container(client: Any, container_id: str, demux: Demux, notes: list[str]) -> None:
    """The fallback kill (see the module): the wrapper's reported pid, killed with its tree
    by a second exec."""
    match = re.match(re.escape(_MARK) + rb"(\d+)\n", bytes(demux.err.data))
    if match is None:
        notes.append("the command's pid was never reported, so it could not be killed")
        return
    try:
        run_exec(
            client,
            container_id,
            ["/bin/sh", "-c", _KILL_SCRIPT, match[1].decode()],
            timeout=10,
            output_bytes=4096,
            wrap=False,
        )
    except EngineError as exc:
        notes.append(f"the command could not be killed: {exc}")
