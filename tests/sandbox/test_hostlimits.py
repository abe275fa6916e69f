"""The host's limits a sandbox counts against (sequester.sandbox.hostlimits), over stand-in
/proc trees (what a full machine says), and as this machine has them. The episodes that
hit them end to end: tests/environments/local/test_thousand.py."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from sequester.errors import SandboxError
from sequester.sandbox import hostlimits
from sequester.sandbox.hostlimits import check_pty_room, explain, no_pty_left, pty_limits


def _proc(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return root


PTYS = {"sys/kernel/pty/max": "4096", "sys/kernel/pty/reserve": "1024"}


def test_a_pty_left_is_room(tmp_path):
    proc = _proc(tmp_path, {**PTYS, "sys/kernel/pty/nr": "4095"})
    check_pty_room("another episode", proc)
    assert pty_limits(proc)[0].room == 1


def test_no_pty_left_is_refused_up_front_naming_the_limit(tmp_path):
    proc = _proc(tmp_path, {**PTYS, "sys/kernel/pty/nr": "4096"})
    with pytest.raises(SandboxError) as raised:
        check_pty_room("another episode", proc)
    said = str(raised.value)
    assert said.startswith("another episode needs a pty, and none is left"), said
    assert "kernel.pty.max is 4096 and 4096 ptys are in use" in said and "sysctl -w kernel.pty.max=8192" in said
    assert "the last 1024 are only for the host's own /dev/pts" in said


def test_a_kernel_that_does_not_say_is_no_refusal(tmp_path):
    check_pty_room("another episode", tmp_path)  # no /proc/sys/kernel/pty: nothing to check
    assert pty_limits(tmp_path) is None


def test_enospc_from_openpty_is_the_pty_limit_other_errors_are_not(tmp_path):
    proc = _proc(tmp_path, {**PTYS, "sys/kernel/pty/nr": "3072"})
    full = no_pty_left(OSError(errno.ENOSPC, "No space left on device"), "the episode's shell", proc)
    assert isinstance(full, SandboxError)
    assert "the episode's shell could not get a pty" in str(full) and "3072 ptys are in use" in str(full)
    assert no_pty_left(OSError(errno.EMFILE, "Too many open files"), "the episode's shell", proc) is None


def test_a_namespace_bwrap_could_not_make_is_named(tmp_path):
    """bwrap's two ways of saying it (seen here with user.max_user_namespaces lowered)."""
    limits = {f"sys/user/max_{kind}_namespaces": "96367" for kind in ("user", "mnt", "pid", "net", "ipc", "uts")}
    proc = _proc(tmp_path, {**limits, "sys/user/max_user_namespaces": "8", "sys/user/max_net_namespaces": "4"})
    for message in (
        "bwrap: unshare user ns: No space left on device",
        "bwrap: Creating new namespace failed: nesting depth or /proc/sys/user/max_*_namespaces exceeded (ENOSPC)",
    ):
        said = explain(message, proc)
        assert said.startswith(message + " -- the host's limit on namespaces is reached"), said
        # the user namespaces' limit, and the one set lower than it; not those above it
        assert "user.max_user_namespaces = 8" in said and "user.max_net_namespaces = 4" in said
        assert "max_mnt_namespaces" not in said and "sysctl -w user.max_net_namespaces=N" in said


def test_a_process_that_could_not_start_names_the_task_limits(tmp_path, monkeypatch):
    monkeypatch.setattr(hostlimits, "_own_pids_cgroups", lambda: [])
    proc = _proc(tmp_path, {"loadavg": "0.1 0.2 0.3 1/32760 4242", "sys/kernel/pid_max": "32768",
                            "sys/kernel/threads-max": "192735"})
    said = explain("bwrap could not be started: [Errno 11] Resource temporarily unavailable", proc)
    assert "kernel.pid_max = 32768 (32760 in use)" in said and "kernel.threads-max = 192735" in said, said


def test_any_other_failure_is_left_as_it_is(tmp_path):
    assert explain("bwrap: Can't mount proc on /newroot/proc: Operation not permitted", tmp_path) == (
        "bwrap: Can't mount proc on /newroot/proc: Operation not permitted"
    )


def test_this_machine_says_its_limits():
    """Read from the real /proc: each with a value, and the machine's threads counted."""
    names = {limit.name: limit for limit in hostlimits.task_limits()}
    assert names["kernel.pid_max"].value > 0 and names["kernel.pid_max"].used > 0
    assert {limit.name for limit in hostlimits.namespace_limits()} >= {"user.max_user_namespaces"}
    for limit in names.values():
        if limit.name.startswith("pids.max of the cgroup"):
            assert Path(limit.name.split()[-1], "pids.max").exists()
