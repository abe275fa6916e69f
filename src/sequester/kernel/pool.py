"""A warm pool of kernels: ``size`` started and ready, handed out in microseconds.

    with KernelPool(policy, size=4) as pool:
        with pool.acquire() as kernel:      # ready: its first cell runs at once
            kernel.run("x = 1")
        # closed on leaving: a kernel is used once, never handed to another user

A kernel's cold start (a sandbox, Python twice, the guard, the handshake) costs tens of
milliseconds; a pool pays it in the background. **A kernel is used once**: ``release``
(or leaving its ``with``) closes it and the pool starts a fresh one, so nothing a user
left in a kernel (variables, files in its workspace, a thread) reaches the next user.
A kernel's lifetime (``limits.kernel_timeout``) counts from when it is handed out, not
from when the pool started it.

``init=CODE``: the pool keeps one *warm kernel* that ran ``CODE`` once (imports, loaded
data) and hands out its forks (:meth:`Kernel.fork`): each a copy-on-write copy of it with
what init left, namespaces, workspace and network of its own, in milliseconds whatever
init imported. The warm kernel lives as long as the pool and its forks (a fork ends
with it); one that dies is started again, and init runs again.

The pool starts its kernels on one thread of its own that lives until the pool is closed
*and* every kernel it started is closed: a kernel's sandbox dies with the thread that
started it (``bwrap --die-with-parent`` follows the parent thread), so a kernel handed out
must not depend on a thread that ends before it does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from sequester.errors import KernelClosedError, KernelError, PolicyError, SequesterError
from sequester.kernel.client import Kernel
from sequester.policy import Policy

__all__ = ["KernelPool"]

log = logging.getLogger("sequester.kernel")

_RETRY_PAUSE = 1.0  # after a kernel failed to start, before the next try (a broken host must not spin)


class KernelPool:
    """``size`` kernels under ``policy`` kept started; see the module doc."""

    def __init__(self, policy: Policy | None = None, size: int = 4, *, init: str | None = None):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise PolicyError(f"KernelPool size {size!r} is not a positive integer")
        if init is not None and not isinstance(init, str):
            raise PolicyError(f"KernelPool init must be Python code (a str), not {type(init).__name__}")
        self.policy = policy if policy is not None else Policy()
        self.size = size
        self.init = init
        self._warm: Kernel | None = None  # the filler's: started and closed on its thread
        self._ready: deque[Kernel] = deque()
        self._handed_out: list[Kernel] = []
        self._cond = threading.Condition()
        self._closed = False
        self._failure: BaseException | None = None
        self._filler = threading.Thread(target=self._fill, name="kernel-pool", daemon=True)
        self._filler.start()

    # -- the user's side ---------------------------------------------------------------
    def acquire(self, timeout: float | None = 30.0, *, policy: Policy | None = None) -> Kernel:
        """A ready kernel, all the caller's; waits up to ``timeout`` seconds when none is
        ready. :class:`KernelClosedError` after :meth:`close`; :class:`PolicyError` for a
        ``policy`` other than the pool's (its kernels were started under the pool's)."""
        if policy is not None and policy != self.policy:
            raise PolicyError(
                "this pool's kernels run under the policy the pool was made with; make a KernelPool "
                "for the other policy"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closed:
                    raise KernelClosedError("the kernel pool is closed")
                while self._ready:
                    kernel = self._ready.popleft()
                    if kernel.alive():
                        kernel.begin_lifetime()
                        self._handed_out.append(kernel)
                        self._cond.notify_all()  # the filler starts the next one
                        return kernel
                    kernel.close()  # died while waiting (an OOM kill): never handed out
                if self._failure is not None and not self._filler.is_alive():
                    raise KernelError(f"the kernel pool cannot start kernels: {self._failure}")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    reason = f" (the last start failed: {self._failure})" if self._failure else ""
                    raise KernelError(f"no kernel of the pool was ready within {timeout:g} s{reason}")
                self._cond.wait(left)

    def release(self, kernel: Kernel) -> None:
        """Close ``kernel`` (a kernel is used once); the pool starts a fresh one."""
        kernel.close()
        with self._cond:
            self._cond.notify_all()

    @property
    def ready(self) -> int:
        with self._cond:
            return len(self._ready)

    def idle_memory(self) -> int:
        """Bytes resident in the ready kernels' processes (the pool's idle cost)."""
        with self._cond:
            kernels = list(self._ready)
        return sum(k.resident_bytes() for k in kernels)

    def close(self) -> None:
        """Close the ready kernels and stop refilling. Kernels handed out stay the
        caller's until they close them. Idempotent."""
        with self._cond:
            self._closed = True
            ready, self._ready = list(self._ready), deque()
            self._cond.notify_all()
        for kernel in ready:
            kernel.close()

    def __enter__(self) -> KernelPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the filler thread -------------------------------------------------------------
    def _fill(self) -> None:
        while True:
            with self._cond:
                self._handed_out = [k for k in self._handed_out if not k.closed]
                if self._closed:
                    if not self._handed_out:
                        if self._warm is not None:
                            self._warm.close()  # its forks are all closed
                        return  # nothing of ours runs on this thread's sandboxes any more
                    self._cond.wait(0.5)
                    continue
                if len(self._ready) >= self.size:
                    self._cond.wait(5.0)
                    continue
            try:
                kernel = self._start_one()
            except SequesterError as exc:  # a start failure: said to the next acquire, tried again
                log.warning("kernel pool: a kernel failed to start: %s", exc)
                with self._cond:
                    self._failure = exc
                    self._cond.notify_all()
                time.sleep(_RETRY_PAUSE)
                continue
            with self._cond:
                self._failure = None
                if self._closed:
                    kernel.close()
                    continue
                self._ready.append(kernel)
                self._cond.notify_all()

    def _start_one(self) -> Kernel:
        """A fresh kernel, or (``init``) a fork of the warm kernel, started on this thread
        if it is not running (its init raised: a :class:`KernelError` said to ``acquire``)."""
        if self.init is None:
            return Kernel(self.policy).start()
        if self._warm is None or not self._warm.alive():
            if self._warm is not None:
                self._warm.close()
            self._warm = None
            self._warm = Kernel(self.policy, init=self.init).start()
        return self._warm.fork()
