"""Pure parts of the kernel's confinement: its namespaces' mounts, Landlock carving, the
handoff rule of the seccomp filter, and the HTTP parsing of the broker."""

from pathlib import Path

import pytest

from sequester.guard.landlock import carve_files
from sequester.guard.namespaces import (MS_BIND, MS_NOEXEC, MS_RDONLY, MS_REC, MS_REMOUNT, SELF_MEM, SELF_TASKS, STAGING,
                                        plan_workspace)
from sequester.net.http import Refused, parse_direct, parse_request_line, refusal

P = Path


def test_one_noexec_tmpfs_backs_both_tmp_and_dev_shm():
    steps = plan_workspace(8 << 20, P("/tmp/workspace"))
    mounts = [s for s in steps if s.op == "mount"]
    tmpfs = [s for s in mounts if s.fstype == "tmpfs" and s.target != SELF_TASKS]
    assert len(tmpfs) == 1 and tmpfs[0].target == STAGING and tmpfs[0].flags & MS_NOEXEC
    assert "size=8388608" in tmpfs[0].data
    binds = {s.target: s.source for s in mounts if s.flags & MS_BIND and not s.flags & MS_REMOUNT}
    assert binds == {P("/tmp"): str(STAGING / "tmp"), P("/dev/shm"): str(STAGING / "shm"), SELF_MEM: "/dev/null"}
    order = [s.target for s in steps]
    # The staging mount is detached only after both binds; the workspace is made last, in the new /tmp.
    assert order.index(P("/tmp")) < order.index(STAGING, 2) and order[-1] == P("/tmp/workspace")
    dev = next(s for s in mounts if s.target == P("/dev"))
    assert dev.flags & MS_REMOUNT and dev.flags & MS_RDONLY
    # The process's own memory is not writable through /proc: mem is /dev/null, the
    # threads' folder (their mem files, /proc/thread-self) an empty read-only tmpfs.
    tasks = next(s for s in mounts if s.target == SELF_TASKS)
    assert tasks.fstype == "tmpfs" and tasks.flags & MS_RDONLY


def test_carving_files_out_of_landlock_grants_keeps_their_folders_listable():
    tree = {P("/usr"): ["bin", "lib"], P("/usr/lib"): ["python3.11", "x86_64-linux-gnu"],
            P("/usr/lib/python3.11"): ["os.py", "lib-dynload"], P("/usr/lib/python3.11/lib-dynload"): ["_ctypes.so", "_bisect.so"]}
    read, listable = carve_files([P("/usr"), P("/etc")], [P("/usr/lib/python3.11/lib-dynload/_ctypes.so")],
                                 listdir=lambda p: tree[p])
    assert P("/usr/lib/python3.11/lib-dynload/_ctypes.so") not in read
    assert set(read) == {P("/etc"), P("/usr/bin"), P("/usr/lib/x86_64-linux-gnu"), P("/usr/lib/python3.11/os.py"),
                         P("/usr/lib/python3.11/lib-dynload/_bisect.so")}
    assert set(listable) == {P("/usr"), P("/usr/lib"), P("/usr/lib/python3.11"), P("/usr/lib/python3.11/lib-dynload")}


def test_the_kernel_filter_lets_only_the_handoff_execve_through():
    """Load the kernel filter in a child process and try both execve forms."""
    import subprocess
    import sys

    code = r'''
import ctypes, os, sys
from sequester.guard import seccomp
from sequester.guard.handoff import Handoff
handoff = Handoff("/bin/true", ["/bin/true"], {})
seccomp.load_filter(seccomp.compile_filter("kernel"), seccomp.syscall_number("seccomp"))
try:
    os.execv("/bin/true", ["/bin/true"])
except PermissionError:
    print("plain execve refused", flush=True)
handoff.execute()
'''
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr  # /bin/true ran: the handoff went through
    assert proc.stdout == "plain execve refused\n"


def test_request_lines_parse_or_refuse():
    assert parse_request_line(b"CONNECT api.test:443 HTTP/1.1").host == "api.test"
    r = parse_request_line(b"GET http://svc:8080/a?b=1 HTTP/1.1")
    assert (r.host, r.port, r.tunnel, r.line) == ("svc", 8080, False, b"GET /a?b=1 HTTP/1.1\r\n")
    for bad in (b"CONNECT x:99999 HTTP/1.1", b"GET http://x:99999/ HTTP/1.1", b"NONSENSE", b"GET ftp://x/ HTTP/1.1"):
        with pytest.raises(Refused) as info:
            parse_request_line(bad)
        assert info.value.status == 400
    assert parse_direct(b"DIRECT h 443\r\n") == ("h", 443) and parse_direct(b"DIRECT h 99999\r\n") is None


def test_a_refusal_carries_its_reason_in_header_and_body_and_cannot_split_the_header():
    data = refusal(403, "x:1 is not allowed\r\nSet-Cookie: a")
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"\r\nSet-Cookie" not in head and b"X-Sequester-Reason: x:1 is not allowed??Set-Cookie: a" in head
    assert body.startswith(b"x:1 is not allowed")


def test_binds_below_tmp_are_carried_into_the_new_tmp():
    steps = plan_workspace(1 << 20, P("/tmp/workspace"), keep=(P("/tmp/a/src"),))
    order = [(s.op, s.target) for s in steps]
    carried = STAGING / "tmp" / "a" / "src"
    assert order.index(("mountpoint", carried)) < order.index(("mount", carried)) < order.index(("mount", P("/tmp")))
    tmp = next(s for s in steps if s.op == "mount" and s.target == P("/tmp"))
    assert tmp.flags & MS_REC  # recursive: the carried bind comes along
