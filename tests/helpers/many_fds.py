"""A test process holding more than 1024 descriptors, so that the next ones it opens are
numbered above ``select``'s bound (FD_SETSIZE): what a server or trainer with a hundred
episodes open looks like to the code under test."""

from __future__ import annotations

import os
import resource
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

FD_SETSIZE = 1024


@contextmanager
def descriptors_above(setsize: int = FD_SETSIZE, spare: int = 4096) -> Iterator[Callable[[], int]]:
    """Hold ``/dev/null`` open until the lowest free descriptor is above ``setsize`` (plus a
    few: select's error needs only one descriptor that high); yields ``fill``, which fills
    again any hole below that a descriptor the test did not open left when it was closed
    (a previous test's client socket collected during the test) and returns how many are
    held. The soft open-file limit is raised for it when the hard one allows (else the test is
    skipped, with the reason), and put back afterwards, as are the descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = setsize + 80 + spare  # the dummies, and room for what the test opens above them
    if soft != resource.RLIM_INFINITY and soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"the open-file limit's hard limit ({hard}) is below the {want} descriptors this test holds")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    held: list[int] = []

    def fill() -> int:
        while True:
            fd = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
            if fd > setsize + 64:
                os.close(fd)
                return len(held)
            held.append(fd)

    try:
        fill()
        yield fill
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
