"""View templates: a kernel's view assembled once per policy, then entered by each kernel.

bwrap spends most of a kernel's start outside the interpreter (its namespaces, about 45
mount operations, a root caller's uid map: 7 ms here), and all of it depends only on the
policy and this host. So the first kernel of a view starts bwrap with the native stage as
the view's *keeper* (``stage0 --template``, ``kernel/stage0_template.c``); every kernel of
that view is then a child of the keeper in fresh mount (a copy of the view), PID,
network, IPC and UTS namespaces, which runs the plan a bwrap-started kernel would
(:func:`~sequester.guard.native_plan.plan_stage0` with ``template=True``): its own
``/proc`` and ``/dev/pts``, the workspace, a user namespace of its own, the limits, the
privilege drop, the write lock, the filter, the handoff.

Between kernels of one template (each guard's attack is at the guard):

* nothing writable is shared: the keeper makes every mount of the view read-only before
  it serves, and checks it;
* nothing is visible: each kernel is alone in a PID namespace below the keeper's, with a
  ``/proc`` of its own, and owns its network, IPC and UTS namespaces;
* no limit is shared: each kernel's user namespace counts its own processes;
* no descriptor is shared: a kernel gets only what the host sent for it.

A template lives as long as its host process, or until it is retired (too many views
in use) and its last kernel is gone. Its keeper holds no host file but its control socket
and dies with the host (bwrap's ``--die-with-parent``), taking every kernel with it.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from sequester.errors import SandboxError
from sequester.kernel.spawn import STAGE0_IN_VIEW, KernelView
from sequester.kernel.template_kernel import StaleView, TemplateKernel, TemplateSandbox, TemplateUnavailable
from sequester.sandbox.bwrap import StartedBwrap, close_fd, start_bwrap

__all__ = [
    "ViewTemplate",
    "TemplateKernel",
    "TemplateSandbox",
    "StaleView",
    "TemplateUnavailable",
    "template_for",
    "forget",
    "close_templates",
    "templates_enabled",
    "MAX_TEMPLATES",
]

_MAGIC = 0x31545153  # "SQT1", stage0_template.c's MAGIC
_CLOSE_ON_EXEC = 0x8000_0000  # its REPORT_CLOSE_ON_EXEC
_REPLY = struct.Struct("<IiiI")
_READY_TIMEOUT = 30.0
# Views kept ready at once; a further one retires the least recently used (which ends
# when its last kernel does).
MAX_TEMPLATES = 8


def templates_enabled() -> bool:
    """``SEQUESTER_VIEW_TEMPLATE=0`` starts every kernel with bwrap of its own."""
    return os.environ.get("SEQUESTER_VIEW_TEMPLATE", "1") != "0"


class ViewTemplate:
    """A keeper serving kernels of one view. Thread-safe; a spawn after close raises
    :class:`StaleView` (the caller starts from a new view)."""

    def __init__(self, started: StartedBwrap, control: socket.socket):
        self._started = started
        self._control = control
        self._lock = threading.Lock()
        self._kernels = 0
        self._retired = False
        self._closed = False

    @classmethod
    def start(cls, view: KernelView, stage0_in_view: str = str(STAGE0_IN_VIEW)) -> ViewTemplate:
        """bwrap on ``view`` (whose command is replaced by the keeper's), ready to serve."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        err = os.memfd_create("sequester-template-stderr", os.MFD_CLOEXEC)
        try:
            spec = dataclasses.replace(view.spec, command=(stage0_in_view, "--template", str(theirs.fileno())))
            null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
            try:
                started = start_bwrap(
                    spec,
                    data_files=view.data_files,
                    keep_fds=[theirs.fileno()],
                    stdout=null,
                    stderr=err,
                    stderr_reader=None,
                )
            finally:
                close_fd(null)
        except BaseException as exc:
            ours.close()
            said = _said(err)
            close_fd(err)
            if isinstance(exc, SandboxError):
                raise TemplateUnavailable(f"{exc} {said}".strip()) from None
            raise
        finally:
            theirs.close()
        template = cls(started, ours)
        try:
            template._wait_ready(err)
        except BaseException:
            template.close()
            raise
        finally:
            close_fd(err)
        return template

    def _wait_ready(self, err: int) -> None:
        self._control.settimeout(_READY_TIMEOUT)
        header = body = b""
        try:
            header = _recv_exactly(self._control, 4)
            size = int.from_bytes(header, "big") if len(header) == 4 else 0
            body = _recv_exactly(self._control, size) if size <= 4096 else b""  # the stage's frames are small
        except OSError:
            body = b""
        finally:
            self._control.settimeout(None)
        if b'"op":"ready"' not in body:
            import json

            try:
                reason = json.loads(body.decode("utf-8", "replace")).get("error") if body else None
            except (ValueError, AttributeError):
                reason = None
            raise TemplateUnavailable(
                f"the view template did not start: {reason or 'no reason given'} {_said(err)}".strip()
            )

    def host_pids(self) -> list[int]:
        """bwrap's monitor and the keeper (not the kernels)."""
        return [self._started.popen.pid, self._started.pid]

    @property
    def alive(self) -> bool:
        return not self._closed and self._started.popen.poll() is None

    def spawn(
        self, plan_body: bytes, fds: list[tuple[int, int]], out_target: int, *, close_report_on_exec: bool = False
    ) -> TemplateKernel:
        """Start a kernel running ``plan_body`` (an encoded plan without its length) with
        each ``(fd, target)`` of ``fds`` at ``target`` and nothing else; failures are reported
        by the plan on ``out_target``, as a kernel's first stage reports them
        (``close_report_on_exec``: a command's, which must not keep it)."""
        status_r, status_w = os.pipe2(os.O_CLOEXEC)
        try:
            with self._lock:
                if self._closed:
                    # Red team: retired (and so closed) by another view's first kernel
                    # between this kernel's lookup and its spawn: the caller starts again.
                    raise StaleView("the view template was closed")
                head = struct.pack(
                    "<4I",
                    _MAGIC,
                    len(fds) + 1,
                    out_target | (_CLOSE_ON_EXEC if close_report_on_exec else 0),
                    len(plan_body),
                )
                targets = struct.pack(f"<{len(fds) + 1}I", 0, *(t for _, t in fds))
                try:
                    socket.send_fds(self._control, [head], [status_w, *(fd for fd, _ in fds)])
                    self._control.sendall(targets + plan_body)
                    reply, pidfds = _recv_reply(self._control)
                except OSError as exc:
                    self._broken()
                    raise SandboxError(f"the view template's keeper is gone: {exc}") from None
                except BaseException:
                    # Attack (red team): interrupted between request and reply (a signal
                    # handler's exception, KeyboardInterrupt), the stream kept the reply
                    # unread, and the next spawn took it: another user's kernel's pidfd.
                    self._broken()
                    raise
                magic, error, _, _ = reply[0]
                if magic != _MAGIC:
                    self._broken()
                    raise SandboxError("the view template's keeper broke its protocol")
                if error == errno.ESTALE:
                    self._retired = True  # no new kernels; the caller starts from a new view
                    raise StaleView(reply[1])
                if error:
                    raise SandboxError(f"the view template could not start a kernel: {reply[1]}: {os.strerror(error)}")
                if len(pidfds) != 1:
                    self._broken()
                    raise SandboxError("the view template's keeper sent no pidfd")
                self._kernels += 1
        except BaseException:
            close_fd(status_r)
            raise
        finally:
            close_fd(status_w)
        return TemplateKernel(_host_pid(pidfds[0]), pidfds[0], status_r, self)

    def release(self) -> None:
        """One kernel of this view has ended."""
        with self._lock:
            self._kernels -= 1
            done = self._retired and self._kernels <= 0
        if done:
            self.close()

    def retire(self) -> None:
        """No new kernels; close once the running ones end."""
        with self._lock:
            self._retired = True
            done = self._kernels <= 0
        if done:
            self.close()

    def close(self) -> None:
        """End the keeper and, with it, every kernel of this view. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._control.close()  # the keeper exits at end of file
        self._started.kill()

    def _broken(self) -> None:
        self._closed = True
        self._control.close()
        threading.Thread(target=self._started.kill, daemon=True).start()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _recv_reply(sock: socket.socket) -> tuple[tuple[tuple[int, int, int, int], str], list[int]]:
    data, fds, _, _ = socket.recv_fds(sock, _REPLY.size, 1, socket.MSG_CMSG_CLOEXEC)
    if not data:
        raise ConnectionResetError(errno.ECONNRESET, "end of file")
    data += _recv_exactly(sock, _REPLY.size - len(data))
    fields = _REPLY.unpack(data)
    text = _recv_exactly(sock, min(fields[3], 4096)).decode("utf-8", "replace") if fields[3] else ""
    return (fields, text), list(fds)


def _host_pid(pidfd: int) -> int:
    with open(f"/proc/self/fdinfo/{pidfd}") as f:
        for line in f:
            if line.startswith("Pid:"):
                return int(line.split()[1])
    raise SandboxError("the kernel's pidfd names no process")


def _said(fd: int) -> str:
    try:
        return os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""


# -- the templates of this process ------------------------------------------------------

_lock = threading.Lock()
_templates: collections.OrderedDict[str, ViewTemplate] = collections.OrderedDict()
_starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sequester-view-templates")


# A view whose template could not be made here is not tried again for a while: every
# kernel of it would pay a failed start before its bwrap of its own.
_UNAVAILABLE_FOR = 60.0
_unavailable: dict[str, tuple[float, str]] = {}


def template_for(key: str, start: Callable[[], ViewTemplate]) -> ViewTemplate:
    """The live template of ``key`` (the view's full description), started if needed;
    :class:`TemplateUnavailable` when it cannot be made here (remembered for a minute)."""
    with _lock:
        failed = _unavailable.get(key)
        if failed is not None and time.monotonic() - failed[0] < _UNAVAILABLE_FOR:
            raise TemplateUnavailable(failed[1])
        found = _templates.get(key)
        if found is not None and found.alive:
            _templates.move_to_end(key)
            return found
    # Started on the one long-lived thread: bwrap's --die-with-parent is a parent-death
    # signal, which the kernel sends when the *thread* that forked bwrap ends. Started on
    # a pool's or a server's worker thread, the view (and every kernel in it) would die
    # with that thread. One at a time, so concurrent first kernels start one view.
    return _starter.submit(_start_once, key, start).result()


def _start_once(key: str, start: Callable[[], ViewTemplate]) -> ViewTemplate:
    with _lock:
        # Checked again here: first kernels that arrive together queue on this thread, and
        # only the first of them pays the failed start (red team).
        failed = _unavailable.get(key)
        if failed is not None and time.monotonic() - failed[0] < _UNAVAILABLE_FOR:
            raise TemplateUnavailable(failed[1])
        found = _templates.pop(key, None)
        if found is not None and found.alive:
            _templates[key] = found
            return found
    if found is not None:
        found.retire()
    try:
        made = start()
    except TemplateUnavailable as exc:
        with _lock:
            _unavailable[key] = (time.monotonic(), str(exc))
            while len(_unavailable) > 4 * MAX_TEMPLATES:
                _unavailable.pop(next(iter(_unavailable)))
        raise
    with _lock:
        _templates[key] = made
        retired = [_templates.popitem(last=False)[1] for _ in range(len(_templates) - MAX_TEMPLATES)]
    for old in retired:
        old.retire()
    return made


def forget(template: ViewTemplate) -> None:
    """Take ``template`` out of the cache and retire it (a stale view)."""
    with _lock:
        for key, found in list(_templates.items()):
            if found is template:
                del _templates[key]
    template.retire()


def close_templates() -> None:
    """End every template of this process and their kernels (tests, shutdown), and forget
    which views could not be made."""
    with _lock:
        _unavailable.clear()
        found = list(_templates.values())
        _templates.clear()
    for template in found:
        template.close()


def _forget_in_child() -> None:
    # A forked child must never talk to its parent's keepers: the stream would interleave.
    # Its copies of their sockets are closed; the parent's keepers live on.
    global _lock, _starter
    _lock = threading.Lock()
    _starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sequester-view-templates")
    for template in _templates.values():
        template._closed = True
        try:
            template._control.close()
        except OSError:
            pass
    _templates.clear()


os.register_at_fork(after_in_child=_forget_in_child)
