"""Forks of a warm kernel, as the host holds them (the kernel side is ``stage0_fork.c``).

A warm kernel (``Kernel(policy, init=CODE)``) is a view template's kernel that ran its
init cell once and then only forks: each fork is a copy-on-write copy of it, born in
namespaces of its own (user, mount, PID, network, IPC, UTS) and confined by
:func:`~sequester.guard.native_plan.plan_fork` before any of its Python runs. The host
asks over the warm kernel's fork channel (a socket pair made at its start: the fork's
pipes, its network's control descriptor, the plan), then on the warm kernel's pipe
(``{"op": "fork"}``); the fork's pidfd comes back on the channel, and the fork answers
``ready`` on its own pipe like any kernel.

A fork is a child of the warm kernel's PID namespace's init (the warm kernel), which reaps
it: the host watches it by pidfd and has no exit status (a fork that ended reads as
killed). A fork ends with its warm kernel.
"""

from __future__ import annotations

import os
import secrets
import socket
import struct
import subprocess
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sequester.errors import SandboxError
from sequester.guard.native_plan import NativePlanError, encode_plan, plan_fork
from sequester.kernel.spawn import KernelNetwork, kernel_network
from sequester.kernel.template_kernel import PidfdKernel
from sequester.sandbox.bwrap import close_fd
from sequester.sandbox.procs import descendants
from sequester.sandbox.readiness import readable

if TYPE_CHECKING:  # pragma: no cover
    from sequester.kernel.launch import KernelProcess
    from sequester.policy import Policy

__all__ = ["ForkedKernel", "ForkSandbox", "ForkChannelBroken", "fork_kernel", "verify_fork", "FORK_MAGIC"]

FORK_MAGIC = 0x31465153  # "SQF1", stage0_fork.c's
_FRESH = 0xFFFF_FFFF
_REPLY = struct.Struct("<5I")  # magic, error, pid, text length, the request's nonce
_REPLY_TIMEOUT = 30.0
_NAMESPACES = ("user", "mnt", "pid", "net", "ipc", "uts")


class ForkChannelBroken(SandboxError):
    """The warm kernel's fork channel can no longer be trusted to pair a request with its
    answer (no answer in time, a wrong nonce, a broken stream): the warm kernel must go."""


@dataclass
class ForkedKernel(PidfdKernel):
    """A fork: watched by its pidfd; its warm kernel reaps it, so an ended fork reads as
    killed (:class:`PidfdKernel`'s default)."""


@dataclass
class ForkSandbox:
    """A fork's sandbox: what ``KernelProcess.sandbox`` is for a template's kernel."""

    kernel: ForkedKernel
    network: KernelNetwork
    below_tmp: tuple[Any, ...] = ()

    @property
    def broker(self):
        return self.network.broker

    @property
    def bridge(self) -> dict[str, Any] | None:
        return self.network.bridge

    def kill(self) -> None:
        self.kernel.kill()
        try:
            self.kernel.wait(timeout=5.0)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL of a process
            pass
        self.network.close()

    def signal_kernel(self) -> None:
        self.kernel.kill()

    def host_pids(self) -> list[int]:
        return [self.kernel.pid, *descendants(self.kernel.pid)]


def _host_pid(pidfd: int) -> int:
    with open(f"/proc/self/fdinfo/{pidfd}") as f:
        for line in f:
            if line.startswith("Pid:"):
                return int(line.split()[1])
    raise SandboxError("the fork's pidfd names no process")


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("PPid:"):
                return int(line.split()[1])
    return 0


def _descends_from(pid: int, ancestor: int) -> bool:
    """``pid``'s parent or grandparent is ``ancestor`` (a fork's parent is the warm
    kernel's intermediate until that exits, then the warm kernel: read again when the
    intermediate went between the two reads)."""
    for _ in range(3):
        try:
            parent = _parent(pid)
            if parent == ancestor or (parent > 1 and _parent(parent) == ancestor):
                return True
        except OSError:
            pass
        time.sleep(0.01)
    return False


def _read_exactly(sock: socket.socket, size: int, deadline: float) -> bytes:
    data = b""
    while len(data) < size:
        if not readable(sock, max(0.0, deadline - time.monotonic())):
            raise TimeoutError("the warm kernel did not answer the fork request")
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the warm kernel closed its fork channel")
        data += chunk
    return data


