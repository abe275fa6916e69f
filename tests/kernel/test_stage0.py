"""The native first stage (:mod:`sequester.kernel.stage0`): its plan (pure), its executor (the real C program, run on the
host with real system calls) and kernels started through it, side by side with the
Python stage it replaces on the start path."""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sequester import Kernel, Limits, Policy, SandboxError
from sequester.guard import seccomp
from sequester.guard.handoff import HANDOFF_ADDRESS
from sequester.guard.native_plan import NativePlanError, Op, encode_plan, plan_stage0
from sequester.kernel import stage0 as stage0_module
from sequester.kernel.protocol import loads
from sequester.kernel.stage0 import build_stage0, runs_here, stage0_program
from sequester.kernel.launch import STAGE0_IN_VIEW, bootstrap_config
from sequester.sandbox.probe import namespace_support
from sequester.policy import Isolation

needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler here")
needs_sandbox = pytest.mark.skipif(not namespace_support().available, reason="no user namespaces here")
RUNNER = ["/usr/bin/python3", "-c", "pass"]


def config(**kw):
    return bootstrap_config(Policy(), Isolation.SANDBOX, **kw)


def codes(steps):
    return [op for op, _ in steps]


# -- the plan (pure) ------------------------------------------------------------------------


def test_the_plan_keeps_the_python_stages_order():
    steps = plan_stage0(config(root_flow=True, bridge={"control_fd": 9, "listeners": []}), RUNNER)
    order = codes(steps)
    # Namespaces and workspace first, the filter right before the arguments and the exec.
    assert order[0] is Op.UNSHARE and order[-1] is Op.EXEC
    first = {op: order.index(op) for op in Op if op in order}
    assert first[Op.MOUNT] < first[Op.CHDIR] < first[Op.LOOPBACK_UP] < first[Op.RLIMIT]
    assert first[Op.RLIMIT] < first[Op.CHOWN] < first[Op.DROP_BOUNDING] < first[Op.SETIDS] < first[Op.CLEAR_CAPS]
    assert first[Op.CLEAR_CAPS] < first[Op.CHECK_NO_CAPS] < first[Op.NO_NEW_PRIVS] < first[Op.SECCOMP] < first[Op.ARG]
    writes = [args for op, args in steps if op is Op.WRITE]
    assert ("/proc/sys/user/max_user_namespaces", "0") in writes  # root flow: no nested user namespaces
    assert ("/proc/sys/net/ipv4/ip_unprivileged_port_start", "0") in writes
    assert [args for op, args in steps if op is Op.SETIDS] == [(65534, 65534)]
    assert [args[0] for op, args in steps if op is Op.ARG] == RUNNER and steps[-1][1] == (RUNNER[0],)


def test_the_thread_cap_counts_the_stage_and_the_bridge():
    limits = Limits(max_threads=7)
    plain = bootstrap_config(Policy(limits=limits), Isolation.SANDBOX)
    bridged = bootstrap_config(Policy(limits=limits), Isolation.SANDBOX, bridge={"control_fd": 9, "listeners": []})
    nproc = {name: [a for op, a in plan_stage0(c, RUNNER) if op is Op.RLIMIT and a[0] == 6][0][1]
             for name, c in (("plain", plain), ("bridged", bridged))}
    assert nproc == {"plain": 8, "bridged": 9}


def test_an_ordinary_callers_plan_drops_capabilities_but_changes_no_uid():
    order = codes(plan_stage0(config(), RUNNER))
    assert Op.SETIDS not in order and Op.CHOWN not in order
    assert Op.DROP_BOUNDING in order and Op.CLEAR_CAPS in order and Op.CHECK_NO_CAPS in order


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(mode="guard"), "sandboxed kernels only"),
    (lambda c: c.update(landlock={"read": []}), "Landlock"),
    (lambda c: c.update(ctypes_fd=5), "ctypes"),
    (lambda c: c["seccomp"].update(bpf=b"1234567"), "8-byte"),
])
def test_what_the_native_stage_does_not_do_is_refused(change, message):
    cfg = config()
    change(cfg)
    with pytest.raises(NativePlanError, match=message):
        plan_stage0(cfg, RUNNER)


