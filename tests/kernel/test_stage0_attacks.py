"""Red team of the native first stage (:mod:`sequester.kernel.stage0`, kernel/stage0.c):
what a cell can do around it, and the host side (failures while a kernel starts, hostile
frames, where the stage's program comes from).

Real kernels, real processes. Each "Attack" test failed against the hole it names
before the protection its docstring states went in, and fails again without it. Flows:

* the caller's (in this process): the root flow when the tests run as root;
* the ordinary-user flow (the kernel tests' ``user_flow`` fixture): in this process for
  an ordinary user; as root, a harness run as ``nobody`` (uid 65534, which exists
  everywhere: no user is created) on a world-readable copy of sequester and its runtime
  dependencies (tests/helpers/nobody_site.py).

The cache-folder tests need root (a private mount namespace whose
/var/cache/sequester/stage0 is a fresh tmpfs, so the real one is untouched). x86-64
machine code (the /proc/self/mem exploits) is skipped on other architectures.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from exploits import handoff_exec  # tests/helpers
from procs import pid_alive  # tests/helpers
from stages import REPORTED, STAGES, checked, native_available, run_here, use_stage  # tests/helpers

from sequester import Kernel, Policy, SandboxError
from sequester.guard.native_plan import Op
from sequester.kernel.stage0 import stage0_program
from sequester.sandbox.probe import namespace_support

ROOT = os.geteuid() == 0
X86_64 = platform.machine() == "x86_64"

needs_sandbox = pytest.mark.skipif(not namespace_support().available, reason="no user namespaces here")
needs_root = pytest.mark.skipif(not ROOT, reason="needs root (CI runs as root)")
needs_x86_64 = pytest.mark.skipif(not X86_64, reason="the exploit's machine code is x86-64")
pytestmark = needs_sandbox


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
    read-only (it shows the template's, covered, beneath its own /proc, /tmp, /dev/pts; of
    those only /proc and the workspace are writable, as in a kernel with a bwrap of its own),
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
    own = {"/proc", "/tmp", "/dev/shm"}  # its /dev/pts read-only, as a bwrap kernel's (terminals still open)
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
                 # a later red team: these opened for writing (loginuid took 0: host root in the audit log);
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
    from sequester.guard import namespaces
    from sequester.kernel import check

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


# -- the host side: failures while the kernel starts ---------------------------------------------


@pytest.fixture
def launched(monkeypatch):
    """Every KernelProcess the client launches in the test (and this process's children
    before it), to check that nothing of them is left."""
    from sequester.kernel import client
    from sequester.sandbox.procs import descendants

    real = client.launch_kernel
    seen = {"before": set(descendants(os.getpid())), "pids": []}

    def recording(policy, **kw):
        process = real(policy, **kw)
        seen["pids"] += process.host_pids()
        return process

    monkeypatch.setattr(client, "launch_kernel", recording)
    return seen


def assert_all_gone(launched) -> None:
    """No process of the kernels launched, and no new child of this process, is running."""
    from sequester.sandbox.procs import descendants

    left = [p for p in launched["pids"] if pid_alive(p)]
    left += [p for p in set(descendants(os.getpid())) - launched["before"] if pid_alive(p)]
    assert not left, left


def patch_plan(monkeypatch, change) -> None:
    from sequester.kernel import launch

    real = launch.plan_stage0
    monkeypatch.setattr(launch, "plan_stage0", lambda config, command: change(real(config, command)))


def test_an_oversized_plan_is_a_sandbox_error_and_leaves_nothing(monkeypatch, launched):
    """Attack (red team; host, low): the stage refuses a frame over 4 MiB right after its header and
    exits, so the host's write of the rest fails: BrokenPipeError reaches the caller, not
    SandboxError, and the stage's reason is lost. (A policy would need tens of thousands
    of allowed endpoints to get there.) Protection: the host refuses a plan over
    the stage's limit before it starts anything, and turns a write that fails into a
    SandboxError with what the kernel said."""
    use_stage(monkeypatch, "native")
    patch_plan(monkeypatch, lambda steps: [(Op.ARG, ("x" * (5 << 20),)), *steps])
    k = Kernel(Policy())
    with pytest.raises(SandboxError, match="size limit|too large|over"):
        k.start()
    assert k.process is None
    assert_all_gone(launched)


def test_a_failure_after_the_filter_is_a_sandbox_error_and_leaves_nothing(monkeypatch, launched):
    """Held: the last step fails (the cell runner's interpreter does not exist in the view)
    after the uid drop, the capability drop and the filter: the stage's own words come
    back as SandboxError and nothing of the kernel is left."""
    use_stage(monkeypatch, "native")
    missing = "/usr/bin/no-such-python"

    def retarget(steps):
        return [(op, (missing,)) if op in (Op.EXEC,) or (op is Op.ARG and args == (steps[-1][1][0],)) else (op, args)
                for op, args in steps]

    patch_plan(monkeypatch, retarget)
    k = Kernel(Policy())
    with pytest.raises(SandboxError, match=f"stage 0: execve of {missing}: No such file"):
        k.start()
    assert k.process is None
    assert_all_gone(launched)


@pytest.mark.parametrize("dropped", [(Op.SECCOMP, Op.NO_NEW_PRIVS), (Op.CLEAR_CAPS, Op.CHECK_NO_CAPS, Op.DROP_BOUNDING)])
def test_a_plan_that_skips_a_confining_step_runs_no_cell(monkeypatch, launched, dropped):
    """Held (defence in depth): were the planner to lose the filter or the capability drop,
    the host's check of the kernel's report refuses it before any cell runs."""
    use_stage(monkeypatch, "native")
    patch_plan(monkeypatch, lambda steps: [(op, args) for op, args in steps if op not in dropped])
    k = Kernel(Policy())
    with pytest.raises(SandboxError, match="not confined as required"):
        k.start()
    assert k.process is None
    assert_all_gone(launched)


@needs_root
def test_a_root_flow_plan_that_skips_the_uid_drop_runs_no_cell(monkeypatch):
    """Attack (red team; host hardening, low): the same for the uid drop of the root flow: a plan
    without SETIDS starts a kernel whose cells run as uid 0 of its namespace (the host's
    root, mapped) with no capabilities, and the host accepts it: its check reads the
    capabilities, the filter and no_new_privs, not the uid. Protection: the host
    refuses a root-flow kernel whose reported uid/gid is not nobody's."""
    use_stage(monkeypatch, "native")
    patch_plan(monkeypatch, lambda steps: [(op, args) for op, args in steps if op is not Op.SETIDS])
    k = Kernel(Policy())
    try:
        with pytest.raises(SandboxError):
            k.start()
            k.run("pass")
    finally:
        k.close()


# -- the host side: untrusted frames, without the json package ---------------------------------


def test_a_hostile_frame_is_a_protocol_error_where_json_was_never_imported():
    """Attack (red team; host, low, latent): the protocol now parses with the _json C scanner alone;
    for a bad escape or a control character it raises SystemError ("returned NULL without
    setting an exception": the scanner wants json.decoder, which only a process that
    imported json has), not ValueError, so a hostile kernel's frame escapes the
    ProtocolError handling. The client is shielded today only because other modules of
    the host import json. Protection: protocol.loads maps SystemError to ValueError
    (so _decode raises ProtocolError)."""
    code = textwrap.dedent('''
        import sys
        from sequester.kernel.protocol import MessageReader, ProtocolError
        assert "json.decoder" not in sys.modules
        results = []
        for body in (b'{"op":"x\\\\q"}', b'{"op":"\\x01"}', b'{"op":[}'):
            try:
                MessageReader(1 << 20).feed(len(body).to_bytes(4, "big") + body)
                results.append("accepted")
            except ProtocolError:
                results.append("ProtocolError")
            except BaseException as exc:
                results.append(type(exc).__name__)
        print(results)
    ''')
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(["ProtocolError"] * 3)


# -- the host side: where the program comes from -------------------------------------------------

CHOOSE = r'''
import logging, os, sys
logging.basicConfig(level=logging.WARNING, format="WARNING %(message)s")
from sequester import Kernel, Policy
from sequester.kernel.stage0 import stage0_program
def start():
    with Kernel(Policy()) as k:
        assert k.run("1 + 1").value == "2"
        print("STAGE", k.report["first_stage"], flush=True)
start()
program = stage0_program()
action = sys.argv[1]
if action == "chown":
    os.chown(program, 65534, 65534)
elif action == "symlink":
    target = program.with_name("elsewhere")
    os.rename(program, target)
    os.symlink(target, program)
if action != "none":
    start()
'''


def run_with_private_cache(tmp_path: Path, mount_options: str, action: str = "none", parent_mode: int | None = None) -> str:
    """CHOOSE in a private mount namespace whose root cache folder is a fresh tmpfs (the
    host's real cache is left alone); its output."""
    if not shutil.which("unshare"):
        pytest.skip("needs unshare(1)")
    script = tmp_path / "choose.py"
    script.write_text(CHOOSE)
    mount = f"mount -t tmpfs -o {mount_options} tmpfs /var/cache/sequester/stage0"
    if parent_mode is not None:
        mount = (f"mkdir -p /var/cache/sequester && mount -t tmpfs -o mode={parent_mode:o} tmpfs /var/cache/sequester && "
                 "mkdir -m 755 /var/cache/sequester/stage0")
    else:
        mount = "mkdir -p /var/cache/sequester/stage0 && " + mount
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                           f'{mount} && exec "$0" "$1" "$2"', sys.executable, str(script), action],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "SEQUESTER_NATIVE_STAGE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@needs_root
def test_a_noexec_cache_means_the_python_stage_with_a_warning(tmp_path):
    """Held: the build lands on a noexec mount; the stage does not run there, so kernels
    start through the Python stage and say why (without the check every start would fail
    in bwrap's execvp)."""
    if not native_available():
        pytest.skip("the native stage cannot be built here")
    out = run_with_private_cache(tmp_path, "mode=755,noexec")
    assert "STAGE python" in out and "does not run here" in out, out


@needs_root
@pytest.mark.parametrize("action", ["chown", "symlink"])
def test_a_program_swapped_for_anothers_is_not_run(tmp_path, action):
    """Held: after a first kernel through the native stage, the program is given to
    another user, or replaced by a symlink: the next kernel uses the Python stage, with a
    warning, and never the swapped file."""
    if not native_available():
        pytest.skip("the native stage cannot be built here")
    out = run_with_private_cache(tmp_path, "mode=755", action)
    assert out.count("STAGE native") == 1 and "STAGE python" in out and "changed owner or mode" in out, out


@needs_root
def test_a_cache_below_a_folder_others_can_write_is_not_used(tmp_path):
    """Attack (red team; host, low): "each folder above it ... writable by no one else" is checked for
    the world bit only: below a group-writable /var/cache/sequester (0775) the native
    stage is built and used, although the group can rename the stage's folder away and
    put another in its place between two processes' checks. Protection: the
    parents' group bit too (0o022, as for the folder itself)."""
    if not native_available():
        pytest.skip("the native stage cannot be built here")
    out = run_with_private_cache(tmp_path, "", parent_mode=0o775)
    assert "STAGE python" in out and "not private" in out, out
