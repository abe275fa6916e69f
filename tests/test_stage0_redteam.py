"""Red team of the native first stage (kernel/stage0.c) and of what a cell can do around it.

Real kernels, real processes. Each "Attack" test failed against the hole it names
before the protection its docstring states went in, and fails again without it. Flows:

* the caller's (in this process): the root flow when the tests run as root;
* the ordinary-user flow: in this process for an ordinary user; as root, a harness run
  as ``nobody`` (uid 65534, which exists everywhere: no user is created) on a
  world-readable copy of sequester and its runtime dependencies (like test_unprivileged).

x86-64 machine code (the /proc/self/mem exploits) is skipped on other architectures.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import pytest

from sequester import Kernel, Policy
from sequester.kernel.stage0 import stage0_program
from sequester.sandbox.probe import namespace_support

from nobody_site import nobody_site  # tests/helpers
from stages import REPORTED, STAGES, native_available, run_here, set_stage, stage_env, use_stage  # tests/helpers

ROOT = os.geteuid() == 0
NOBODY = 65534
SYSTEM_PYTHON = Path("/usr/bin/python3")
X86_64 = platform.machine() == "x86_64"

needs_sandbox = pytest.mark.skipif(not namespace_support().available, reason="no user namespaces here")
needs_root = pytest.mark.skipif(not ROOT, reason="needs root (CI runs as root)")
needs_x86_64 = pytest.mark.skipif(not X86_64, reason="the exploit's machine code is x86-64")
pytestmark = needs_sandbox


# -- the ordinary-user flow ----------------------------------------------------------------

HARNESS = r'''
import json, os, sys
request = json.load(sys.stdin)
os.environ["SEQUESTER_NATIVE_STAGE"] = "0" if request["stage"] == "python" else "1"
os.environ["SEQUESTER_VIEW_TEMPLATE"] = "1" if request["stage"] == "template" else "0"
from sequester import Kernel, Policy
from sequester.kernel.stage0 import stage0_program
program = stage0_program()
with Kernel(Policy()) as k:
    code = request["code"].replace("@PROGRAM@", str(program))
    r = k.run(code, timeout=30)
    print(json.dumps({"stage": k.report["first_stage"], "view": k.report.get("view"), "value": r.value, "stdout": r.stdout, "uid": os.getuid(),
                      "error": None if r.error is None else {"type": r.error.type, "message": r.error.message}}))
'''


@pytest.fixture(scope="module")
def user_flow():
    """Runs ``code`` (``@PROGRAM@``: the caller's native-stage program) in a kernel of an
    ordinary caller, through ``stage``; the harness's JSON."""
    if not ROOT:
        def here(code: str, stage: str) -> dict:
            set_stage(stage)
            try:
                return run_here(code.replace("@PROGRAM@", str(stage0_program())))
            finally:
                for name in stage_env(stage):
                    os.environ.pop(name, None)
        yield here
        return
    if not SYSTEM_PYTHON.exists():
        pytest.skip("as root the user flow runs on /usr/bin/python3, which is missing")
    with nobody_site() as run:
        def as_nobody(code: str, stage: str) -> dict:
            proc = run(HARNESS, json.dumps({"code": code, "stage": stage}))
            assert proc.returncode == 0, proc.stderr[-3000:]
            out = json.loads(proc.stdout.strip().splitlines()[-1])
            assert out["uid"] == NOBODY
            return out

        yield as_nobody


def checked(out: dict, stage: str) -> object:
    if stage != "python" and out["stage"] != "native":
        pytest.skip("the native stage is not used in this flow here")
    assert (out["stage"], out["view"]) == REPORTED[stage]
    assert out["error"] is None, out["error"]
    return eval(out["value"])  # noqa: S307 - the tests' own probe's repr


# -- a cell's own memory: /proc/self/mem -----------------------------------------------------

WRITE_OWN_CODE = r'''
import os
def attempt():
    start = None
    for line in open("/proc/self/maps"):
        fields = line.split()
        if fields[1] == "r-xp":
            start = int(fields[0].split("-")[0], 16)
            break
    try:
        fd = os.open("/proc/self/mem", os.O_RDWR)
    except OSError as exc:
        return "refused: " + exc.strerror
    try:
        same = os.pread(fd, 16, start)
        # The same bytes back: harmless, but a write into code (a /dev/null in its place
        # reads nothing: that is no write).
        if len(same) == 16 and os.pwrite(fd, same, start) == 16:
            return "WROTE"
        return "refused: nothing there"
    except OSError as exc:
        return "refused: " + exc.strerror
    finally:
        os.close(fd)
attempt()
'''


@pytest.mark.parametrize("stage", STAGES)
def test_a_cell_cannot_write_its_own_code_through_proc_self_mem(stage, monkeypatch):
    """Attack (red team; both stages, both flows): the whole two-stage design rests on a cell having
    no way to native code (no ctypes, no exec-capable writable file, "Python code cannot
    choose where memory is mapped"). /proc/self/mem lets a cell write machine code into
    its own text. Protection: the kernel's first stage covers /proc/<pid>/mem and
    /proc/<pid>/task in its own mount namespace (a bind of /dev/null, an empty read-only
    tmpfs), so the write is refused."""
    use_stage(monkeypatch, stage)
    assert checked(run_here(WRITE_OWN_CODE), stage).startswith("refused")


# Writes machine code over os.getloadavg's C function (found through its PyMethodDef,
# read from /proc/self/mem) and calls it: it maps HANDOFF_ADDRESS, copies "/bin/cat"
# there and execve-s cat /proc/self/status, the one execve the filter lets through.
HANDOFF_EXEC_CODE = bytes.fromhex(
    "48bf0000000000300000be00100000ba0300000041ba3200000049c7c0ffffffff4531c9b8090000000f05488d3544000000"
    "48bf0000000000300000b909000000f3a431d252488d053200000050488d0521000000504889e648bf0000000000300000b8"
    "3b0000000f05bf62000000b83c0000000f052f62696e2f636174002f70726f632f73656c662f73746174757300")


def handoff_exec(mem_path: str = '"/proc/self/mem"') -> str:
    """A cell that writes HANDOFF_EXEC_CODE over os.getloadavg's C function through the
    mem file ``mem_path`` names (a Python expression), then calls it."""
    return f'''
import os
mem = open({mem_path}, "r+b", buffering=0)
def read(address, n):
    mem.seek(address)
    return mem.read(n)
method_def = int.from_bytes(read(id(os.getloadavg) + 16, 8), "little")
function = int.from_bytes(read(method_def + 8, 8), "little")
mem.seek(function)
mem.write({HANDOFF_EXEC_CODE!r})
mem.close()
os.getloadavg()
'''


HANDOFF_EXEC = handoff_exec()


@needs_x86_64
@pytest.mark.parametrize("stage", STAGES)
def test_a_cell_cannot_make_the_handoff_execve_itself(stage, monkeypatch):
    """Attack (red team; both stages, both flows): the filter lets execve through when its path is at
    HANDOFF_ADDRESS; with machine code (see above) a cell maps that page itself and execs
    any program of the view (here /bin/cat: the kernel process becomes cat). Protection
    wanted: no way to native code (above); and the cell runner could not then make the
    handoff at all if the filter it runs under refused every execve (a second filter,
    stacked by the cell runner at start, or a first stage that never needs execve)."""
    use_stage(monkeypatch, stage)
    with Kernel(Policy()) as k:
        assert k.report["first_stage"] == REPORTED[stage][0]
        r = k.run(HANDOFF_EXEC, timeout=30)
    assert "Name:\tcat" not in r.stdout, "the cell execve-d /bin/cat through the handoff address:\n" + r.stdout[:400]
    assert r.error is None or r.error.type != "KernelDied", r.error


# -- the sandbox's init (bwrap's pid 1): same uid as the cell in the ordinary-user flow ----------

WRITE_INIT = r'''
import os
def attempt():
    out = {}
    if os.getpid() == 1:
        return {"init": "none: the kernel is pid 1 (its own memory: the /proc/self/mem test)"}
    try:
        out["syscall"] = "READ " + open("/proc/1/syscall").read().strip()
    except OSError as exc:
        out["syscall"] = "refused: " + exc.strerror
    try:
        fd = os.open("/proc/1/mem", os.O_RDWR)
    except OSError as exc:
        out["mem"] = "refused: " + exc.strerror
        return out
    try:
        start = next(int(l.split("-")[0], 16) for l in open("/proc/1/maps") if l.split()[1] == "r-xp")
        same = os.pread(fd, 16, start)
        # The same bytes back: a write into init's code (reading nothing is no write).
        out["mem"] = "WROTE" if len(same) == 16 and os.pwrite(fd, same, start) == 16 else "refused: nothing there"
    except OSError as exc:
        out["mem"] = "refused: " + exc.strerror
    finally:
        os.close(fd)
    return out
attempt()
'''


@pytest.mark.parametrize("stage", STAGES)
def test_a_cell_cannot_write_the_memory_of_the_sandboxs_init(stage, user_flow):
    """Attack (red team; both stages, ordinary-user flow; the root flow holds: init is uid 0 there, the
    cell nobody): bwrap's init is pid 1 of the kernel's PID namespace, runs as the same
    uid, has no capabilities and NO seccomp filter. A cell writes its code through
    /proc/1/mem; it runs when the kernel exits (a /bin/sh as pid 1 with Seccomp: 0 was
    shown). Protection: no same-uid, unfiltered process beside the kernel
    (``bwrap --as-pid-1`` for kernels: the kernel is the namespace's only process)."""
    seen = checked(user_flow(WRITE_INIT, stage), stage)
    if "init" not in seen:
        assert seen["mem"].startswith("refused"), seen
        assert seen["syscall"].startswith("refused"), seen


EXEC_MAP_VIA_INIT = r'''
import mmap, os
def attempt():
    out = {}
    for folder in ("/proc/1/root/tmp", "/proc/1/root/dev/shm", "/proc/1/root/var/tmp", "/proc/1/cwd"):
        path = folder + "/planted.so"
        try:
            with open(path, "wb") as f:
                f.write(b"\x7fELF" + bytes(8188))
            with open(path, "rb") as f:
                mmap.mmap(f.fileno(), 4096, prot=mmap.PROT_READ | mmap.PROT_EXEC).close()
            out[folder] = "MAPPED"
        except OSError as exc:
            out[folder] = "refused: " + exc.strerror
    return out
attempt()
'''


@pytest.mark.parametrize("stage", STAGES)
def test_no_folder_a_cell_reaches_is_writable_and_exec_capable(stage, user_flow):
    """Attack (red team; both stages, ordinary-user flow): the kernel's own /tmp and /dev/shm are
    noexec, but bwrap's (exec-capable, writable by the caller's uid) stay reachable
    through /proc/1/root; a library written there is loaded with the audit hook off (a
    copy of _asyncio was, and with it any library a cell carries, _ctypes included).
    Protection: as above (no pid 1 beside the kernel, so no process in bwrap's mount
    namespace)."""
    seen = checked(user_flow(EXEC_MAP_VIA_INIT, stage), stage)
    assert not [k for k, v in seen.items() if v == "MAPPED"], seen


# -- the native stage's program --------------------------------------------------------------

STAGE0_REACH = r'''
import os
def attempt():
    out = {}
    for path in ("/tmp/.sequester-stage0", "/proc/1/root/tmp/.sequester-stage0", "/proc/self/root/tmp/.sequester-stage0",
                 "@PROGRAM@", os.path.dirname(os.path.dirname("@PROGRAM@"))):
        try:
            if os.path.isdir(path):
                os.listdir(path)
            else:
                open(path, "rb").read(4)
            out[path] = "REACHED"
        except OSError as exc:
            out[path] = "refused: " + exc.strerror
    return out
attempt()
'''


@pytest.mark.parametrize("stage", ["template", "native"])
def test_the_native_stage_program_is_out_of_a_root_flow_cells_reach(monkeypatch, stage):
    """Attack (red team; root flow, low): the program is covered at /tmp/.sequester-stage0, but its
    host copy (/var/cache/sequester/stage0/<hash>/stage0, 0755 in 0755 folders) is in the
    view with /var: a cell lists the cache and reads (and maps executable) the program
    that ran with the bootstrap capabilities. Protection: the cache folder is 0700
    (bwrap binds the program as root, before the uid drop)."""
    if not ROOT:
        pytest.skip("the root flow: as an ordinary user the cache is in the (hidden) home")
    if not native_available():
        pytest.skip("the native stage cannot be built here")
    program = stage0_program()
    use_stage(monkeypatch, stage)
    seen = checked(run_here(STAGE0_REACH.replace("@PROGRAM@", str(program))), stage)
    assert not [k for k, v in seen.items() if v == "REACHED"], seen


@pytest.mark.parametrize("stage", ["template", "native"])
def test_the_native_stage_program_is_out_of_an_ordinary_users_cells_reach(user_flow, stage):
    """Attack (red team; ordinary-user flow, low): covered in the kernel's mount namespace, but
    /proc/1/root (bwrap's view, see above) still shows /tmp/.sequester-stage0. Protection
    wanted: as for the init's memory (--as-pid-1)."""
    seen = checked(user_flow(STAGE0_REACH, stage), stage)
    assert not [k for k, v in seen.items() if v == "REACHED"], seen


# -- what a cell sees of its process: the same under either stage -----------------------------

STATE = r'''
import os, resource, sys
def state():
    status = dict(l.rstrip("\n").split(":\t", 1) for l in open("/proc/self/status") if ":\t" in l)
    fds = {}
    for fd in sorted(os.listdir("/proc/self/fd"), key=int):
        try:
            fds[fd] = os.readlink("/proc/self/fd/" + fd).split(":")[0]
        except OSError:
            pass
    limits = {n: resource.getrlimit(getattr(resource, n)) for n in dir(resource) if n.startswith("RLIMIT_")}
    # The stage's own bind, covered by the kernel's /tmp, is left out: it is the one difference.
    mounts = sorted((l.split()[4], l.split()[5]) for l in open("/proc/self/mountinfo")
                    if l.split()[4] != "/tmp/.sequester-stage0")
    old = os.umask(0o22); os.umask(old)
    handoff = [l for l in open("/proc/self/maps") if l.startswith("3000000000")]
    return {"status": {k: status[k] for k in ("Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb",
                                              "NoNewPrivs", "Seccomp", "SigBlk", "SigIgn", "Threads")},
            "fds": sorted(fds.values()), "limits": limits, "env": dict(os.environ), "cwd": os.getcwd(), "umask": old,
            "flags": str(sys.flags), "path": sys.path, "argv": sys.argv[:-1] if sys.argv[-1].startswith("T") else sys.argv,
            "mounts": mounts, "handoff": handoff, "tmp": sorted(os.listdir("/tmp")),
            "sysctl": [open(p).read().strip() for p in ("/proc/sys/user/max_user_namespaces",
                                                          "/proc/sys/net/ipv4/ip_unprivileged_port_start")]}
state()
'''


def test_a_cell_sees_the_same_process_under_either_stage(monkeypatch):
    """Held: identity, capabilities, filter, signal masks, descriptors, limits,
    environment, working folder, umask, interpreter flags, sys.path, mounts (flags and
    places), sysctls: identical through the native and the Python stage; argv differs
    only in the stage-two configuration (the Python stage's carries its timing) and the
    native stage's timing argument; nothing is mapped at HANDOFF_ADDRESS. A view
    template's kernel is the same but tighter: it holds only the descriptors the host
    sent it (bwrap passes each pipe twice), every mount it did not make itself is
    read-only (it shows the template's, covered, beneath its own /proc, /tmp, /dev/pts),
    and its own namespace forbids nested user namespaces in either flow."""
    if not native_available():
        pytest.skip("the native stage cannot be built here")
    seen = {}
    for stage in STAGES:
        use_stage(monkeypatch, stage)
        seen[stage] = checked(run_here(STATE), stage)
    template, native, python = seen["template"], seen["native"], seen["python"]
    for state in seen.values():
        assert state["handoff"] == []
        assert "workspace" in state["tmp"] and ".sequester-stage0" not in state["tmp"]
        state["argv"] = state["argv"][:-1]  # the stage-two configuration (its timing differs)
    for key in native:
        assert native[key] == python[key], key
    for key in set(native) - {"fds", "mounts", "sysctl"}:
        assert template[key] == native[key], key
    # No user namespace below its own (an ordinary caller's bwrap forbids them from the
    # namespace above, which reads as the default here), and every port bindable.
    assert template["sysctl"] == ["0", "0"]
    assert template["fds"] == ["/dev/null", "pipe", "pipe", "pipe", "pipe"]  # stdin, in, out, stdout, stderr
    own = {"/proc", "/tmp", "/dev/shm", "/dev/pts"}
    assert {p for p, flags in template["mounts"] if flags.startswith("rw")} == own
    # The same places; its own /proc always gets bwrap's read-only covers (which an
    # ordinary caller's bwrap leaves out).
    points, native_points = {p for p, _ in template["mounts"]}, {p for p, _ in native["mounts"]}
    assert native_points <= points <= native_points | {"/proc/irq", "/proc/bus"}


SYSTEM_WRITES = r'''
import os, resource
def attempt():
    out = {}
    for path in ("/proc/sys/user/max_user_namespaces", "/proc/sys/net/ipv4/ip_unprivileged_port_start",
                 "/proc/sys/kernel/core_pattern", "/proc/sys/net/ipv4/ip_forward", "/proc/self/oom_score_adj",
                 "/proc/self/uid_map", "/proc/self/setgroups", "/proc/self/attr/current",
                 # round 3: these opened for writing (loginuid took 0: host root in the audit log);
                 # the write lock refuses every file outside the workspace and the devices
                 "/proc/self/loginuid", "/proc/self/clear_refs", "/proc/self/coredump_filter",
                 "/proc/self/timerslack_ns", "/proc/self/comm", "/proc/self/autogroup"):
        try:
            with open(path, "w") as f:
                f.write("1000" if "oom" not in path else "-1000")
            out[path] = "WROTE"
        except OSError as exc:
            out[path] = "refused"
    for name in ("RLIMIT_AS", "RLIMIT_NPROC", "RLIMIT_FSIZE", "RLIMIT_CORE"):
        limit = getattr(resource, name)
        soft, hard = resource.getrlimit(limit)
        try:
            resource.setrlimit(limit, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            out[name] = "RAISED"
        except (OSError, ValueError):
            out[name] = "refused"
    return out
attempt()
'''


@pytest.mark.parametrize("stage", STAGES)
def test_a_cell_cannot_lift_its_limits_or_sysctls(stage, monkeypatch):
    """Held: the native stage's limits are hard limits and its sysctl writes stick: a
    cell can neither raise an rlimit nor write the sysctls the stage set (nor others, nor
    any file of its own below /proc: the write lock)."""
    use_stage(monkeypatch, stage)
    seen = checked(run_here(SYSTEM_WRITES), stage)
    assert set(seen.values()) == {"refused"}, seen


@pytest.mark.parametrize("stage", STAGES)
def test_sequester_check_sees_a_writable_own_memory(stage, monkeypatch):
    """``sequester check``'s probe of the kernel's own memory can fail: with the two mounts
    that cover /proc/self/mem and /proc/self/task left out of the plan and no write lock,
    it reports the memory writable; with either, refused or /dev/null."""
    from sequester.kernel import check
    from sequester.guard import namespaces

    use_stage(monkeypatch, stage)
    with Kernel(Policy()) as k:
        assert check._own_memory(k).passed
    real = namespaces.plan_workspace
    monkeypatch.setattr("sequester.kernel.bootstrap._landlock_abi", lambda: 0)
    with Kernel(Policy()) as k:
        finding = check._own_memory(k)
    # The mounts alone: /proc/self/mem is /dev/null, but a thread's /proc/<tid>/mem is not covered.
    assert not finding.passed and "/proc/self/mem: reads as /dev/null" in finding.evidence, finding
    monkeypatch.setattr("sequester.kernel.bootstrap.plan_workspace", lambda *a, **kw: tuple(
        step for step in real(*a, **kw) if step.target not in (namespaces.SELF_MEM, namespaces.SELF_TASKS)))
    with Kernel(Policy()) as k:
        finding = check._own_memory(k)
    assert not finding.passed and "writable" in finding.evidence, finding
