"""Red team of a kernel's isolation: real kernels, no mocks. A cell goes for the process's
memory through a thread's /proc entry, for the host uid of a root-flow kernel, and for
protections not tested elsewhere.

Each "Attack" test fails while the hole it names is open. The ordinary-user flow is the
kernel tests' ``user_flow`` fixture (tests/kernel/conftest.py: a harness run as
``nobody`` on a world-readable copy of sequester when these tests run as root).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from sequester import Kernel, Policy
from sequester.sandbox.probe import namespace_support

from exploits import HANDOFF_EXEC_CODE, handoff_exec  # tests/helpers
from stages import REPORTED, STAGES, checked, run_here, use_stage  # tests/helpers

ROOT = os.geteuid() == 0
NOBODY = 65534
X86_64 = platform.machine() == "x86_64"

needs_root = pytest.mark.skipif(not ROOT, reason="needs root (the root flow; CI runs as root)")
needs_x86_64 = pytest.mark.skipif(not X86_64, reason="the exploit's machine code is x86-64")
pytestmark = pytest.mark.skipif(not namespace_support().available, reason="no user namespaces here")


# -- the process's memory through a thread's /proc entry -----------------------------------

# /proc/<tid> of a thread that is not the group leader is not listed in /proc but
# resolves; its mem file is the same address space as /proc/self/mem (which is covered).
THREAD_MEM = r'''
import os, threading
def attempt():
    box, done = {}, threading.Event()
    def park():
        box["tid"] = threading.get_native_id()
        done.wait()
    t = threading.Thread(target=park, daemon=True)
    t.start()
    while "tid" not in box:
        pass
    try:
        path = "/proc/%d/mem" % box["tid"]
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            return "refused: " + exc.strerror
        try:
            start = next(int(l.split("-")[0], 16) for l in open("/proc/self/maps") if l.split()[1] == "r-xp")
            same = os.pread(fd, 16, start)
            # The same bytes back: a write into code (a /dev/null reads nothing: no write).
            return "WROTE" if len(same) == 16 and os.pwrite(fd, same, start) == 16 else "refused: nothing there"
        except OSError as exc:
            return "refused: " + exc.strerror
        finally:
            os.close(fd)
    finally:
        done.set()
        t.join()
attempt()
'''


@pytest.mark.parametrize("stage", STAGES)
def test_a_cell_cannot_write_its_code_through_a_threads_proc_mem(stage, monkeypatch):
    """Attack (red team; both stages, root flow): the first stage covers
    /proc/self/mem and /proc/self/task, i.e. only the main thread's entries. A cell
    starts a thread (tid 2 in the kernel's PID namespace): /proc/2/mem resolves
    (unlisted, not covered) and is the same address space, so the cell writes its own
    code again (the /proc/self/mem exploit works unchanged through it). Protection: the write
    lock, Landlock set by either first stage: nothing is writable but the workspace,
    /dev/shm and the device nodes, so no thread's mem file opens for writing."""
    use_stage(monkeypatch, stage)
    assert checked(run_here(THREAD_MEM), stage).startswith("refused")


@pytest.mark.parametrize("stage", STAGES)
def test_a_cell_cannot_write_its_code_through_a_threads_proc_mem_ordinary_user(stage, user_flow):
    """Attack (red team; both stages, ordinary-user flow): as above. Protection
    wanted: as above."""
    assert checked(user_flow(THREAD_MEM, stage), stage).startswith("refused")


THREAD_HANDOFF = '''
import threading
box = {}
threading.Thread(target=lambda: (box.setdefault("tid", threading.get_native_id()), threading.Event().wait(60)),
                 daemon=True).start()
while "tid" not in box:
    pass
''' + handoff_exec('"/proc/%d/mem" % box["tid"]')

# No /proc at all: code objects are not verified, so LOAD_CONST with an index past its
# co_consts reads a pointer the cell placed in a bytes object, to a fake bytearray over
# all of memory; an anonymous mmap may be PROT_EXEC; one PyMethodDef (writable data)
# pointed at it runs the cell's machine code. Pure Python, standard library, no event the
# audit hook refuses.
BYTECODE_HANDOFF = f'''
import mmap, os, struct
fake = struct.pack("<qqqqqqq", 100, id(bytearray), 2**62, 2**62, 0, 0, 0)
def everything():
    consts = (None,)
    ptr = struct.pack("<q", id(fake) + 32)
    offset = id(ptr) + 32 - (id(consts) + 24)
    assert offset % 8 == 0
    n = (offset // 8) & 0xFFFFFFFF
    code = bytes([151, 0]) + b"".join(bytes([144, (n >> s) & 255]) for s in (24, 16, 8)) + bytes([100, n & 255, 83, 0])
    f = (lambda: None).__code__.replace(co_code=code, co_consts=consts, co_stacksize=2)
    return type(everything)(f, {{}})(), (ptr, consts)
memory, keep = everything()
page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write({HANDOFF_EXEC_CODE!r})
data = int.from_bytes(memory[id(page) + 16:id(page) + 24], "little")
method_def = int.from_bytes(memory[id(os.getloadavg) + 16:id(os.getloadavg) + 24], "little")
memory[method_def + 8:method_def + 16] = data.to_bytes(8, "little")
os.getloadavg()
'''


NATIVE_CODE_RESIDUAL = (
    "RESIDUAL (docs/security.md, 'The audit hook is a tripwire, not a boundary'): CPython does not check bytecode, so a "
    "cell gets arbitrary memory access, and an anonymous PROT_EXEC mapping (left allowed: JIT libraries need it) "
    "makes that native code, which can replay the handoff execve into another program of the view under the same "
    "filter, namespaces, limits and write lock; closing it needs a handoff that cannot be replayed")


@needs_x86_64
@pytest.mark.parametrize("route", ["thread_proc_mem", pytest.param(
    "bytecode_and_exec_mmap", marks=pytest.mark.xfail(strict=True, reason=NATIVE_CODE_RESIDUAL))])
@pytest.mark.parametrize("stage", STAGES)
def test_a_cell_cannot_reach_native_code_and_the_handoff_execve(stage, route, monkeypatch):
    """Attack (red team; both stages): native code from a cell, two new routes
    (a thread's /proc/<tid>/mem; crafted bytecode for an arbitrary read/write plus an
    anonymous PROT_EXEC mmap), then the handoff: the code maps HANDOFF_ADDRESS and
    execve-s /bin/cat, which the filter lets through. The kernel process becomes cat.
    Protection wanted: the cell runner's filter refuses every execve (the handoff
    must not be replayable: a second filter stacked once the runner is exec'd, or
    Landlock's EXECUTE right limited to the interpreter); and, for defence in depth,
    seccomp refusing PROT_EXEC on anonymous mmap and on mprotect (no landing pad),
    and the audit hook refusing ``code.__new__``/``code.replace`` with a foreign
    co_code (no bytecode-level memory corruption). The thread route is closed (the
    write lock: Landlock refuses opening any /proc/<tid>/mem for writing); the bytecode
    route is a residual (see NATIVE_CODE_RESIDUAL)."""
    if sys.version_info[:2] != (3, 11) and route == "bytecode_and_exec_mmap":
        pytest.skip("the bytecode is CPython 3.11's")
    use_stage(monkeypatch, stage)
    with Kernel(Policy()) as k:
        assert k.report["first_stage"] == REPORTED[stage][0]
        r = k.run(THREAD_HANDOFF if route == "thread_proc_mem" else BYTECODE_HANDOFF, timeout=30)
    assert "Name:\tcat" not in r.stdout, f"the cell execve-d /bin/cat through {route}:\n" + r.stdout[:300]


ANON_EXEC = r'''
import mmap
def attempt():
    out = {}
    for name, prot in (("rwx", mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC), ("rx", mmap.PROT_READ | mmap.PROT_EXEC)):
        try:
            mmap.mmap(-1, 4096, prot=prot).close()
            out[name] = "MAPPED"
        except OSError as exc:
            out[name] = "refused: " + exc.strerror
    return out
attempt()
'''


@pytest.mark.xfail(strict=True, reason=NATIVE_CODE_RESIDUAL)
@pytest.mark.parametrize("stage", STAGES)
def test_a_cell_cannot_map_anonymous_executable_memory(stage, monkeypatch):
    """Attack (red team, defence in depth): ``mmap.mmap(-1, n, prot=...|PROT_EXEC)``
    gives a cell writable, executable memory at an address it learns (the landing pad
    of the bytecode route above: no file, no noexec mount in the way). Protection
    wanted: the kernel's filter refuses mmap/mprotect with PROT_EXEC unless file-backed
    (mmap with MAP_ANONYMOUS and PROT_EXEC: EPERM; mprotect adding PROT_EXEC: EPERM)."""
    use_stage(monkeypatch, stage)
    seen = checked(run_here(ANON_EXEC), stage)
    assert not [k for k, v in seen.items() if v == "MAPPED"], seen


# -- the host uid of a root-flow kernel --------------------------------------------------------

SPY = r'''
import json, os, sys
pid = int(sys.argv[1])
out = {}
try:
    os.kill(pid, 0)
    out["signal"] = "SIGNALLED"
except OSError as exc:
    out["signal"] = "refused: " + exc.strerror
for name in ("mem", "root/tmp/workspace", "environ"):
    try:
        path = "/proc/%d/%s" % (pid, name)
        os.listdir(path) if name.startswith("root") else open(path, "rb").close()
        out[name] = "OPENED"
    except OSError as exc:
        out[name] = "refused: " + exc.strerror
print(json.dumps(out))
'''


@needs_root
def test_a_host_process_of_uid_nobody_cannot_signal_a_root_flow_kernel():
    """Attack (red team; root flow): a root caller's kernel drops to uid 65534,
    and its user namespace maps 65534 to host uid 65534 (uid_map ``65534 65534 1``):
    on the host it runs as ``nobody``, the uid of NFS squashing, daemons and the
    ordinary-user flow of this very test suite. Any host process of that uid may
    SIGSTOP or SIGKILL every root-flow kernel of the machine (kill(2) compares uids
    only; /proc/<pid>/mem held: refused). Protection: nobody inside maps to
    KERNEL_HOST_ID on the host, an id no host process has."""
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    with Kernel(Policy()) as k:
        pid = k.process.host_pids()[-1]
        proc = subprocess.run([python, "-I", "-c", SPY, str(pid)], user=NOBODY, group=NOBODY, extra_groups=[],
                              capture_output=True, text=True, timeout=60, cwd="/")
        assert proc.returncode == 0, proc.stderr
        import json

        seen = json.loads(proc.stdout)
        assert k.run("1 + 1").value == "2"  # the kernel is unharmed (signal 0 only)
    assert not [k for k, v in seen.items() if not v.startswith("refused")], seen


# -- held: protections not tested elsewhere ------------------------------------------------------

PROC_WRITES = r'''
import os, socket
def attempt():
    out = {}
    for path, value in (("/proc/sys/kernel/ns_last_pid", "100"), ("/proc/self/attr/exec", "x"),
                        ("/proc/self/map_files", None)):
        try:
            if value is None:
                d = os.listdir(path)[0]
                open(path + "/" + d, "rb").close()
            else:
                with open(path, "w") as f:
                    f.write(value)
            out[path] = "DONE"
        except OSError as exc:
            out[path] = "refused"
    for name, family, kind in (("netlink", socket.AF_NETLINK, socket.SOCK_RAW), ("packet", 17, socket.SOCK_RAW),
                               ("raw", socket.AF_INET, socket.SOCK_RAW), ("vsock", 40, socket.SOCK_STREAM)):
        try:
            socket.socket(family, kind).close()
            out[name] = "DONE"
        except OSError:
            out[name] = "refused"
    try:
        os.kill(-1, 0)
        out["kill -1"] = "DONE"  # the kernel is alone in its PID namespace: nobody to signal
    except OSError:
        out["kill -1"] = "refused"
    return out
attempt()
'''


@pytest.mark.parametrize("stage", STAGES)
def test_pid_1_cannot_set_pids_open_map_files_or_make_kernel_sockets(stage, monkeypatch):
    """Held (red team): as pid 1 of its namespace the kernel cannot write ns_last_pid,
    open /proc/self/map_files, create netlink, packet, raw or vsock sockets, or signal
    anything with kill(-1)."""
    use_stage(monkeypatch, stage)
    seen = checked(run_here(PROC_WRITES), stage)
    assert set(seen.values()) == {"refused"}, seen


def test_two_kernels_of_one_host_cannot_see_each_other():
    """Held (red team): two kernels of one host process each see one process (their own,
    pid 1), neither the other's workspace nor its loopback listener."""
    with Kernel(Policy()) as a, Kernel(Policy()) as b:
        assert a.run("open('/tmp/workspace/mark', 'w').write('a')\nimport socket\n"
                     "s = socket.socket(); s.bind(('127.0.0.1', 45678)); s.listen()").error is None
        r = b.run("import os, socket\nc = socket.socket()\n"
                  "(sorted(p for p in os.listdir('/proc') if p.isdigit()), os.path.exists('/tmp/workspace/mark'), "
                  "c.connect_ex(('127.0.0.1', 45678)) != 0)")
        assert r.error is None, r.error
        assert r.value == "(['1'], False, True)", r.value
