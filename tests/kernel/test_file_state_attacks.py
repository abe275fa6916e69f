"""Attacks through kernel state a sandbox attaches to what it only sees (seccomp's refusals
in :mod:`sequester.guard.seccomp`): a lease that makes a host reader wait, a directory
notification that reports the host's activity, an inotify watch, a datagram from a
guard-only kernel, an agent's lease in an episode. Each is tried through every first
stage, as root and as an ordinary caller, and fails if its refusal is removed; a control
shows each mechanism works on this machine where nothing refuses it."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from conditions import requires_root
from nobody_site import SYSTEM_PYTHON, nobody_site
from paths import EXAMPLES
from stages import STAGES

from sequester import Kernel, Policy
from sequester.guard import seccomp
from sequester.kernel.stage0 import stage0_program

ROOT = os.geteuid() == 0
# An ordinary caller: a user and network namespace of its own, lo brought up with the
# namespace's capabilities, which are then dropped before the harness starts (an exec as
# a non-root id keeps none): a guard-only kernel refuses to start holding any.
USER_NET = ["--user", "--map-current-user", "--keep-caps", "sh", "-c",
            "ip link set lo up && ip addr add 10.253.0.1/32 dev lo && "
            'exec setpriv --inh-caps=-all --ambient-caps=-all --bounding-set=-all "$0" "$@"']

# A cell's attempt on a file of a read-only path the caller shares with it (its own, as
# the lease needs: a root caller's kernel is nobody, so the file is nobody's).
LEASE_CELL = r"""
import errno, fcntl, os
fd = os.open(PATH, os.O_RDONLY)
try:
    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
    HELD, RESULT = fd, 'leased'
except OSError as e:
    os.close(fd)
    RESULT = errno.errorcode[e.errno]
RESULT
"""

NOTIFY_CELL = r"""
import errno, fcntl, os, signal
SEEN = []
signal.signal(signal.SIGIO, lambda *a: SEEN.append(1))
fd = os.open(FOLDER, os.O_RDONLY)
try:
    fcntl.fcntl(fd, fcntl.F_NOTIFY, fcntl.DN_ACCESS | fcntl.DN_MODIFY | fcntl.DN_CREATE | fcntl.DN_MULTISHOT)
    RESULT = 'watching'
except OSError as e:
    RESULT = errno.errorcode[e.errno]
