"""An episode's start (:mod:`sequester.environments.local.start`) against a root caller's
agent. A root caller's agent is host uid 0, and so is every program its tests run: procfs
would let it write the kernel's global settings (``kernel.core_pattern = "|/path"`` runs
a program as host root at the next crash), and the host's own device nodes bound into
``/dev`` would take its chmod, chown and touch. Both are read-only mounts in the agent's
view and in the verifier's. Nothing here writes a setting: a file opened for append
with nothing written is the probe."""

from __future__ import annotations

import os

from tasks import make_task

PROBE = ("for f in /proc/sys/kernel/core_pattern /proc/sys/vm/drop_caches /proc/sysrq-trigger; do "
         "( : >> $f ) 2>/dev/null && echo WRITABLE $f; done; touch /dev/null 2>/dev/null && echo TOUCHED")


def test_the_agent_cannot_write_kernel_settings_or_host_devices(tmp_path, episode):
    before = os.stat("/dev/null")
    episode.reset(make_task(tmp_path))
    out = episode.exec(PROBE).stdout
    assert "WRITABLE" not in out and "TOUCHED" not in out, out
    after = os.stat("/dev/null")
    assert (after.st_mtime_ns, after.st_mode, after.st_uid) == (before.st_mtime_ns, before.st_mode, before.st_uid)
    # control: the devices still work, and what is the agent's own stays writable
    control = episode.exec("echo x > /dev/null && head -c 4 /dev/urandom | wc -c && echo 1 > /proc/self/oom_score_adj"
                           " && echo ok")
    assert control.stdout.split() == ["4", "ok"], control


def test_the_tests_programs_cannot_write_kernel_settings(tmp_path, episode):
    test_sh = (f'out=$({PROBE}); echo "$out" > /logs/verifier/probe.txt; '
               'if [ -z "$out" ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n')
    episode.reset(make_task(tmp_path, test_sh=test_sh))
    result = episode.evaluate()
    assert result.reward == 1.0, result.files.get("probe.txt")


def test_a_held_sandbox_is_handed_over_only_once_its_view_is_built(tmp_path):
    """HOLE (CI, root: an ``ADD`` of a tar with ``proc/sys/fs/lease-break-time`` wrote the
    host's setting): bwrap reports its child's pid before the child has built the view, so
    a build step hardened at once hardened the mounts about to be replaced, and the fresh
    /proc mounted next stayed writable. A held sandbox is now handed over only when its
    child waits on the hold fd: its root is the step's overlay and its /proc is mounted.
    Without the wait, the child is still building (running, or on the tmpfs bwrap
    pivots through) on nearly every one of these starts."""
    from sequester.imagebuild.step_sandbox import APT_CONF, StepRun, step_spec
    from sequester.sandbox.bwrap import start_bwrap

    (tmp_path / "lower" / "bin").mkdir(parents=True)
    for attempt in range(10):
        run = StepRun(lowers=(tmp_path / "lower",), upper=tmp_path / f"upper{attempt}", work=tmp_path / f"work{attempt}",
                      argv=("/bin/true",), env={})
        run.upper.mkdir()
        run.work.mkdir()
        out_r, out_w = os.pipe()
        started = start_bwrap(step_spec(run, network=False), data_files={APT_CONF: ""}, keep_fds=[], stdout=out_w,
                              stderr=out_w, stderr_reader=out_r)
        try:
            with open(f"/proc/{started.pid}/mountinfo") as f:
                mounts = [line.split() for line in f]
            root = [m for m in mounts if m[4] == "/"]
            assert len(root) == 1 and root[0][root[0].index("-") + 1] == "overlay", root
            assert f"upperdir=/oldroot{run.upper}" in root[0][-1]
            assert any(m[4] == "/proc" and m[m.index("-") + 1] == "proc" for m in mounts)
            with open(f"/proc/{started.pid}/syscall") as f:
                assert f.read().split()[0] in ("0", "63")  # read(2): the hold fd
        finally:
            started.kill()
            os.close(out_r)
            os.close(out_w)