def fork_kernel(warm: KernelProcess, policy: Policy, channel: socket.socket, timing: dict[str, int]) -> KernelProcess:
    """A fork of ``warm`` (a warm kernel whose init ran): its pipes and network made here,
    sent with its plan on ``channel``; returned as a started :class:`KernelProcess` that
    still has to answer ``ready``. The caller serialises forks of one warm kernel and then
    reads the warm kernel's own answer (``forked``) from its pipe."""
    from sequester.kernel.launch import KernelProcess

    try:
        plan = encode_plan(plan_fork(warm.config))[4:]
    except NativePlanError as exc:
        raise SandboxError(f"cannot plan a fork: {exc}") from None
    in_fd, out_fd = warm.config["warm"]["in_fd"], warm.config["warm"]["out_fd"]
    pipes = [os.pipe() for _ in range(4)]  # to the fork, from it, its stdout, its stderr
    child_ends = [pipes[0][0], pipes[1][1], pipes[2][1], pipes[3][1]]
    host_ends = [pipes[0][1], pipes[1][0], pipes[2][0], pipes[3][0]]
    network = kernel_network(policy)
    pidfd = -1
    try:
        targets = [in_fd, out_fd, 1, 2]
        if network.control_fd is not None:
            child_ends.append(network.control_fd)
            targets.append(_FRESH)  # a number the warm kernel never had (its Python may name those)
        nonce = secrets.randbits(32)
        head = struct.pack("<4I", FORK_MAGIC, len(child_ends), len(plan), nonce)
        socket.send_fds(channel, [head], child_ends)
        channel.sendall(struct.pack(f"<{len(targets)}I", *targets) + plan)
        deadline = time.monotonic() + _REPLY_TIMEOUT
        if not readable(channel, _REPLY_TIMEOUT):
            raise ForkChannelBroken("the warm kernel did not answer the fork request in time")
        head_bytes, fds, _, _ = socket.recv_fds(channel, _REPLY.size, 1)
        pidfd = fds[0] if fds else -1
        for extra in fds[1:]:
            close_fd(extra)
        if not head_bytes:
            raise ForkChannelBroken("the warm kernel closed its fork channel")
        try:
            head_bytes += _read_exactly(channel, _REPLY.size - len(head_bytes), deadline)
            magic, error, _, text_len, answered = _REPLY.unpack(head_bytes)
            if magic != FORK_MAGIC or text_len > 4096:
                raise ForkChannelBroken("the warm kernel broke the fork protocol")
            text = _read_exactly(channel, text_len, deadline).decode("utf-8", "replace")
        except (TimeoutError, ConnectionError) as exc:
            raise ForkChannelBroken(f"the warm kernel's answer was cut short: {exc}") from None
        if answered != nonce:
            # A late answer to an earlier request (red team): never paired with this one.
            raise ForkChannelBroken("the warm kernel answered another fork request than this one")
        if error:
            raise SandboxError(f"the warm kernel could not fork: {text or os.strerror(error)}")
        if pidfd < 0:
            raise SandboxError("the warm kernel sent no pidfd for its fork")
        host_pid = _host_pid(pidfd)
        # -1: it already ended (its plan failed: the handshake reads why from its pipe).
        if host_pid != -1 and not _descends_from(host_pid, warm.popen.pid):
            raise SandboxError("the warm kernel named a process that is not its fork")
    except BaseException as exc:
        for fd in (*host_ends, pidfd):
            close_fd(fd)
        network.close()
        if isinstance(exc, OSError):
            raise ForkChannelBroken(f"could not fork the warm kernel: {exc}") from None
        raise
    finally:
        for fd in child_ends:  # the warm kernel has its copies (or never will)
            close_fd(fd)
    config = {k: v for k, v in warm.config.items() if k != "warm"}
    config["forked"] = True
    timing["launched"] = time.monotonic_ns()
    kernel = ForkedKernel(host_pid, pidfd)
    to_fork, from_fork, fork_out, fork_err = host_ends
    return KernelProcess(
        warm.mode,
        kernel,
        to_fork,
        from_fork,
        fork_out,
        fork_err,
        config,
        ForkSandbox(kernel, network),
        None,
        timing,
        b"",
    )


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return {k: v.strip() for k, _, v in (line.partition(":") for line in f)}


def verify_fork(process: KernelProcess, warm: KernelProcess) -> None:
    """The host's own look at a fork that said ``ready`` (its report is its word; this is
    the Linux kernel's): a process below the warm kernel's PID namespace and pid 1 of its
    own, in user, mount, PID, network, IPC and UTS namespaces none of which is the warm
    kernel's, with exactly one seccomp filter more than it (the kernel's), no new
    privileges, no capability, and holding the pipes the host made for it (all four). Red team: init
    code that answered a fork request with a child of its own (its namespaces, its
    filter) passed every check the report could give. :class:`SandboxError` otherwise."""
    assert isinstance(process.popen, ForkedKernel)
    pid, warm_pid = process.popen.pid, warm.popen.pid
    problems: list[str] = []
    try:
        mine, theirs = _status(pid), _status(warm_pid)
        depth, warm_depth = mine.get("NSpid", "").split(), theirs.get("NSpid", "").split()
        if len(depth) != len(warm_depth) + 1 or depth[-1] != "1":
            problems.append(f"its PID namespaces are {depth}, the warm kernel's {warm_depth}")
        if int(mine.get("Seccomp_filters", "0")) != int(theirs.get("Seccomp_filters", "0")) + 1:
            problems.append(
                f"it has {mine.get('Seccomp_filters')} seccomp filters, the warm kernel {theirs.get('Seccomp_filters')}"
            )
        if mine.get("Seccomp") != "2" or mine.get("NoNewPrivs") != "1":
            problems.append("no seccomp filter mode or no no_new_privs")
        caps = {k: mine.get(k, "") for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")}
        if any(int(v or "1", 16) for v in caps.values()):
            problems.append(f"capabilities {caps}")
        for name in _NAMESPACES:
            if os.stat(f"/proc/{pid}/ns/{name}").st_ino == os.stat(f"/proc/{warm_pid}/ns/{name}").st_ino:
                problems.append(f"the warm kernel's {name} namespace")
        in_fd, out_fd = warm.config["warm"]["in_fd"], warm.config["warm"]["out_fd"]
        ends = ((in_fd, process.to_kernel), (out_fd, process.from_kernel), (1, process.stdout), (2, process.stderr))
        for number, host_end in ends:
            if os.stat(f"/proc/{pid}/fd/{number}").st_ino != os.fstat(host_end).st_ino:
                problems.append(f"its descriptor {number} is not the host's pipe")
    except (OSError, ValueError) as exc:
        problems.append(f"it cannot be read: {exc}")
    if problems:
        raise SandboxError("the warm kernel's fork is not confined as a fork: " + "; ".join(problems))
