"""A root caller's agent is host uid 0, and so is every program its tests run: procfs
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
