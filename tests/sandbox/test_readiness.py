"""Waiting until descriptors are readable (:mod:`sequester.sandbox.readiness`): what
``select`` answered, for any descriptor number, against real pipes, sockets and processes."""

from __future__ import annotations

import errno
import os
import select
import signal
import socket
import subprocess
import sys
import time

import pytest
from many_fds import descriptors_above

from sequester.sandbox.readiness import readable, readable_among


@pytest.fixture
def pipe():
    r, w = os.pipe()
    yield r, w
    for fd in (r, w):
        try:
            os.close(fd)
        except OSError:
            pass


def test_an_empty_pipe_is_not_readable_and_the_wait_lasts_its_timeout(pipe):
    r, _ = pipe
    assert readable(r, 0) is False
    started = time.monotonic()
    assert readable_among([r], 0.2) == []
    assert 0.2 <= time.monotonic() - started < 2


def test_data_and_the_writers_end_are_readable(pipe):
    r, w = pipe
    os.write(w, b"x")
    assert readable(r, 0) and readable(r, None)
    assert os.read(r, 10) == b"x"
    assert not readable(r, 0)
    os.close(w)  # the end (a hang-up, not data): a read returns b"" at once, as select says
    assert readable(r, 0) and readable(r, None)
    assert os.read(r, 10) == b""


def test_the_ready_ones_in_the_order_given_repeats_kept(pipe):
    r, w = pipe
    r2, w2 = os.pipe()
    try:
        os.write(w2, b"y")
        assert readable_among([r, r2, r], 0) == [r2]
        os.write(w, b"x")
        assert readable_among([r2, r, r2], 0) == [r2, r, r2]
        assert readable_among([r, r2], 0) == select.select([r, r2], [], [], 0)[0]  # the control
        assert readable_among([], 0) == []
    finally:
        os.close(r2)
        os.close(w2)


def test_a_negative_timeout_is_a_look_not_a_wait_forever(pipe):
    r, _ = pipe
    started = time.monotonic()
    assert readable(r, -5) is False  # poll's own -1 would mean forever
    assert time.monotonic() - started < 1


def test_objects_with_fileno_are_given_back_themselves():
    a, b = socket.socketpair()
    with a, b:
        assert readable_among([a, b], 0) == []
        b.sendall(b"hi")
        assert readable_among([a, b], 0) == [a]
        b.close()
        a.recv(10)
        assert readable(a, 0) and a.recv(10) == b""  # the peer's close


def test_a_pidfd_is_readable_once_its_process_exits():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    fd = os.pidfd_open(child.pid)
    try:
        assert not readable(fd, 0)
        assert readable(fd, 10)
        child.wait()
    finally:
        os.close(fd)


def test_a_closed_descriptor_is_ebadf_as_select_says(pipe):
    r, w = pipe
    os.close(r)
    with pytest.raises(OSError) as control:
        select.select([r], [], [], 0)
    with pytest.raises(OSError) as caught:
        readable_among([w, r], 0)
    assert caught.value.errno == control.value.errno == errno.EBADF


def test_a_signal_does_not_cut_the_wait_short(pipe):
    r, _ = pipe
    seen = []
    old = signal.signal(signal.SIGALRM, lambda *_: seen.append(1))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        started = time.monotonic()
        assert readable(r, 0.3) is False
        assert time.monotonic() - started >= 0.3 and seen == [1]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_descriptors_above_select_bound():
    """The reason for the module: select refuses descriptors numbered 1024 and up (the
    control); poll takes them."""
    with descriptors_above():
        r, w = os.pipe()
        try:
            assert r > 1024 and w > 1024
            with pytest.raises(ValueError, match="filedescriptor out of range"):
                select.select([r], [], [], 0)
            assert not readable(r, 0)
            os.write(w, b"x")
            assert readable_among([r], 1) == [r]
            os.close(w)
            os.read(r, 1)
            assert readable(r, 1)
        finally:
            os.close(r)
            try:
                os.close(w)
            except OSError:
                pass