RESULT
"""

# Run as the caller (root in this process, or nobody on a copy of sequester): a kernel of
# the stage takes a lease and watches a folder; the harness then opens the file and reads
# in the folder as a host process would.
HARNESS = r'''
import json, os, shutil, sys, tempfile, threading, time
os.environ["SEQUESTER_NATIVE_STAGE"] = "0" if sys.argv[1] == "python" else "1"
os.environ["SEQUESTER_VIEW_TEMPLATE"] = "1" if sys.argv[1] == "template" else "0"
lease_cell, notify_cell = sys.argv[2], sys.argv[3]
from sequester import Kernel, Policy
folder = tempfile.mkdtemp(prefix="seq-lease-", dir="/var/tmp")
os.chmod(folder, 0o755)
path = os.path.join(folder, "shared.txt")
with open(path, "w") as f:
    f.write("data\n")
if os.getuid() == 0:  # a root caller's kernel is nobody: the file must be its to lease
    os.chown(path, 65534, 65534)
out = {}
try:
    with Kernel(Policy(readonly=[folder])) as k:
        out["stage"], out["view"] = k.report["first_stage"], k.report.get("view")
        r = k.run(f"PATH = {path!r}\n" + lease_cell, timeout=30)
        out["lease"] = r.value if r.error is None else f"{r.error.type}: {r.error.message}"
        opened = {}
        def host_open():
            started = time.monotonic()
            with open(path) as f:
                f.read()
            opened["s"] = time.monotonic() - started
        t = threading.Thread(target=host_open, daemon=True)
        t.start()
        t.join(5)
        out["host_open_s"] = opened.get("s")  # None: still waiting for the kernel
        r = k.run(f"FOLDER = {folder!r}\n" + notify_cell, timeout=30)
        out["notify"] = r.value if r.error is None else f"{r.error.type}: {r.error.message}"
        for _ in range(5):
            with open(path) as f:
                f.read()
            with open(os.path.join(folder, "new.txt"), "w") as f:
                f.write("x")
        time.sleep(0.3)
        out["signals"] = k.run("len(SEEN)", timeout=30).value
finally:
    shutil.rmtree(folder, ignore_errors=True)
print(json.dumps(out))
'''


def _run_harness(stage: str, as_nobody: bool) -> dict:
    if stage != "python" and stage0_program() is None:
        pytest.skip("the native stage cannot be built here")
    if not as_nobody:
        proc = subprocess.run([sys.executable, "-c", HARNESS, stage, LEASE_CELL, NOTIFY_CELL], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])
    if not SYSTEM_PYTHON.exists():
        pytest.skip("as root the user flow runs on /usr/bin/python3, which is missing")
    with nobody_site() as run:
        path = Path(tempfile.mkdtemp(prefix="seq-harness-", dir="/var/tmp"))
        try:
            script = path / "harness.py"
            script.write_text(HARNESS)
            os.chmod(path, 0o755)
            os.chmod(script, 0o644)
            proc = run(f"import runpy, sys\nsys.argv = ['h', {stage!r}, {LEASE_CELL!r}, {NOTIFY_CELL!r}]\n"
                       f"runpy.run_path({str(script)!r}, run_name='__main__')\n")
        finally:
            shutil.rmtree(path, ignore_errors=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])


def _flows() -> list:
    flows = [pytest.param(stage, False, id=f"{stage}-{'root' if ROOT else 'user'}") for stage in STAGES]
    flows += [pytest.param(stage, True, id=f"{stage}-nobody", marks=requires_root) for stage in STAGES]
    return flows


@pytest.mark.slow
@pytest.mark.parametrize("stage,as_nobody", _flows())
def test_a_kernel_can_neither_lease_nor_watch_what_it_sees(stage, as_nobody):
    """Attack: a cell takes a write lease on a file of its read-only view (a host process
    that opens it then waits for the kernel, up to lease-break-time: 45 s here) and watches
    a folder of it for every process's access (dnotify). Both are refused: the host's
    open returns at once, and no signal tells the kernel of the host's reads."""
    out = _run_harness(stage, as_nobody)
    assert out["lease"] == "'EPERM'", out
    assert out["host_open_s"] is not None and out["host_open_s"] < 1.0, out
    assert out["notify"] == "'EPERM'", out
    assert out["signals"] == "0", out


def test_control_a_lease_makes_a_host_reader_wait_where_nothing_refuses_it(tmp_path):
    """The mechanism is real here: a process holding a write lease makes another's open
    wait until it lets go (here, as soon as it is told)."""
    path = tmp_path / "leased.txt"
    path.write_text("data\n")
    fd = os.open(path, os.O_RDONLY)
    released = threading.Event()

    def on_break(signum, frame):  # the lease is being broken: let go after a while
        time.sleep(0.5)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        released.set()

    old = signal.signal(signal.SIGIO, on_break)
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", f"open({str(path)!r}).read()"], timeout=60)
        waited = time.monotonic() - started
    finally:
        signal.signal(signal.SIGIO, old)
        os.close(fd)
    assert proc.returncode == 0 and released.is_set() and waited >= 0.4


