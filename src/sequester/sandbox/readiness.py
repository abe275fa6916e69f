"""Waiting until descriptors are readable: ``poll``, never ``select``.

``select(2)`` takes only descriptors below ``FD_SETSIZE`` (1024): a host process that holds
more (a server or a trainer with a hundred episodes open, each holding a dozen
descriptors) fails with ``ValueError: filedescriptor out of range in select()``. The host
side's waits on a few descriptors go through here; the loops that serve many sockets use
``selectors.DefaultSelector`` (epoll), which has no such bound either; none uses ``select``.

Readable means what ``select`` means by it: data to read, the end of a pipe or socket (a
hang-up), an error pending, or, for a pidfd, its process has exited. A descriptor that is
not open is ``EBADF``, as ``select`` reports it. A signal does not cut a wait short: it
resumes with the time that is left (PEP 475).
"""

from __future__ import annotations

import errno
import math
import os
import select
from collections.abc import Sequence
from typing import Protocol, TypeVar

__all__ = ["HasFileno", "readable", "readable_among"]


class HasFileno(Protocol):
    def fileno(self) -> int: ...


F = TypeVar("F", bound="int | HasFileno")


def readable_among(fds: Sequence[F], timeout: float | None) -> list[F]:
    """Those of ``fds`` (descriptors, or objects with ``fileno()`` such as sockets) that are
    readable within ``timeout`` seconds (None: wait as long as it takes; 0 or less: look
    and return), in the order given: ``select.select(fds, [], [], timeout)[0]``, for any
    descriptor number."""
    numbers = [fd if isinstance(fd, int) else fd.fileno() for fd in fds]
    poller = select.poll()
    for number in dict.fromkeys(numbers):
        poller.register(number, select.POLLIN)
    # Milliseconds, rounded up: a wait never ends before its time (selectors does the same).
    wait = None if timeout is None else math.ceil(max(timeout, 0.0) * 1000)
    ready: set[int] = set()
    for number, events in poller.poll(wait):
        if events & select.POLLNVAL:
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        ready.add(number)  # POLLIN, POLLHUP or POLLERR: a read will not block
    return [fd for fd, number in zip(fds, numbers, strict=True) if number in ready]


def readable(fd: int | HasFileno, timeout: float | None) -> bool:
    """``fd`` is readable (or at its end, or a pidfd's process exited) within ``timeout``
    seconds (None: wait; 0: look and return)."""
    return bool(readable_among([fd], timeout))
