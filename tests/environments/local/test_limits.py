"""The task's limits on an episode (:mod:`sequester.environments.local.limits`): processes, memory, CPUs (cgroups of the episode's own
where the caller may make them; notes where not). Every attack here is bounded by the
test itself (a fixed number of processes, a fixed allocation), so that, were the limit
gone, the test fails without the machine running out of anything."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tasks import make_task

from sequester.environments.local.episode import Episode
from sequester.environments.settings import EpisodeSettings

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="cgroups of the episode's own are made as root")
HOST = EpisodeSettings()


def _task(tmp_path: Path, environment: str) -> Path:
    return make_task(tmp_path, "t", toml=f"[environment]\n{environment}")


SPAWN = """python3 -c '
import subprocess
started = 0
for _ in range({n}):
    try:
        subprocess.Popen(["sleep", "300"])
        started += 1
    except OSError:
        pass
print(started)'"""


def _start_many(ep: Episode, n: int) -> int:
    """Try to start ``n`` sleepers (a fork that fails is not retried); how many started."""
    return int(ep.exec(SPAWN.format(n=n), timeout=60).stdout.split()[-1])


@root_only
def test_a_root_callers_agent_cannot_pass_its_process_limit(tmp_path):
    """RLIMIT_NPROC does not bind the host's root: the pids cgroup must."""
    with Episode(EpisodeSettings(max_processes=60)) as ep:
        ep.reset(_task(tmp_path, "cpus = 1\n"))
        running = _start_many(ep, 150)
        assert 20 < running < 60, running