def test_the_encoding_is_what_the_c_side_reads():
    frame = encode_plan([(Op.MOUNT, (None, "/t", "tmpfs", 6, "size=1")), (Op.SECCOMP, (b"\0" * 8,))])
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4
    body = frame[4:]
    assert body[:8] == (2).to_bytes(4, "little") + (5).to_bytes(4, "little")
    assert body[8:12] == b"\xff\xff\xff\xff"  # NULL
    assert body[12:18] == (2).to_bytes(4, "little") + b"/t"
    with pytest.raises(NativePlanError, match="NUL"):
        encode_plan([(Op.CHDIR, ("/a\0b",))])
    with pytest.raises(NativePlanError, match="negative"):
        encode_plan([(Op.RLIMIT, (9, -1))])


# -- the executor (the C program itself) -----------------------------------------------------


@pytest.fixture(scope="module")
def program():
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here")
    found = stage0_program()
    if found is None:
        pytest.skip("the native stage is switched off here")
    return found


def run_plan(program: Path, frame: bytes | None, *, timeout: float = 30) -> tuple[int, dict | None, str]:
    """Run the native stage on the host with ``frame`` on its input; its exit status, the
    message it sent (if any) and its standard output."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    proc = subprocess.Popen([str(program), str(in_r), str(out_w)], pass_fds=(in_r, out_w), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    os.close(in_r)
    os.close(out_w)
    try:
        if frame is not None:
            os.write(in_w, frame)
        os.close(in_w)
        stdout, _ = proc.communicate(timeout=timeout)
        ready, _, _ = select.select([out_r], [], [], 0)
        data = os.read(out_r, 1 << 16) if ready else b""
    finally:
        os.close(out_r)
    message = loads(data[4:].decode()) if len(data) > 4 else None
    return proc.returncode, message, stdout.decode()


def runner_plan(code: str, *, seccomp_first: bool = True) -> bytes:
    steps = [(Op.NO_NEW_PRIVS, ())]
    if seccomp_first:
        steps.append((Op.SECCOMP, (seccomp.compile_filter(),)))
    steps += [(Op.ARG, (a,)) for a in (sys.executable, "-S", "-c", code)] + [(Op.EXEC, (sys.executable,))]
    return encode_plan(steps)


def test_the_program_is_built_once_and_is_private(program):
    st = program.stat()
    assert st.st_uid == os.getuid() and not st.st_mode & 0o022 and runs_here(program)
    assert stage0_program() == program


def test_under_the_filter_the_handoff_is_the_only_execve(program):
    code = ("import os\ntry:\n os.execv('/bin/true', ['true'])\nexcept OSError as e:\n print('refused', e.errno)\n"
            f"print(open('/proc/self/maps').read().count('{HANDOFF_ADDRESS:x}'))")
    status, message, out = run_plan(program, runner_plan(code))
    assert (status, message) == (0, None)
    # The cell runner's image has nothing at the handoff address: it cannot make the one
    # execve the filter lets through.
    assert out.split() == ["refused", "1", "0"]


def test_control_without_the_handoff_page_the_filter_refuses_the_runner_itself(program, tmp_path):
    # The same filter loaded by a plain execve (bwrap's --seccomp would do this): the
    # runner never starts. This is why the stage names the path at HANDOFF_ADDRESS.
    probe = subprocess.run([sys.executable, "-c", (
        "import ctypes, sys\nfrom sequester.guard import seccomp\n"
        "seccomp.load_filter(seccomp.compile_filter(), seccomp.syscall_number('seccomp'))\n"
        "import os\ntry:\n os.execv(sys.executable, [sys.executable, '-c', 'print(1)'])\n"
        "except OSError as e:\n print('refused', e.errno)\n")], capture_output=True, text=True, timeout=30)
    assert probe.stdout.split() == ["refused", "1"], probe.stderr


@pytest.mark.parametrize("frame, said", [
    (b"\0\0\0\x03abc", "truncated"),                                   # an op's header ends early
    ((13).to_bytes(4, "big") + (7).to_bytes(4, "little") + (1).to_bytes(4, "little") + (100).to_bytes(4, "little") + b"x",
     "truncated"),                                                      # an argument ends early
    ((8).to_bytes(4, "big") + (99).to_bytes(4, "little") + (0).to_bytes(4, "little"), "unknown op 99"),
    ((5 << 20).to_bytes(4, "big"), "size limit"),
    ((8).to_bytes(4, "big") + (7).to_bytes(4, "little") + (65).to_bytes(4, "little"), "too many arguments"),
    (encode_plan([(Op.NO_NEW_PRIVS, ())]), "without an exec"),
    (encode_plan([(Op.RLIMIT, (9, "12x"))]), "bad number"),
])
def test_a_malformed_plan_fails_closed_with_a_message(program, frame, said):
    status, message, out = run_plan(program, frame)
    assert status == 70 and message is not None and message["op"] == "failed" and said in message["error"], message
    assert out == ""


def test_a_failing_step_names_itself_and_nothing_after_it_runs(program, tmp_path):
    marker = tmp_path / "after"
    frame = encode_plan([(Op.MOUNT, ("tmpfs", str(tmp_path), "tmpfs", 0, None)) if os.getuid() else
                         (Op.CHDIR, (str(tmp_path / "missing"),)),
                         (Op.MKDIR, (str(marker), 0o755)), (Op.ARG, ("/bin/true",)), (Op.EXEC, ("/bin/true",))])
    status, message, _ = run_plan(program, frame)
    assert status == 70 and ("mount" in message["error"] or "chdir" in message["error"]), message
    assert not marker.exists()


def test_the_host_going_away_before_the_plan_ends_the_stage_quietly(program):
    status, message, _ = run_plan(program, None)
    assert (status, message) == (0, None)


def test_a_mkdir_is_not_narrowed_by_the_umask(program, tmp_path):
    made = tmp_path / "d"
    frame = encode_plan([(Op.MKDIR, (str(made), 0o1777)), (Op.ARG, ("/bin/true",)), (Op.EXEC, ("/bin/true",))])
    old = os.umask(0o077)
    try:
        # Without the filter the exec is a plain one (the page is mapped either way).
        status, message, _ = run_plan(program, frame)
    finally:
        os.umask(old)
    assert (status, message) == (0, None) and made.stat().st_mode & 0o7777 == 0o1777


# -- choosing the stage ---------------------------------------------------------------------


def test_no_compiler_or_a_switch_means_the_python_stage(monkeypatch):
    monkeypatch.setenv("SEQUESTER_NATIVE_STAGE", "0")
    assert stage0_program() is None
    monkeypatch.setenv("SEQUESTER_NATIVE_STAGE", "1")
    monkeypatch.setattr(stage0_module, "_compiler", lambda: None)
    stage0_module._cached_program.cache_clear()
    try:
        assert stage0_program() is None
    finally:
        stage0_module._cached_program.cache_clear()


def test_a_folder_others_can_write_is_not_used(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    assert not stage0_module._private_folder(shared)
    mine = tmp_path / "mine"
    assert stage0_module._private_folder(mine)


@needs_cc
def test_a_program_that_became_writable_by_others_is_not_run(tmp_path, monkeypatch):
    built = build_stage0(tmp_path, shutil.which("cc") or shutil.which("gcc"))
    assert runs_here(built)
    monkeypatch.setattr(stage0_module, "_cached_program", lambda: built)
    assert stage0_program() == built
    built.chmod(0o775)
    assert stage0_program() is None


def test_a_program_that_does_not_run_here_is_not_used(tmp_path):
    fake = tmp_path / "stage0"
    fake.write_text("#!/bin/sh\nexit 2\n")
    fake.chmod(0o755)
    assert not runs_here(fake)  # not the stage's usage line
    fake.chmod(0o644)
    assert not runs_here(fake)  # not executable (as on a noexec mount)


# -- kernels through either stage ------------------------------------------------------------


@needs_sandbox
@pytest.mark.parametrize("stage", ["native", "python"])
def test_both_stages_confine_alike(stage, monkeypatch, program):
    monkeypatch.setenv("SEQUESTER_NATIVE_STAGE", "1" if stage == "native" else "0")
    with Kernel(Policy(limits=Limits(max_threads=6, memory_mb=512, workspace_mb=16))) as k:
        assert k.report["first_stage"] == stage
        seen = k.run(
            "import os, resource\n"
            "status = dict(l.split(':', 1) for l in open('/proc/self/status'))\n"
            "mounts = {l.split()[4]: l.split()[5] for l in open('/proc/self/mountinfo')}\n"
            "fds = set()\n"
            "for f in os.listdir('/proc/self/fd'):\n"
            "    try:\n        fds.add(os.readlink('/proc/self/fd/' + f).split(':')[0])\n"
            "    except OSError:\n        pass\n"
            "maps = open('/proc/self/maps').read()\n"
            f"({{k: status[k].strip() for k in ('Seccomp', 'NoNewPrivs', 'CapEff', 'CapBnd', 'CapAmb')}},"
            " [resource.getrlimit(r)[0] for r in (resource.RLIMIT_AS, resource.RLIMIT_NPROC, resource.RLIMIT_CORE)],"
            " 'noexec' in mounts['/tmp'] and 'noexec' in mounts['/dev/shm'], 'ro' in mounts['/dev'].split(','),"
            f" os.listdir('/tmp'), os.path.exists({str(STAGE0_IN_VIEW)!r}), sorted(fds),"
            f" '{HANDOFF_ADDRESS:x}' in maps, os.getcwd(), open('/proc/sys/user/max_user_namespaces').read().strip())")
        assert seen.error is None, seen.error
        status, limits, noexec, dev_ro, tmp, stage0_visible, fds, handoff_mapped, cwd, userns = eval(seen.value)
        assert status == {"Seccomp": "2", "NoNewPrivs": "1", "CapEff": "0" * 16, "CapBnd": "0" * 16, "CapAmb": "0" * 16}
        assert limits == [512 << 20, 6 + 1, 0]
        # /tmp: the workspace (and whatever of the view is bound below /tmp: a checkout
        # in /tmp holds sequester's own source), never the native stage's program.
        assert noexec and dev_ro and "workspace" in tmp and ".sequester-stage0" not in tmp
        assert not stage0_visible and not handoff_mapped
        assert cwd == "/tmp/workspace" and fds == ["/dev/null", "pipe"]  # no host file, folder or socket
        if os.getuid() == 0:
            assert userns == "0" and k.report["uid"] == 65534
        assert k.run("import subprocess; subprocess.run(['true'])").error.type == "PermissionError"
        assert k.run("import os; os.execv('/bin/true', ['true'])").error.type == "PermissionError"


@needs_sandbox
def test_a_native_plan_the_sandbox_refuses_is_a_sandbox_error_and_leaves_nothing(monkeypatch, program):
    # A workspace larger than the address space it may use is fine; a plan step that the
    # kernel refuses (an invalid tmpfs option) must stop the start with the stage's words.
    from sequester.guard import namespaces

    real = namespaces.plan_workspace

    def broken(size, workspace, keep=(), own_proc=None):
        steps = list(real(size, workspace, keep, own_proc))
        at = next(i for i, step in enumerate(steps) if step.target == namespaces.STAGING)
        steps[at] = namespaces.MountStep("mount", steps[at].target, source="tmpfs", fstype="tmpfs",
                                         flags=steps[at].flags, data="size=nonsense")
        return tuple(steps)

    monkeypatch.setattr("sequester.kernel.bootstrap.plan_workspace", broken)
    k = Kernel(Policy())
    with pytest.raises(SandboxError, match="stage 0: mount /run"):
        k.start()
    assert k.process is None
