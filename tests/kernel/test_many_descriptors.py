"""Kernels started by a process that holds more than 1024 descriptors (a server with many
sessions open): every wait of the host side is on descriptors numbered above select's
bound, through each first stage, with the network's broker, and ``run_confined``."""

from __future__ import annotations

import os

import pytest
from many_fds import descriptors_above
from stages import STAGES, use_stage

from sequester import Kernel, Limits, Policy
from sequester.kernel.launch import run_confined


def _above(fd_probe_floor: int = 1024) -> bool:
    """The next descriptor this process opens is numbered above select's bound."""
    fd = os.open("/dev/null", os.O_RDONLY)
    os.close(fd)
    return fd > fd_probe_floor


@pytest.mark.parametrize("stage", STAGES)
def test_a_kernel_starts_runs_and_closes_above_select_bound(stage, monkeypatch, templates):
    use_stage(monkeypatch, stage)
    with descriptors_above():
        assert _above()
        with Kernel(Policy(limits=Limits(cell_timeout=10))) as k:
            r = k.run("x = 6 * 7\nprint('out')\nx")
            assert (r.value, r.stdout, r.error) == ("42", "out\n", None)
            r = k.run("while True: pass", timeout=0.5)  # the deadline, on a high descriptor
            assert r.error is not None and k.run("x").value == "42"


def test_a_kernel_reaches_its_allowed_service_above_select_bound(tagged_service):
    port = tagged_service(b"A")
    with descriptors_above():
        assert _above()
        with Kernel(Policy(allow=(f"127.0.0.1:{port}",))) as k:
            r = k.run(f"import socket\nwith socket.create_connection(('127.0.0.1', {port}), timeout=5) as s:\n"
                      "    got = s.recv(1).decode()\ngot")
            assert r.value == "'A'", r


def test_run_confined_above_select_bound(monkeypatch, templates):
    use_stage(monkeypatch, "template")
    with descriptors_above():
        assert _above()
        done = run_confined(Policy(), ["/bin/echo", "confined"], timeout=30)
    assert (done.returncode, done.stdout) == (0, "confined\n"), done