INOTIFY_PROBE = r"""
#include <errno.h>
#include <stdio.h>
#include <sys/inotify.h>
int main(void) {
    int fd = inotify_init1(0);
    int e1 = fd < 0 ? errno : 0;
    int w = fd < 0 ? -1 : inotify_add_watch(fd, "/etc", IN_ACCESS);
    printf("init %d %d watch %d\n", fd, e1, w);
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler for the probe")
def test_inotify_is_refused_to_what_a_kernel_runs(tmp_path, templates):
    """Attack: native code in a kernel (an installed extension, here a program run under a
    kernel's whole confinement) watches /etc with inotify. Refused: EPERM."""
    from sequester.kernel.launch import run_confined

    source, program = tmp_path / "probe.c", tmp_path / "probe"
    source.write_text(INOTIFY_PROBE)
    subprocess.run(["cc", "-O1", "-o", str(program), str(source)], check=True, timeout=120)
    os.chmod(tmp_path, 0o755)
    result = run_confined(Policy(readonly=[tmp_path]), [str(program)], timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "init -1 1 watch -1", result.stdout  # errno 1: EPERM


def test_control_inotify_works_here_unconfined(tmp_path):
    if shutil.which("cc") is None:
        pytest.skip("needs a C compiler for the probe")
    source, program = tmp_path / "probe.c", tmp_path / "probe"
    source.write_text(INOTIFY_PROBE)
    subprocess.run(["cc", "-O1", "-o", str(program), str(source)], check=True, timeout=120)
    out = subprocess.run([str(program)], capture_output=True, text=True, timeout=30).stdout.split()
    assert out[1] != "-1" and out[4] != "-1", out


# -- guard-only mode: no datagram leaves ------------------------------------------------

GUARD_HARNESS = r'''
import json, os, socket, subprocess, sys
# In a network namespace of the test's own: loopback and a private address on it, each
# with a UDP listener, so that nothing a kernel sends can leave the machine even without
# the guard.
if ",UP" not in subprocess.run(["ip", "-br", "link", "show", "lo"], capture_output=True, text=True).stdout:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)  # (an ordinary caller's argv did it)
if "10.253.0.1" not in subprocess.run(["ip", "-br", "addr", "show", "lo"], capture_output=True, text=True).stdout:
    subprocess.run(["ip", "addr", "add", "10.253.0.1/32", "dev", "lo"], check=True)
listeners = {}
for address in ("127.0.0.1", "10.253.0.1"):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((address, 0))
    s.settimeout(0.5)
    listeners[address] = s
from sequester import Kernel, Policy
from sequester.kernel.check_native import DISABLE_HOOK
out = {}
with Kernel(Policy(isolation="guard")) as k:
    out["mode"] = k.mode.value
    # The audit hook would refuse the sendto first: a tripwire, switched off here as a cell can.
    out["hook_off"] = k.run(DISABLE_HOOK + "hook_off", timeout=30).value
    targets = {a: s.getsockname()[1] for a, s in listeners.items()}
    code = "import errno, socket\nsent = {}\n"
    for address, port in targets.items():
        code += (f"try:\n    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                 f"    s.sendto(b'out', ({address!r}, {port}))\n    sent[{address!r}] = 'sent'\n"
                 f"except OSError as e:\n    sent[{address!r}] = errno.errorcode.get(e.errno, str(e.errno))\n")
    code += "sent"
    r = k.run(code, timeout=30)
    out["sent"] = r.value if r.error is None else f"{r.error.type}: {r.error.message}"
received = {}
for address, s in listeners.items():
    try:
        received[address] = s.recv(100).decode()
    except OSError:
        received[address] = None
out["received"] = received
print(json.dumps(out))
'''


@pytest.mark.skipif(shutil.which("ip") is None or shutil.which("unshare") is None, reason="needs iproute2 and unshare")
def test_a_guard_only_kernel_sends_no_datagram(tmp_path):
    """Attack: in guard-only mode (no network namespace), Landlock limits TCP only, so a
    cell could send UDP anywhere, stopped by nothing but the audit hook (which a cell can
    switch off). The filter refuses the socket itself: EPERM, and nothing arrives."""
    script = tmp_path / "guard.py"
    script.write_text(GUARD_HARNESS)
    argv = ["unshare", "--net", *([] if ROOT else USER_NET), sys.executable, str(script)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["mode"] == "guard" and out["hook_off"] == "'disabled'", out
    assert "EPERM" in out["sent"] and "'sent'" not in out["sent"], out
    assert out["received"] == {"127.0.0.1": None, "10.253.0.1": None}, out


def test_a_guard_only_kernel_still_reaches_an_allowed_name(tmp_path):
    """Without a resolver of its own (no UDP), a guard-only kernel resolves the policy's
    names from the table the host made: ``localhost`` here, connected on its port."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with Kernel(Policy(isolation="guard", allow=[f"localhost:{port}"])) as k:
            r = k.run(f"import socket\nc = socket.create_connection(('localhost', {port}), timeout=5)\n"
                      "c.close()\nsocket.getaddrinfo('localhost', 1)[0][4][0]", timeout=30)
            assert r.error is None and r.value == "'127.0.0.1'", r.error
            r = k.run("import socket\nsocket.getaddrinfo('pypi.org', 443)", timeout=30)
            assert r.error is not None  # not allowed: not resolved (the hook refuses first)


# -- an episode's agent ------------------------------------------------------------------


@pytest.mark.slow
def test_an_agent_cannot_lease_a_file_the_host_reads(episode):
    """Attack: an agent leases a file of its view that the host reads (the namespace
    helper packs artifacts, reads files for the trial): the read would wait up to 45 s,
    again and again. Refused to the agent's processes, as to kernels; its advisory locks
    and inotify still work (package managers and file watchers need them)."""
    episode.reset(EXAMPLES / "python-csv-stats")
    probe = (
        "import errno, fcntl, os\n"
        "open('/app/leased', 'w').close()\n"
        "fd = os.open('/app/leased', os.O_RDONLY)\n"
        "def attempt(call):\n"
        "    try:\n        call()\n        return 'allowed'\n"
        "    except OSError as e:\n        return errno.errorcode[e.errno]\n"
        "d = os.open('/app', os.O_RDONLY)\n"
        "print(attempt(lambda: fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)),"
        " attempt(lambda: fcntl.fcntl(d, fcntl.F_NOTIFY, fcntl.DN_ACCESS)),"
        " attempt(lambda: fcntl.flock(fd, fcntl.LOCK_SH)))\n"
    )
    episode.write_file("/tmp/probe.py", probe)
    r = episode.exec("python3 /tmp/probe.py")
    assert r.stdout.split() == ["EPERM", "EPERM", "allowed"], (r.stdout, r.stderr)
    started = time.monotonic()
    assert episode.read_file("/app/leased") == b""
    assert time.monotonic() - started < 5


def test_the_check_row_fails_without_the_refusals(monkeypatch):
    """``sequester check``'s row proves the refusals: with them taken out of the filter
    (a kernel compiled from a filter without them), the row fails."""
    from sequester.kernel.check import _no_file_state

    with Kernel(Policy()) as k:
        assert _no_file_state(k).passed
    monkeypatch.setattr(seccomp, "KERNEL_FCNTL_REFUSED", ())
    monkeypatch.setattr(seccomp, "REFUSED_SOCKET_TYPES", ())
    monkeypatch.setattr(seccomp, "_COMPILED", {})
    monkeypatch.setenv("SEQUESTER_VIEW_TEMPLATE", "0")  # a fresh view: its filter is compiled anew
    with Kernel(Policy()) as k:
        finding = _no_file_state(k)
    assert not finding.passed and "lease: allowed" in finding.evidence and "udp: allowed" in finding.evidence


# -- fcntl with bit 32 of cmd -------------------------------------------------------

FCNTL_PROBE = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
/* argv[1]: a folder of the view the host works in; lease: a file of the kernel's own. */
static volatile sig_atomic_t seen;
static void on_io(int s) { (void)s; seen++; }
int main(int argc, char **argv) {
    (void)argc;
    unsigned long high = 1UL << 32; /* the kernel's fcntl takes an unsigned int cmd */
    signal(SIGIO, on_io);
    int f = open("own-lease", O_RDONLY | O_CREAT, 0600);
    long lease = syscall(SYS_fcntl, f, high | F_SETLEASE, (long)F_RDLCK);
    int le = lease < 0 ? errno : 0;
    int d = open(argv[1], O_RDONLY | O_DIRECTORY);
    long notify = syscall(SYS_fcntl, d, high | F_NOTIFY, (long)(DN_ACCESS | DN_MODIFY | DN_CREATE | DN_MULTISHOT));
    int ne = notify < 0 ? errno : 0;
    struct timespec t = {0, 100000000};
    for (int i = 0; i < 40; i++) nanosleep(&t, NULL);
    printf("lease %d notify %d signals %d\n", le, ne, (int)seen);
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler for the probe")
def test_fcntl_refusals_hold_with_high_bits_in_cmd(tmp_path, templates):
    """The filter's rule is ``fcntl`` with arg 1 EQ 1024/1026/1036,
    compared on 64 bits; the kernel truncates ``cmd`` to 32. ``cmd | 1 << 32`` passes the
    filter and is F_SETLEASE / F_NOTIFY: the lease is granted and the host's file creation
    in a folder of the view is signalled to the kernel."""
    from sequester.kernel.launch import run_confined

    source, program = tmp_path / "probe.c", tmp_path / "probe"
    source.write_text(FCNTL_PROBE)
    subprocess.run(["cc", "-O1", "-o", str(program), str(source)], check=True, timeout=120)
    os.chmod(tmp_path, 0o755)

    def host_activity():
        time.sleep(1.5)
        for i in range(5):
            (tmp_path / f"host-{i}").write_text("x")
            time.sleep(0.1)

    worker = threading.Thread(target=host_activity)
    worker.start()
    try:
        result = run_confined(Policy(readonly=[tmp_path]), [str(program), str(tmp_path)], timeout=60)
    finally:
        worker.join()
    assert result.returncode == 0, result.stderr
    # errno 1: EPERM from the filter.
    assert result.stdout.strip() == "lease 1 notify 1 signals 0", result.stdout


@pytest.mark.slow
def test_agent_fcntl_refusals_hold_with_high_bits_in_cmd(episode):
    """Attack: any program of an episode could pass the agent profile's fcntl rule
    the same way (here Python's ctypes, which agents have)."""
    episode.reset(EXAMPLES / "python-csv-stats")
    probe = (
        "import ctypes, errno, os, signal\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.syscall.restype = ctypes.c_long\n"
        "signal.signal(signal.SIGIO, signal.SIG_IGN)\n"
        "open('/app/leased', 'w').close()\n"
        "fd = os.open('/app/leased', os.O_RDONLY)\n"
        "d = os.open('/app', os.O_RDONLY)\n"
        "def fcntl(fd, cmd, arg):\n"
        "    r = libc.syscall(ctypes.c_long(72), ctypes.c_long(fd), ctypes.c_ulong(cmd), ctypes.c_long(arg))\n"
        "    return 'allowed' if r >= 0 else errno.errorcode[ctypes.get_errno()]\n"
        "high = 1 << 32\n"
        "print(fcntl(fd, high | 1024, 0), fcntl(d, high | 1026, 1))\n"  # F_SETLEASE F_RDLCK, F_NOTIFY DN_ACCESS
    )
    if os.uname().machine != "x86_64":
        pytest.skip("the probe uses x86_64's fcntl number")
    episode.write_file("/tmp/probe.py", probe)
    r = episode.exec("python3 /tmp/probe.py")
    assert r.stdout.split() == ["EPERM", "EPERM"], (r.stdout, r.stderr)


# -- guard-only: listen() autobinds ---------------------------------------------------

LISTEN_HARNESS = r'''
import json, socket, subprocess
if ",UP" not in subprocess.run(["ip", "-br", "link", "show", "lo"], capture_output=True, text=True).stdout:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)  # (an ordinary caller's argv did it)
from sequester import Kernel, Policy
out = {}
with Kernel(Policy(isolation="guard")) as k:    # the audit hook stays on
    out["mode"] = k.mode.value
    r = k.run("import socket, errno\nL = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"
              "try:\n    L.listen(1)\n    R = L.getsockname()[1]\nexcept OSError as e:\n"
              "    R = errno.errorcode[e.errno]\nR", timeout=30)
    out["listen"] = r.value if r.error is None else f"{r.error.type}: {r.error.message}"
    if r.error is None and r.value.isdigit():
        c = socket.create_connection(("127.0.0.1", int(r.value)), timeout=3)
        c.sendall(b"inbound")
        r = k.run("conn, _ = L.accept()\nconn.recv(100)", timeout=30)
        out["accepted"] = r.value if r.error is None else f"{r.error.type}: {r.error.message}"
print(json.dumps(out))
'''


@pytest.mark.skipif(shutil.which("ip") is None or shutil.which("unshare") is None, reason="needs iproute2 and unshare")
def test_a_guard_only_kernel_serves_nothing(tmp_path):
    """A guard-only
    kernel shares the host's network namespace; Landlock refuses an explicit bind
    (EACCES), but listen() on an unbound socket autobinds an ephemeral port on every
    address, and no audit event sees it: anyone who reaches the host connects in. Here
    in a network namespace of the test's own."""
    script = tmp_path / "listen.py"
    script.write_text(LISTEN_HARNESS)
    argv = ["unshare", "--net", *([] if ROOT else USER_NET), sys.executable, str(script)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["mode"] == "guard", out
    assert "accepted" not in out and out["listen"] in ("'EPERM'", "'EACCES'"), out


# -- agents' inotify on the host's folders ---------------------------------------------


@pytest.mark.slow
def test_an_agent_does_not_see_the_hosts_reads(episode):
    """The change keeps inotify for agents because "in an episode it sees the
    episode's own overlay"; but the view binds host folders read-only (the Python
    installation, /opt/sequester-verifier, the venv): a watch there reports every host
    process's (and other episodes', and verifiers') opens and reads."""
    import sysconfig

    watched = Path(sysconfig.get_paths()["stdlib"]).resolve() / "json"
    episode.reset(EXAMPLES / "python-csv-stats")
    mounts = episode.exec("cat /proc/self/mountinfo").stdout
    if not any(line.split()[4] != "/" and str(watched).startswith(line.split()[4]) and line.split()[3] != "/"
               for line in mounts.splitlines()):
        pytest.skip(f"{watched} is not a host bind in the episode's view here")
    probe = r'''
import ctypes, os, select, struct, time
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init1(os.O_NONBLOCK)
w = libc.inotify_add_watch(fd, WATCHED.encode(), 0x1 | 0x20)  # IN_ACCESS | IN_OPEN
names = set()
deadline = time.time() + 6
while fd >= 0 and w >= 0 and time.time() < deadline:
    select.select([fd], [], [], 0.2)
    try:
        buf = os.read(fd, 65536)
    except BlockingIOError:
        continue
    i = 0
    while i < len(buf):
        _, _, _, n = struct.unpack_from("iIII", buf, i)
        names.add(buf[i + 16:i + 16 + n].rstrip(b"\0").decode())
        i += 16 + n
print(fd >= 0 and w >= 0, sorted(names))
'''.replace("WATCHED", repr(str(watched)))
    episode.write_file("/tmp/probe.py", probe)

    def host_reads():
        time.sleep(3)
        (watched / "decoder.py").read_bytes()

    worker = threading.Thread(target=host_reads)
    worker.start()
    try:
        r = episode.exec("python3 /tmp/probe.py")
    finally:
        worker.join()
    assert "decoder.py" not in r.stdout, (r.stdout, r.stderr)


# -- page cache: preadv2(RWF_NOWAIT) ------------------------------------------------


def test_a_kernel_cannot_tell_whether_the_host_read_a_file(tmp_path, templates):
    """A read with
    RWF_NOWAIT fails with EAGAIN unless the page is cached: a kernel learns that a host
    process read a file it sees, the information F_NOTIFY's DN_ACCESS was refused for."""
    if not hasattr(os, "RWF_NOWAIT"):
        pytest.skip("no preadv2 here")
    os.chmod(tmp_path, 0o755)
    path = tmp_path / "probe.bin"
    path.write_bytes(os.urandom(1 << 21))
    os.chmod(path, 0o644)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)

    def evict():
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    probe = (
        f"import errno, os\nfd = os.open({str(path)!r}, os.O_RDONLY)\n"
        "try:\n    R = os.preadv(fd, [bytearray(4096)], 1 << 20, os.RWF_NOWAIT) > 0\n"
        "except OSError as e:\n    R = errno.errorcode[e.errno]\nos.close(fd)\nR"
    )
    try:
        with Kernel(Policy(readonly=[tmp_path])) as k:
            evict()
            cold = k.run(probe, timeout=30).value
            path.read_bytes()  # a host process reads it
            warm = k.run(probe, timeout=30).value
    finally:
        os.close(fd)
    assert not (cold == "'EAGAIN'" and warm == "True"), (cold, warm)
