"""View templates (:mod:`sequester.kernel.template`): a policy's view assembled once, each
kernel a child of its keeper. The plan's template steps (pure), then attacks between two
kernels of one template, as root and as an ordinary user (nobody), then the template's
life: a failed kernel, retirement, its keeper's death, a fork, many kernels at once."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from sequester import Kernel, Limits, Policy, SandboxError
from sequester.guard.namespaces import SELF_MEM, STAGING, plan_own_proc, plan_workspace
from sequester.guard.native_plan import Op, plan_stage0
from sequester.policy import Isolation
from sequester.kernel.launch import bootstrap_config
from sequester.sandbox.probe import namespace_support

from nobody_site import SYSTEM_PYTHON, nobody_site  # tests/helpers
from procs import wait_until  # tests/helpers
from stages import native_available  # tests/helpers

ROOT = os.geteuid() == 0
needs_templates = pytest.mark.skipif(not namespace_support().available or not native_available(),
                                     reason="view templates need user namespaces and the native stage")
RUNNER = ["/usr/bin/python3", "-c", "pass"]


def codes(steps):
    return [op for op, _ in steps]


# -- the plan (pure) ------------------------------------------------------------------------


def test_a_template_kernel_mounts_its_own_proc_and_pts_before_anything_reads_them():
    steps = plan_workspace(1 << 20, Path("/tmp/workspace"), own_proc=(Path("/proc/irq"), Path("/proc/bus")))
    targets = [(s.target, s.source) for s in steps]
    assert steps[0].target == Path("/") and steps[0].source is None  # private propagation first
    assert targets[1] == (Path("/proc"), "proc")
    assert (Path("/dev/pts"), "devpts") in targets
    own_end = len(plan_own_proc((Path("/proc/irq"), Path("/proc/bus")))) + 1
    # Its own /proc exists before /proc/self/mem is covered, and before the workspace.
    assert own_end <= [s.target for s in steps].index(STAGING)
    assert own_end <= [s.target for s in steps].index(SELF_MEM)
    covers = [s for s in steps if s.target in (Path("/proc/irq"), Path("/proc/bus")) and s.source is None]
    assert len(covers) == 2 and all(s.flags & 0x1 for s in covers)  # MS_RDONLY
    bwrap = [s for s in plan_workspace(1 << 20, Path("/tmp/workspace")) if s.op != "setattr"]
    assert bwrap[1].target == STAGING  # bwrap made /proc: none of it


@pytest.mark.parametrize("root", [True, False])
def test_a_template_kernel_takes_its_own_user_namespace_after_every_mount_and_before_its_limits(root):
    ids = (65534, 65534) if root else (1000, 1000)
    config = bootstrap_config(Policy(), Isolation.SANDBOX, root_flow=root, template_ids=ids)
    steps = plan_stage0(config, RUNNER)
    order = codes(steps)
    assert Op.UNSHARE not in order  # the keeper's clone made the namespaces
    userns = order.index(Op.USERNS)
    assert steps[userns][1] == ids
    assert max(i for i, op in enumerate(order) if op in (Op.MOUNT, Op.UMOUNT, Op.LOOPBACK_UP)) < userns
    assert userns < order.index(Op.RLIMIT) < order.index(Op.DROP_BOUNDING) < order.index(Op.CLEAR_CAPS)
    # Nested user namespaces are forbidden in its own namespace, in either flow.
    write = order.index(Op.WRITE, userns)
    assert steps[write][1] == ("/proc/sys/user/max_user_namespaces", "0")
    if root:  # nobody before the namespace (what it maps), the workspace given to nobody first
        assert order.index(Op.CHOWN) < order.index(Op.SETIDS) < userns
    else:
        assert Op.SETIDS not in order and Op.CHOWN not in order


# -- two kernels of one template --------------------------------------------------------------

# Each probe is (code for kernel A, code for kernel B); A's state lives on while B runs.
PROBES = {
    "files": (
        "import os\nmade = []\n"
        "for line in open('/proc/self/mountinfo'):\n"
        "    point, flags = line.split()[4], line.split()[5]\n"
        "    if flags.startswith('rw') and os.path.isdir(point):\n"
        "        try:\n            open(os.path.join(point, 'seq-from-a'), 'w').close(); made.append(point)\n"
        "        except OSError:\n            pass\n"
        "sorted(made)",
        "import os\nseen = []\n"
        "for line in open('/proc/self/mountinfo'):\n"
        "    point = line.split()[4]\n"
        "    if os.path.exists(os.path.join(point, 'seq-from-a')):\n        seen.append(point)\n"
        "for root in ('/tmp', '/dev/shm', '/var/tmp', '/'):\n"
        "    if os.path.exists(os.path.join(root, 'seq-from-a')):\n        seen.append(root)\n"
        "seen",
    ),
    "processes": (
        "import threading, time\nthreading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n'started'",
        "import os\n(os.getpid(), sorted(p for p in os.listdir('/proc') if p.isdigit()), "
        "open('/proc/1/cmdline', 'rb').read().split(b'\\0')[0].decode())",
    ),
    "terminals": (
        "import os\nkept = os.openpty()\nsorted(os.listdir('/dev/pts'))",
        "import os\nsorted(os.listdir('/dev/pts'))",
    ),
    # Seven threads each (max_threads 8): a shared count would leave B none.
    "thread_limits": (
        "import threading\nstop = threading.Event()\nmine = [threading.Thread(target=stop.wait) for _ in range(7)]\n"
        "[t.start() for t in mine]\nlen(mine)",
        "import threading\nstop = threading.Event()\nmine = [threading.Thread(target=stop.wait) for _ in range(7)]\n"
        "[t.start() for t in mine]\nstop.set()\nlen(mine)",
    ),
}

TWO_KERNELS = r'''
import json, os, sys
os.environ.update(SEQUESTER_NATIVE_STAGE="1", SEQUESTER_VIEW_TEMPLATE="1")
from sequester import Kernel, Limits, Policy
probes = json.load(sys.stdin)
out = {}
for name, (code_a, code_b) in probes.items():
    policy = Policy(limits=Limits(max_threads=8))
    with Kernel(policy) as a, Kernel(policy) as b:
        same = a.process.view_template is b.process.view_template
        ra, rb = a.run(code_a, timeout=30), b.run(code_b, timeout=30)
        out[name] = {"views": [a.report["view"], b.report["view"]], "same_template": same, "uid": [a.report["uid"], b.report["uid"]],
                     "a": ra.value, "b": rb.value, "errors": [None if r.error is None else r.error.message for r in (ra, rb)]}
print(json.dumps(out))
'''


def _two_kernels_here() -> dict:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", TWO_KERNELS], input=json.dumps(PROBES), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", params=["caller", "nobody"])
def two_kernels(request):
    """Every probe of PROBES, each in two kernels of one template: as this test's caller,
    and (when that is root) as an ordinary user."""
    if request.param == "caller":
        return _two_kernels_here()
    if not ROOT:
        pytest.skip("the ordinary-user flow is the caller's flow here")
    if not SYSTEM_PYTHON.exists():
        pytest.skip("as root the user flow runs on /usr/bin/python3, which is missing")
    with nobody_site() as run:
        proc = run(TWO_KERNELS, json.dumps(PROBES))
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_templates
@pytest.mark.parametrize("probe", sorted(PROBES))
def test_two_kernels_of_one_template_share_nothing(two_kernels, probe):
    """Attack: the kernels of one view are often different users' (one policy, many
    episodes). A shared writable mount, process list, terminal instance, network or
    process count would be a channel between them or let one starve the other."""
    seen = two_kernels[probe]
    assert seen["views"] == ["template", "template"] and seen["same_template"], seen
    assert seen["errors"] == [None, None], seen
    if probe == "files":
        assert eval(seen["a"]) and eval(seen["b"]) == [], seen  # A wrote somewhere; B sees none of it
    elif probe == "processes":
        pid, listed, cmdline = eval(seen["b"])
        assert pid == 1 and listed == ["1"] and "stage0" not in cmdline, seen  # no keeper, no A
    elif probe == "terminals":
        assert eval(seen["a"]) == ["0", "ptmx"] and eval(seen["b"]) == ["ptmx"], seen
    elif probe == "thread_limits":
        assert seen["a"] == seen["b"] == "7", seen


# -- the template's life ---------------------------------------------------------------------


@needs_templates
def test_kernels_of_one_policy_share_a_template_and_another_policy_gets_its_own(templates, monkeypatch):
    monkeypatch.setenv("SEQ_TEMPLATE_TEST", "1")
    with Kernel(Policy()) as a, Kernel(Policy()) as b, Kernel(Policy(limits=Limits(max_threads=9))) as c:
        assert a.process.view_template is b.process.view_template
        # Limits are per kernel (its plan), not the view: the same template.
        assert c.process.view_template is a.process.view_template
        with Kernel(Policy(env=("SEQ_TEMPLATE_TEST",))) as d:
            assert d.process.view_template is not a.process.view_template  # another environment: another view


@needs_templates
def test_a_kernel_that_fails_to_confine_itself_leaves_the_template_serving(templates, monkeypatch):
    from sequester.guard import namespaces

    with Kernel(Policy()) as first:
        template = first.process.view_template
    real = namespaces.plan_workspace

    def broken(size, workspace, keep=(), own_proc=None):
        steps = list(real(size, workspace, keep, own_proc))
        at = next(i for i, step in enumerate(steps) if step.target == STAGING)
        steps[at] = namespaces.MountStep("mount", STAGING, source="tmpfs", fstype="tmpfs", data="size=nonsense")
        return tuple(steps)

    monkeypatch.setattr("sequester.kernel.bootstrap.plan_workspace", broken)
    with pytest.raises(SandboxError, match="stage 0: mount /run"):
        Kernel(Policy()).start()
    monkeypatch.setattr("sequester.kernel.bootstrap.plan_workspace", real)
    with Kernel(Policy()) as again:
        assert again.process.view_template is template and again.run("1 + 1").value == "2"


@needs_templates
def test_a_retired_template_serves_its_kernels_to_their_end_then_goes(templates, monkeypatch):
    monkeypatch.setenv("SEQ_TEMPLATE_TEST", "1")
    monkeypatch.setattr(templates, "MAX_TEMPLATES", 1)
    old = Kernel(Policy()).start()
    try:
        first = old.process.view_template
        with Kernel(Policy(env=("SEQ_TEMPLATE_TEST",))) as other:  # retires the first view
            assert other.process.view_template is not first
            assert old.run("40 + 2").value == "42"  # still served
            assert first.alive
    finally:
        old.close()
    assert not first.alive  # its last kernel ended: the keeper is gone


@needs_templates
def test_the_keepers_death_ends_its_kernels_and_the_next_start_makes_a_new_view(templates):
    k = Kernel(Policy()).start()
    first = k.process.view_template
    templates.close_templates()
    assert k.run("1").error is not None or not k.alive()
    k.close()
    with Kernel(Policy()) as again:
        assert again.process.view_template is not first and again.run("2 + 2").value == "4"


@needs_templates
def test_a_forked_child_never_uses_its_parents_keeper(templates):
    with Kernel(Policy()) as parent_kernel:
        parent_template = parent_kernel.process.view_template
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            with Kernel(Policy()) as k:
                ok = k.run("3 * 3").value == "9" and k.process.view_template is not parent_template
            os.write(w, b"ok" if ok else b"bad")
        finally:
            os._exit(0)
    os.close(w)
    said = os.read(r, 16)
    os.close(r)
    os.waitpid(pid, 0)
    assert said == b"ok"
    with Kernel(Policy()) as k:  # the parent's keeper still serves the parent
        assert k.process.view_template is parent_template and k.run("5").value == "5"


@needs_templates
def test_many_kernels_start_at_once_from_one_template(templates):
    kernels, errors = [], []

    def start():
        try:
            kernels.append(Kernel(Policy()).start())
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors and len({id(k.process.view_template) for k in kernels}) == 1
        assert [k.run("6 * 7").value for k in kernels] == ["42"] * 8
    finally:
        for k in kernels:
            k.close()


@needs_templates
def test_a_view_first_used_by_a_thread_that_ended_still_serves(templates):
    """bwrap's --die-with-parent fires when the thread that started it ends: a view
    started on a pool's or server's worker thread must not die with that thread."""
    started = []
    worker = threading.Thread(target=lambda: started.append(Kernel(Policy()).start()))
    worker.start()
    worker.join()
    k = started[0]
    try:
        import time

        time.sleep(0.3)
        assert k.alive() and k.run("1 + 2").value == "3"
        with Kernel(Policy()) as again:
            assert again.process.view_template is k.process.view_template
    finally:
        k.close()


@needs_templates
@pytest.mark.skipif(not ROOT, reason="reads the keeper's /proc entry: a root caller's keeper")
def test_the_keeper_holds_nothing_but_its_control_socket(templates):
    def held() -> list[str]:
        fds = {fd: os.readlink(f"/proc/{keeper}/fd/{fd}") for fd in os.listdir(f"/proc/{keeper}/fd")}
        assert fds.pop("0") == "/dev/null" and fds.pop("1") == "/dev/null"
        return sorted(v.split(":")[0] for v in fds.values())

    with Kernel(Policy()) as k:
        keeper = k.process.view_template._started.pid
        # stderr (bwrap's messages), SIGCHLD, the control socket, and this kernel's status pipe
        assert held() == ["/memfd", "anon_inode", "pipe", "socket"]
    # The keeper writes the status, then closes its end: wait for the close.
    assert wait_until(lambda: held() == ["/memfd", "anon_inode", "socket"], timeout=5), held()


@needs_templates
def test_sequester_checks_kernels_apart_and_sees_kernels_that_share(templates):
    """The check's "kernels apart" finding passes for two kernels of one template, and
    fails where two kernels do share their /tmp, /dev/shm and processes (no isolation)."""
    from sequester.kernel import check

    with Kernel(Policy()) as k:
        finding = check._kernels_apart(k, lambda: Kernel(Policy()).start(), False)
        assert finding.passed and "template view" in finding.evidence, finding
    unconfined = Policy(isolation=False)
    try:
        with Kernel(unconfined) as k:
            finding = check._kernels_apart(k, lambda: Kernel(unconfined).start(), False)
        assert not finding.passed and "/tmp" in finding.evidence, finding
    finally:
        for folder in ("/tmp", "/dev/shm"):
            Path(folder, "sequester-check-mark").unlink(missing_ok=True)


# -- the failure memo and concurrent first kernels --------------------------------------


def test_concurrent_first_kernels_of_an_unavailable_view_pay_one_failed_start(templates):
    """``template_for`` checks the memo, then queues ``_start_once`` on
    the one start thread, which does not check it again: N kernels that arrive before the
    first failure is remembered each start (and wait for) a keeper that fails, in turn;
    with a keeper that never answers, 30 s each."""
    from sequester.kernel.template import TemplateUnavailable, template_for

    calls = []

    def start():
        calls.append(1)
        time.sleep(0.3)
        raise TemplateUnavailable("the view template did not start: test")

    errors = []

    def first_kernel():
        try:
            template_for("red-team-unavailable-view", start)
        except TemplateUnavailable as exc:
            errors.append(exc)

    threads = [threading.Thread(target=first_kernel) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 4
    assert len(calls) == 1, f"{len(calls)} failed keeper starts, one after another"
