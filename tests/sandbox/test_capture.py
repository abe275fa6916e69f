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


def test_the_shells_reward_writes_land_in_the_private_folder_and_nothing_else_does(tmp_path):
    """A child loads the filter and hands its listener over (as the verifier's shell does);
    its own open of /logs/verifier/reward.txt gets a file of the private folder (the path
    does not even exist here), its open of another file and its child's open of the reward
    path go on unchanged. Fails without the filter, the listener or the supervisor."""
    private = tmp_path / "private"
    private.mkdir()
    visible = tmp_path / "visible.txt"
    folder = os.open(private, os.O_RDONLY | os.O_DIRECTORY)
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
            with open("/logs/verifier/reward.txt", "w") as f:  # captured
                f.write("1\n")
            with open("/logs/verifier/reward.txt", "a") as f:  # appended to the same private file
                f.write("more\n")
            with open(visible, "w") as f:  # goes on
                f.write("seen")
            grandchild = os.fork()
            if grandchild == 0:
                try:
                    open("/logs/verifier/reward.json", "w")
                except FileNotFoundError:
                    os._exit(0)  # not captured: the real path, which does not exist here
                os._exit(1)
            code = os.waitstatus_to_exitcode(os.waitpid(grandchild, 0)[1])
        finally:
            os._exit(code)
    theirs.close()
    _, fds, _, _ = socket.recv_fds(ours, 1, 1)
    ours.close()
    assert fds, "no listener came"
    capture = Capture(fds[0], child, folder, _calls())
    try:
        status = capture.serve()
        files = capture.files(1 << 20)
    finally:
        os.close(fds[0])
        os.close(folder)
    assert os.waitstatus_to_exitcode(status) == 0
    assert files == {"reward.txt": b"1\nmore\n"}
    assert visible.read_text() == "seen"
    assert capture.handled >= 4
