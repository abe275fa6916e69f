"""The capture of the test script's own reward writes (sequester.sandbox.nsexec.capture):
the path rule, and the filter and supervisor against real processes."""

from __future__ import annotations

import os
import socket

import pytest

from sequester.guard import seccomp
from sequester.sandbox.nsexec.capture import Capture, verdict_name


@pytest.mark.parametrize(
    ("path", "name"),
    [
        (b"/logs/verifier/reward.txt", "reward.txt"),
        (b"/logs/verifier/reward.json", "reward.json"),
        (b"//logs/./verifier//reward.txt", "reward.txt"),
        (b"/logs/x/../verifier/reward.txt", "reward.txt"),
        (b"/logs/verifier/ctrf.json", None),
        (b"/logs/verifier/sub/reward.txt", None),
        (b"logs/verifier/reward.txt", None),  # relative: not followed
        (b"reward.txt", None),
        (b"/logs/verifier/reward.txt\0x", None),
        (b"/logs/verifier/\xffreward.txt", None),
        (b"", None),
    ],
)
def test_verdict_name(path, name):
    assert verdict_name(path) == name


def _calls() -> dict[int, str]:
    out = {}
    for name in ("open", "openat", "creat", "openat2"):
        try:
            out[seccomp.syscall_number(name)] = name
        except (OSError, ValueError, RuntimeError):
            pass
    return out


def test_only_the_shells_own_reward_writes_are_kept(tmp_path):
    """A child loads the filter and hands its listener over (as the verifier's shell does):
    its own writes to /logs/verifier/reward.txt (which does not even exist here) are kept,
    a truncating open starts over and an appending one goes on; what its child writes
    into that same descriptor is not kept; its open of another file, and its child's
    open of the reward path, go on unchanged. Fails without the filter, the listener,
    the supervisor or the sender check."""
    visible = tmp_path / "visible.txt"
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's life
        code = 1
        try:
            ours.close()
            listener = seccomp.load_filter(
                seccomp.compile_write_watch(), seccomp.syscall_number("seccomp"), listener=True
            )
            socket.send_fds(theirs, [b"l"], [listener])
            os.close(listener)
            theirs.close()
            with open("/logs/verifier/reward.txt", "w") as f:  # captured, then started over
                f.write("0\n")
            fd = os.open("/logs/verifier/reward.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.write(fd, b"1\n")
            grandchild = os.fork()
            if grandchild == 0:
                os.write(fd, b"9 from the child\n")  # into the shell's descriptor: not kept
                try:
                    open("/logs/verifier/reward.json", "w")
                except FileNotFoundError:
                    os._exit(0)  # not captured: the real path, which does not exist here
                os._exit(1)
            code = os.waitstatus_to_exitcode(os.waitpid(grandchild, 0)[1])
            os.close(fd)
            # `{ scorer; } > reward.json`: the shell opens it, only its child writes.
            scored = os.open("/logs/verifier/reward.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            scorer = os.fork()
            if scorer == 0:
                os.write(scored, b'{"reward": 1}')
                os._exit(0)
            os.waitpid(scorer, 0)
            os.close(scored)
            with open("/logs/verifier/reward.txt", "a") as f:  # appended
                f.write("more\n")
            with open(visible, "w") as f:  # goes on
                f.write("seen")
        finally:
            os._exit(code)
    theirs.close()
    _, fds, _, _ = socket.recv_fds(ours, 1, 1)
    ours.close()
    assert fds, "no listener came"
    capture = Capture(fds[0], child, _calls())
    try:
        status = capture.serve()
    finally:
        os.close(fds[0])
    assert os.waitstatus_to_exitcode(status) == 0
    assert capture.contents == {"reward.txt": b"1\nmore\n", "reward.json": b'{"reward": 1}'}
    assert capture.others == {"reward.txt", "reward.json"} and capture.borrowed == {"reward.json"}
    assert visible.read_text() == "seen"
