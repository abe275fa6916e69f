"""Host side of the namespace helper (see :mod:`.server`).

One helper process per host process serves every episode: it is started on first use,
dies with the host process, and forks a worker per request, so episodes never wait on
each other. Each call passes its own pipes, reads the worker's report from its own result
pipe, and can kill its worker on a deadline.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sequester.errors import SandboxError
from sequester.sandbox.bwrap import read_pending
from sequester.sandbox.readiness import readable, readable_among

__all__ = ["NsExec", "Router", "Worker", "HeadTail", "shared_nsexec", "write_and_close"]


class HeadTail:
    """A bounded buffer of at most ``limit`` bytes, marker included: everything while it
    fits, else the head and the tail around a marker line. Memory stays at ``limit``
    whatever is written (the verifier's output, which the agent's programs can flood)."""

    _MARK = b"\n[... output dropped ...]\n"

    def __init__(self, limit: int):
        self.limit = max(int(limit), 1)
        room = max(self.limit - len(self._MARK), 0)
        self._head_size = self.limit if room == 0 else room // 2
        self._tail_size = 0 if room == 0 else room - self._head_size
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    def __iadd__(self, data: bytes) -> HeadTail:
        if not self.dropped and len(self.head) + len(data) <= self.limit:
            self.head += data
            return self
        if not self.dropped:  # the first overflow: split what was kept into head and tail
            data = bytes(self.head) + bytes(data)
            self.head = bytearray(data[: self._head_size])
            data = data[self._head_size :]
        self.tail += data
        extra = len(self.tail) - self._tail_size
        if extra > 0:
            del self.tail[:extra]
            self.dropped += extra
        self.dropped = max(self.dropped, 1)
        return self

    def bytes(self) -> bytes:
        if not self.dropped:
            return bytes(self.head)
        mark = self._MARK if self._tail_size else b""
        return bytes(self.head) + mark + bytes(self.tail)


class Drain(Protocol):
    """Where a drained pipe's bytes go (``bytearray`` or :class:`HeadTail`): ``buf += data``."""

    def __iadd__(self, data: bytes, /) -> Drain: ...


@dataclass
class Worker:
    """A forked worker of the helper: its pid and the pipe it reports on."""

    pid: int
    result: int

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def report(self, deadline: float | None = None, also: Sequence[tuple[int, Drain]] = ()) -> dict[str, Any] | None:
        """Read the worker's report (one JSON line) until end of file; ``None`` on deadline.

        ``also`` are (fd, buffer) pairs drained meanwhile (e.g. the verifier's output).
        """
        # A report holds at most 8 MiB of verdict files (base64: 4/3 of that); bound it anyway.
        chunks = HeadTail(16 << 20)
        watched: dict[int, Drain] = {self.result: chunks, **{fd: buf for fd, buf in also}}
        try:
            while self.result in watched:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                ready = readable_among(list(watched), left)
                for fd in ready:
                    data = os.read(fd, 1 << 16)
                    if data:
                        watched[fd] += data
                    else:
                        del watched[fd]
            for fd, buf in also:  # whatever is left of the other pipes after the report
                if fd in watched:
                    buf += read_pending(fd, limit=1 << 20)
        finally:
            os.close(self.result)
        line = chunks.bytes().split(b"\n", 1)[0]
        if not line:
            return {"error": "the helper's worker ended without a report"}
        try:
            return json.loads(line)
        except ValueError:
            return {"error": "the helper's worker sent an unreadable report"}


@dataclass
class Router:
    """An episode's router namespace as the host holds it (made by :meth:`NsExec.net_router`):
    its user and network namespaces (descriptors), the pid of the process that holds them
    while the stack starts (the stack joins them through its pid) and the lifeline that
    keeps that process alive (closing it ends it: :meth:`release_holder`, once the stack is
    up), the DNS responder's UDP and TCP sockets in it, and the relays' listening sockets in
    the agent's namespace."""

    userns: int
    netns: int
    holder: int
    lifeline: int
    dns: list[socket.socket]
    relays: list[socket.socket]

    def release_holder(self) -> None:
        """End the holder (closing its lifeline): once the stack has joined the namespaces,
        nothing needs it (these descriptors, and the stack, keep them). Kept, it was a
        forked copy of the helper's Python per episode with a network, about 1 to 2 MB each
        (issue #25: a thousand episodes)."""
        if self.lifeline >= 0:
            try:
                os.close(self.lifeline)
            except OSError:
                pass
            self.lifeline = -1

    def close(self) -> None:
        for sock in (*self.dns, *self.relays):
            sock.close()
        for fd in (self.userns, self.netns, self.lifeline):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.dns, self.relays, self.userns, self.netns, self.lifeline = [], [], -1, -1, -1


