"""Red team of the native first stage (kernel/stage0.c), the host side: failures while a
kernel starts, hostile frames, and where the stage's program comes from.

Real kernels, real processes. Each "Attack" test failed against the hole it names
before the protection its docstring states went in, and fails again without it. Flows:

the caller's (in this process); the cache-folder tests need root (a private mount
namespace whose /var/cache/sequester/stage0 is a fresh tmpfs, so the real one is untouched).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sequester import Kernel, Policy, SandboxError
from sequester.guard.native_plan import Op
from sequester.sandbox.probe import namespace_support

from procs import pid_alive  # tests/helpers
from stages import native_available, use_stage  # tests/helpers

ROOT = os.geteuid() == 0

needs_sandbox = pytest.mark.skipif(not namespace_support().available, reason="no user namespaces here")
needs_root = pytest.mark.skipif(not ROOT, reason="needs root (CI runs as root)")
pytestmark = needs_sandbox


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
