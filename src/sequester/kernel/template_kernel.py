"""A kernel started from a view template (:mod:`.template`), as the host holds it: its
handle (the part of :class:`subprocess.Popen` the kernel client uses; the exit status
comes from the keeper, its parent) and its sandbox (what ``KernelProcess.sandbox`` is
for a bwrap-started kernel)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sequester.errors import SandboxError
from sequester.kernel.spawn import KernelNetwork
from sequester.sandbox.bwrap import close_fd
from sequester.sandbox.procs import descendants
from sequester.sandbox.readiness import readable

if TYPE_CHECKING:  # pragma: no cover
    from sequester.kernel.template import ViewTemplate

__all__ = ["StaleView", "TemplateUnavailable", "PidfdKernel", "TemplateKernel", "TemplateSandbox"]


class StaleView(SandboxError):
    """The view changed on the host since the template checked it: start from a new one."""


class TemplateUnavailable(SandboxError):
    """A view template could not be made on this host (its keeper did not get ready): the
    kernel is started with a bwrap of its own instead, and says so."""


@dataclass
class PidfdKernel:
    """A kernel this process did not start (a keeper's child, a warm kernel's fork), with
    the part of :class:`subprocess.Popen` the kernel client uses: signalled by its pidfd,
    waited on by :meth:`_watch_fd`, its status from :meth:`_ended`. ``pid`` is the host's."""

    pid: int
    pidfd: int
    returncode: int | None = field(default=None, kw_only=True)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, kw_only=True)

    def poll(self) -> int | None:
        return self._collect(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._collect(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(["kernel"], timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        with self._lock:
            if self.returncode is None:
                try:
                    signal.pidfd_send_signal(self.pidfd, sig)
                except ProcessLookupError:
                    pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    terminate = kill  # a kernel is killed, never asked

    def _watch_fd(self) -> int:
        """What becomes readable when the kernel has ended."""
        return self.pidfd

    def _ended(self) -> int:
        """The ended kernel's status (its descriptors closed); called once, under the lock."""
        close_fd(self.pidfd)
        return -signal.SIGKILL

    def _after_end(self) -> None:
        """Once the status is set, outside the lock."""

    def _collect(self, timeout: float | None) -> int | None:
        # The wait is on a copy of the descriptor, outside the lock: a kill from another
        # thread never waits behind it (red team: kill() blocked behind a wait()).
        with self._lock:
            if self.returncode is not None:
                return self.returncode
            watch = os.dup(self._watch_fd())
        try:
            if not readable(watch, timeout):
                return None
        finally:
            close_fd(watch)
        with self._lock:
            if self.returncode is not None:  # another thread collected it meanwhile
                return self.returncode
            self.returncode = self._ended()
        self._after_end()
        return self.returncode


@dataclass
class TemplateKernel(PidfdKernel):
    """One kernel of a template; the exit status comes from the keeper, its parent, on
    ``status_fd``."""

    status_fd: int
    template: ViewTemplate

    def _watch_fd(self) -> int:
        return self.status_fd

    def _ended(self) -> int:
        raw = os.read(self.status_fd, 4)
        close_fd(self.status_fd)
        close_fd(self.pidfd)
        # No status: the keeper died, and its namespace's kernels with it.
        if len(raw) != 4:
            return -signal.SIGKILL
        return os.waitstatus_to_exitcode(int.from_bytes(raw, "little", signed=True))

    def _after_end(self) -> None:
        self.template.release()


@dataclass
class TemplateSandbox:
    """The sandbox of a kernel started from a template: what ``KernelProcess.sandbox`` is
    for a bwrap-started kernel."""

    kernel: TemplateKernel
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
        except subprocess.TimeoutExpired:  # the keeper is stuck: end the view, and so the kernel
            self.kernel.template.close()
            self.kernel.wait(timeout=5.0)
        self.network.close()

    def signal_kernel(self) -> None:
        self.kernel.kill()

    def host_pids(self) -> list[int]:
        return [self.kernel.pid, *descendants(self.kernel.pid)]