class NsExec:
    """Client of one helper process."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self._lock = threading.Lock()
        try:
            self._proc = subprocess.Popen(
                # -s -P: no user site, no cwd on sys.path; PYTHONPATH still counts (it may be
                # how this process found sequester).
                [sys.executable, "-s", "-B", "-P", "-m", "sequester.sandbox.nsexec.server", str(theirs.fileno())],
                # No descriptor of the host's output: every process the helper starts (the
                # verifier's init is PID 1 of a namespace the tests' programs can read
                # /proc/1/fd of) would hold it. Workers report on their own pipes.
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            theirs.close()

    def close(self) -> None:
        self._sock.close()
        self._proc.kill()
        self._proc.wait()

    def request(self, message: dict[str, Any], fds: Sequence[int]) -> Worker:
        """Send a request with its descriptors (the first is the worker's result pipe,
        whose write end is closed here once sent)."""
        result_r, result_w = os.pipe()
        os.set_inheritable(result_r, False)
        try:
            with self._lock:
                socket.send_fds(self._sock, [json.dumps(message).encode()], [result_w, *fds])
                reply = self._sock.recv(1 << 16)
        except OSError as exc:
            os.close(result_r)
            raise SandboxError(f"the namespace helper is gone: {exc}") from exc
        finally:
            os.close(result_w)
        answer: dict[str, Any] = json.loads(reply) if reply else {"error": "the namespace helper is gone"}
        if "worker" not in answer:
            os.close(result_r)
            raise SandboxError(f"the namespace helper refused: {answer.get('error')}")
        return Worker(answer["worker"], result_r)

    # -- operations ------------------------------------------------------------------

    def spawn(
        self,
        target: int,
        argv: Sequence[str],
        *,
        env: dict[str, str],
        cwd: str,
        stdin: int,
        stdout: int,
        stderr: int,
        ctty: bool,
        caps: Sequence[str],
        seccomp_bpf: bytes,
        seccomp_nr: int,
        extra: Sequence[int] = (),
        cgroup: str | Sequence[str] | None = None,
        rlimits: Mapping[str, int | list[int]] | None = None,
        harden: bool = False,
        ids: tuple[int, int] | None = None,
        timeout: float = 30,
    ) -> int:
        """Start ``argv`` inside the episode of ``target``; returns its host pid.

        ``extra`` descriptors become 3, 4, ... in the new process; ``cgroup``: the
        ``cgroup.procs`` file(s) it joins first; ``rlimits``: resource
        limits by name (``{"RLIMIT_NPROC": 4096}``: soft and hard; ``[soft, hard]``; never
        above the caller's own hard limit), set before the exec;
        ``harden``: first do what :meth:`harden` does (the episode's first process);
        ``ids``: the uid and gid it becomes inside (an image's non-root ``User`` where the
        namespace's root is the caller), after its capabilities are cut to ``caps``."""
        message = _process_message(
            "spawn", target, argv, env, cwd, ctty, caps, seccomp_bpf, seccomp_nr, cgroup, rlimits, ids
        )
        worker = self.request({**message, "harden": harden}, [stdin, stdout, stderr, *extra])
        report = self._finish(worker, timeout, "start a process in the episode")
        return int(report["pid"])

    def run(
        self,
        target: int,
        argv: Sequence[str],
        *,
        env: dict[str, str],
        cwd: str,
        stdin: int,
        stdout: int,
        stderr: int,
        status: int,
        caps: Sequence[str],
        seccomp_bpf: bytes,
        seccomp_nr: int,
        cgroup: str | Sequence[str] | None = None,
        rlimits: Mapping[str, int | list[int]] | None = None,
        ids: tuple[int, int] | None = None,
        timeout: float = 30,
    ) -> int:
        """Like :meth:`spawn`, for a command whose status the host trusts: the helper's
        worker stays its parent, outside the episode's PID namespace, and writes its exit
        status (``128 + signal`` when killed) to ``status`` when it ends; returns its host pid."""
        message = _process_message(
            "run", target, argv, env, cwd, False, caps, seccomp_bpf, seccomp_nr, cgroup, rlimits, ids
        )
        worker = self.request(message, [stdin, stdout, stderr, status])
        report = self._finish(worker, timeout, "start a process in the episode")
        return int(report["pid"])

    def harden(self, target: int, *, timeout: float = 30) -> None:
        """Make the episode's /proc settings and the host's device nodes in its /dev read-only."""
        worker = self.request({"op": "harden", "target": target}, [])
        self._finish(worker, timeout, "harden the episode's /proc and /dev")

    def write_file(self, target: int, path: str, data: bytes, *, mode: int = 0o644, timeout: float = 60) -> None:
        self._with_input(target, {"action": "write", "path": path, "mode": mode, "mkdirs": True}, data, timeout)

    def extract(self, target: int, path: str, tar: bytes, *, timeout: float = 120) -> None:
        self._with_input(target, {"action": "extract", "path": path}, tar, timeout)

    def read_file(self, target: int, path: str, *, limit: int, timeout: float = 60) -> bytes:
        worker = self.request({"op": "files", "target": target, "action": "read", "path": path, "limit": limit}, [])
        return base64.b64decode(self._finish(worker, timeout, f"read {path}")["data"])

    def extract_artifacts(self, target: int, tar: bytes, *, timeout: float = 300) -> None:
        """Unpack artifacts at ``/`` of the view: links are kept, nothing is written through one."""
        self._with_input(target, {"action": "extract", "path": "/", "policy": "artifacts"}, tar, timeout)

    def pack(
        self, target: int, paths: Sequence[str], exclude: dict[str, list[str]], *, limit: int, timeout: float = 300
    ) -> tuple[bytes, list[str]]:
        """A tar of ``paths`` in the view (at most ``limit`` bytes) and the paths missing."""
        data_r, data_w = os.pipe()
        os.set_inheritable(data_r, False)
        try:
            worker = self.request(
                {
                    "op": "files",
                    "target": target,
                    "action": "pack",
                    "path": "/",
                    "paths": list(paths),
                    "exclude": exclude,
                },
                [data_w],
            )
        finally:
            os.close(data_w)
        data = bytearray()
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not readable(data_r, left):
                    worker.kill()
                    raise SandboxError(f"could not pack the artifacts: no end within {timeout:g} s")
                chunk = os.read(data_r, 1 << 16)
                if not chunk:
                    break
                data += chunk
                if len(data) > limit:
                    worker.kill()
                    raise SandboxError(f"the artifacts are larger than {limit} bytes")
        finally:
            os.close(data_r)
        report = self._finish(worker, timeout, "pack the artifacts")
        return bytes(data), list(report.get("missing", []))

    # -- an episode's network (see sequester.sandbox.nsexec.router) ------------------

    def net_router(self, plan: dict[str, Any], *, target: int | None = None, timeout: float = 30) -> Router:
        """Make an episode's router namespace (``plan``: the request's fields, see
        :func:`~sequester.sandbox.nsexec.router.op_net_router`; ``target``: the episode's
        init, which an ordinary user's router needs, a root caller's not)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        life_r, life_w = os.pipe()
        os.set_inheritable(life_w, False)
        try:
            with ours:
                try:
                    worker = self.request({"op": "net_router", "target": target, **plan}, [theirs.fileno(), life_r])
                finally:
                    theirs.close()
                    os.close(life_r)
                report = self._finish(worker, timeout, "make the episode's router")
                fds = _receive_fds(ours, timeout)
        except BaseException:
            os.close(life_w)
            raise
        if len(fds) != 4:
            for fd in (*fds, life_w):
                os.close(fd)
            raise SandboxError(f"the episode's router came back with {len(fds)} descriptors, not 4")
        return Router(fds[0], fds[1], int(report["holder"]), life_w, [socket.socket(fileno=fd) for fd in fds[2:]], [])

    def net_link(self, target: int, router: Router, plan: dict[str, Any], *, timeout: float = 30) -> None:
        """Link ``router`` to the episode of ``target`` (``plan``: see
        :func:`~sequester.sandbox.nsexec.router.op_net_link`); the relays' listening
        sockets go to ``router.relays``."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with ours:
            try:
                worker = self.request(
                    {"op": "net_link", "target": target, **plan}, [theirs.fileno(), router.userns, router.netns]
                )
            finally:
                theirs.close()
            self._finish(worker, timeout, "link the episode to its router")
            fds = _receive_fds(ours, timeout)
        router.relays += [socket.socket(fileno=fd) for fd in fds]
        if len(fds) != len(plan.get("relays", [])):
            raise SandboxError(f"the episode's relays came back with {len(fds)} sockets")

    def net_nft(
        self,
        router: Router,
        commands: Sequence[str],
        *,
        json: bool = False,
        tolerate: bool | Sequence[bool] = False,
        timeout: float = 10,
    ) -> list[str]:
        """nftables ``commands`` in the router; their outputs (JSON with ``json``); a
        command that fails raises, unless ``tolerate`` (all, or one flag per command)."""
        worker = self.request(
            {
                "op": "net_nft",
                "commands": list(commands),
                "json": json,
                "tolerate": tolerate if isinstance(tolerate, bool) else list(tolerate),
            },
            [router.userns, router.netns],
        )
        return list(self._finish(worker, timeout, "change the episode's network rules")["outputs"])

    def net_stack(
        self,
        argv: Sequence[str],
        *,
        uid: int | None,
        private_tun: bool,
        stderr: int,
        fds: Sequence[int],
        timeout: float = 10,
    ) -> int:
        """Start the user-mode stack (``argv``, its descriptors 3, 4, ... ``fds``) as ``uid``;
        its pid. It dies with the helper (so with this process)."""
        worker = self.request(
            {"op": "net_stack", "argv": list(argv), "uid": uid, "private_tun": private_tun}, [stderr, *fds]
        )
        return int(self._finish(worker, timeout, f"start {argv[0]}")["pid"])

    def _with_input(self, target: int, message: dict[str, Any], data: bytes, timeout: float) -> None:
        data_r, data_w = os.pipe()
        try:
            worker = self.request({"op": "files", "target": target, **message}, [data_r])
        finally:
            os.close(data_r)
        writer = threading.Thread(target=write_and_close, args=(data_w, data), daemon=True)
        writer.start()
        try:
            self._finish(worker, timeout, f"{message['action']} {message['path']}")
        finally:
            writer.join()

    @staticmethod
    def _finish(worker: Worker, timeout: float, what: str) -> dict[str, Any]:
        report = worker.report(time.monotonic() + timeout)
        if report is None:
            worker.kill()
            raise SandboxError(f"could not {what}: no answer within {timeout:g} s")
        if "error" in report:
            raise SandboxError(f"could not {what}: {report['error']}")
        return report


def _process_message(
    op: str,
    target: int,
    argv: Sequence[str],
    env: dict[str, str],
    cwd: str,
    ctty: bool,
    caps: Sequence[str],
    seccomp_bpf: bytes,
    seccomp_nr: int,
    cgroup: str | Sequence[str] | None,
    rlimits: Mapping[str, int | list[int]] | None,
    ids: tuple[int, int] | None,
) -> dict[str, Any]:
    """The request of a process started in an episode (``spawn``, ``run``): what the
    helper's worker needs to become it, with the agent's restrictions."""
    return {
        "op": op,
        "target": target,
        "argv": list(argv),
        "env": env,
        "cwd": cwd,
        "ctty": ctty,
        "caps": list(caps),
        "seccomp": base64.b64encode(seccomp_bpf).decode(),
        "seccomp_nr": seccomp_nr,
        "cgroup": [cgroup] if isinstance(cgroup, str) else list(cgroup or ()),
        "rlimits": dict(rlimits or {}),
        "ids": list(ids) if ids is not None else None,
    }


def _receive_fds(sock: socket.socket, timeout: float) -> list[int]:
    """The descriptors a worker sent on ``sock`` (close-on-exec), once."""
    sock.settimeout(timeout)
    try:
        _, fds, _, _ = socket.recv_fds(sock, 16, 64, socket.MSG_CMSG_CLOEXEC)
    except OSError as exc:
        raise SandboxError(f"the namespace helper's worker sent nothing back: {exc}") from None
    return list(fds)


def write_and_close(fd: int, data: bytes) -> None:
    """Write all of ``data`` to a pipe (the reader may go away), then close it."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except OSError:
        pass
    finally:
        os.close(fd)


_shared: NsExec | None = None
_shared_lock = threading.Lock()


def shared_nsexec() -> NsExec:
    """The process's helper, started on first use (it is single-threaded, so it must be
    its own process; one is enough for any number of episodes).

    It dies with the *thread* that starts it (``PR_SET_PDEATHSIG`` follows the parent
    thread), so it is started from a keeper thread that lives as long as the process: a
    short-lived caller (a server session's worker, a trial's thread) must not take every
    other episode's helper with it when it ends."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared._proc.poll() is not None:
            _shared = _start_on_keeper()
        return _shared


_forever = threading.Event()  # never set: keeper threads wait on it for the process's life


def _start_on_keeper() -> NsExec:
    started: dict[str, object] = {}
    ready = threading.Event()

    def keep() -> None:
        try:
            started["helper"] = NsExec()
        except BaseException as exc:  # handed to the caller below
            started["error"] = exc
        ready.set()
        _forever.wait()

    threading.Thread(target=keep, name="sequester-nsexec-keeper", daemon=True).start()
    ready.wait()
    if "error" in started:
        raise started["error"]  # type: ignore[misc]
    return started["helper"]  # type: ignore[return-value]