def test_an_ordinary_users_agent_cannot_pass_its_process_limit(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("as root RLIMIT_NPROC does not apply (the cgroup test above covers root)")
    with Episode(EpisodeSettings(max_processes=60)) as ep:
        ep.reset(_task(tmp_path, "cpus = 1\n"))
        assert _start_many(ep, 150) < 60


@root_only
def test_memory_limit_kills_what_passes_it(tmp_path):
    with Episode(HOST) as ep:
        ep.reset(_task(tmp_path, "memory_mb = 64\n"))
        assert not any("memory limit" in n for n in ep.notes), ep.notes
        small = ep.exec("head -c 16M /dev/zero | tail > /dev/null; echo $?")
        big = ep.exec("head -c 256M /dev/zero | tail > /dev/null; echo $?")
        assert small.stdout.split()[-1] == "0"
        assert big.stdout.split()[-1] == "137", big  # SIGKILL by the OOM killer of the episode's cgroup


@root_only
def test_cpu_limit_and_cleanup(tmp_path):
    with Episode(HOST) as ep:
        ep.reset(_task(tmp_path, "cpus = 0.5\n"))
        groups = ep._running().limit_groups
        assert groups is not None
        cpu = next(p for p in groups.paths if (p / "cpu.cfs_quota_us").exists())
        assert (cpu / "cpu.cfs_quota_us").read_text().strip() == "50000"
        assert str(ep.init_pid) in (cpu / "cgroup.procs").read_text().split()
        shell_pid = ep.exec("echo $$").stdout.strip()
        assert shell_pid  # the shell runs (its host pid is in the group: the agent joined it)
        assert len((cpu / "cgroup.procs").read_text().split()) >= 2
    assert not any(p.exists() for p in groups.paths)  # removed with the episode


def test_what_cannot_be_applied_is_in_the_notes(tmp_path):
    with Episode(HOST) as ep:
        ep.reset(_task(tmp_path, "storage_mb = 100\n"))
        assert any("storage limit of 100 MB" in n for n in ep.notes), ep.notes
        # why, as the host answered (this machine kind: ext4 without prjquota; see tests/sandbox/test_quota.py)
        said = next(n for n in ep.notes if "storage limit of 100 MB" in n)
        assert "not applied" in said and ("quota" in said or "filesystem" in said or "memory" in said), said
        if os.geteuid() != 0:
            ep.reset(_task(tmp_path / "u", "memory_mb = 64\n"))
            assert any("memory limit of 64 MB" in n and "not applied" in n for n in ep.notes), ep.notes


@root_only
def test_programs_the_tests_run_cannot_pass_the_process_limit(tmp_path):
    """The tests run the agent's program, as host root for a root caller: the verifier's
    own pids cgroup bounds it (here a program that tries 150 processes, limit 60)."""
    program = SPAWN.format(n=150).split("'", 1)[1].rsplit("'", 1)[0]
    test_sh = 'python3 /tests/spawn.py > /logs/verifier/started.txt; echo 1 > /logs/verifier/reward.txt\n'
    task = make_task(tmp_path, "t", test_sh, toml="[environment]\ncpus = 1\n", files={"tests/spawn.py": program})
    with Episode(EpisodeSettings(max_processes=60)) as ep:
        ep.reset(task)
        result = ep.evaluate()
    started = int(result.files["started.txt"].decode().split()[-1])
    assert 10 < started < 60, started


# -- cgroup v2: one cgroup for the limits and the freezer ----------------------------------------


def _v2_offers_limits() -> tuple[bool, str]:
    from sequester.sandbox.cgroups import limits

    found = limits.v2_bases()
    if found is None:
        return False, "no cgroup v2 hierarchy is mounted here"
    usable = [b for b in found[1] if b.usable]
    offered = usable[0].controllers if usable else frozenset()
    if limits.choose_version(limits._v1_controllers(), offered) != "v2":
        return False, (f"this machine's cgroup v2 offers {' '.join(sorted(offered)) or 'no controllers'} where "
                       "sequester may use it (a hybrid v1/v2 host: limits go to v1)")
    return True, ""


V2, V2_WHY = _v2_offers_limits()


@pytest.mark.skipif(not V2, reason=V2_WHY or "-")
def test_limits_on_cgroup_v2_where_the_machine_offers_it(tmp_path):
    """The real v2 path (a v2-only host, root or a delegated user): one cgroup with
    memory.max, cpu.max and pids.max, every agent process in it, frozen in place."""
    with Episode(EpisodeSettings(max_processes=60)) as ep:
        ep.reset(_task(tmp_path, "memory_mb = 64\ncpus = 0.5\n"))
        run = ep._running()
        groups = run.limit_groups
        assert groups is not None and groups.v2 is not None and len(groups.paths) == 1, ep.notes
        path = groups.paths[0]
        assert (path / "memory.max").read_text().strip() == str(64 << 20)
        assert (path / "cpu.max").read_text().split() == ["50000", "100000"]
        assert (path / "pids.max").read_text().strip() == "60"
        assert ep.exec("head -c 256M /dev/zero | tail > /dev/null; echo $?").stdout.split()[-1] == "137"
        assert _start_many(ep, 150) < 60
        assert run.freezer.path == path
        outcome = run.freezer.freeze()
        assert outcome.held and "verified" in outcome.note and run.freezer.path == path
        run.freezer.thaw()
    assert not path.exists()


@root_only
def test_the_freezer_shares_the_limits_cgroup_v2(tmp_path, monkeypatch):
    """A v2 process is in one cgroup only: a freezer cgroup of its own would take the agent
    out of its limits. This machine's v2 has no controllers, so the episode's limits are a
    real v2 cgroup with none written (the v1 ones are not made here), and the freezer must
    freeze the agent in that very cgroup, with every process still in it."""
    from sequester.environments.local import limits as episode_limits
    from sequester.sandbox.cgroups import limits
    from sequester.sandbox.cgroups.hierarchy import find_v2

    if find_v2() is None:
        pytest.skip("no cgroup v2 hierarchy is mounted here")
    monkeypatch.setattr(limits, "_v2_chosen", [])
    monkeypatch.setattr(episode_limits, "make_limit_groups",
                        lambda name, **_: (limits._make_v2(name, None, None, None), None))
    with Episode(HOST) as ep:
        ep.reset(_task(tmp_path, "cpus = 1\n"))
        run = ep._running()
        path = run.limit_groups.paths[0]
        assert run.limit_groups.v2 is not None and run.freezer.path == path
        assert run.agent_cgroups == [str(path / "cgroup.procs")]
        ep.exec("sleep 300 & sleep 300 & echo started")
        outcome = run.freezer.freeze()
        assert outcome.held and outcome.method.startswith("cgroup v2") and "verified" in outcome.note, outcome
        members = set((path / "cgroup.procs").read_text().split())
        assert str(ep.init_pid) in members and len(members) >= 4, members
        assert "frozen 1" in (path / "cgroup.events").read_text()
        run.freezer.thaw()
        assert ep.exec("echo alive").stdout == "alive\n"
    assert not path.exists()
