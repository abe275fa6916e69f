"""A kernel's view as mount operations (:mod:`sequester.sandbox.mounts`): a pure function
of the policy and the host's facts (made up here: tests/helpers/host_facts.py)."""

from host_facts import USER_ENTRIES, P, facts, ops_of

from sequester import Policy
from sequester.sandbox.mounts import MountKind, hidden_paths, plan_mounts


def test_user_rule_hides_home_and_topmost_owned_dirs():
    dirs, files = hidden_paths(Policy(), facts(entries=USER_ENTRIES))
    assert set(dirs) == {P("/home/alice"), P("/data/alice"), P("/scratch")}  # not /data/alice/deep: covered
    assert files == ()


def test_root_rule_keeps_the_os_and_hides_the_rest():
    dirs, files = hidden_paths(Policy(), facts(uid=0, home="/root"))
    assert set(dirs) == {P("/home"), P("/root"), P("/srv"), P("/data")}
    assert files == (P("/.dockerenv"),)
    assert not {P("/usr"), P("/etc"), P("/var"), P("/opt"), P("/bin")} & set(dirs)


def test_plan_assembles_the_root_from_visible_entries():
    plan = plan_mounts(Policy(), facts(uid=0, home="/root", roots=("/root/.pyenv/versions/3.11",)))
    binds = ops_of(plan, MountKind.READONLY)
    assert {P("/usr"), P("/etc"), P("/var"), P("/opt")} <= set(binds)
    assert P("/home") not in binds and P("/root") not in binds
    assert P("/bin") in ops_of(plan, MountKind.SYMLINK)
    # Hidden top-level folders are empty directories; hidden top-level files are absent.
    assert {P("/home"), P("/root"), P("/srv"), P("/data")} <= set(ops_of(plan, MountKind.DIR))
    assert P("/.dockerenv") not in [op.dest for op in plan]
    # Replaced: never bound from the host.
    assert P("/proc") in ops_of(plan, MountKind.PROC) and P("/tmp") in ops_of(plan, MountKind.TMPFS)
    assert P("/proc") not in binds and P("/tmp") not in binds


def test_mount_backs_land_on_top_with_traversable_parents():
    plan = plan_mounts(Policy(), facts(uid=0, home="/root", roots=("/root/.pyenv/versions/3.11",)))
    dests = [op.dest for op in plan]
    prefix = dests.index(P("/root/.pyenv/versions/3.11"))
    for parent in (P("/root"), P("/root/.pyenv"), P("/root/.pyenv/versions")):
        op = next(op for op in plan if op.dest == parent and op.kind is MountKind.DIR)
        assert op.mode == 0o755
        assert dests.index(parent) < prefix


def test_hidden_subdir_of_a_visible_dir_is_a_tmpfs_under_its_mount_back():
    plan = plan_mounts(Policy(), facts(entries=USER_ENTRIES))
    hides = ops_of(plan, MountKind.HIDE_DIR)
    assert P("/home/alice") in hides and P("/data/alice") in hides
    dests = [op.dest for op in plan]
    # The package root inside a hidden folder is mounted after the tmpfs that hides it.
    assert dests.index(P("/data/alice")) < dests.index(P("/data/alice/proj/src"))
    assert next(op for op in plan if op.dest == P("/data/alice/proj")).mode == 0o755


def test_policy_hide_and_readonly(tmp_path):
    secret = tmp_path / "secret"
    secret.mkdir()
    src = tmp_path / "src"
    src.mkdir()
    plan = plan_mounts(Policy(hide=(secret,), readonly=(src,)), facts())
    assert secret in ops_of(plan, MountKind.HIDE_DIR)
    assert src in ops_of(plan, MountKind.READONLY)


def test_data_file_inside_a_fresh_folder_gets_its_parents():
    plan = plan_mounts(Policy(), facts(), data_files={P("/run/systemd/resolve/stub-resolv.conf"): "x"})
    assert P("/run/systemd/resolve") in ops_of(plan, MountKind.DIR)


def test_ffi_libraries_the_view_shows_are_covered_with_dev_null():
    lib = P("/root/.pyenv/versions/3.11/lib/python3.11/lib-dynload/_ctypes.cpython-311-x86_64-linux-gnu.so")
    cffi = P("/usr/lib/python3/dist-packages/_cffi_backend.cpython-311-x86_64-linux-gnu.so")
    other = P("/root/.pyenv/versions/3.12/lib/python3.12/lib-dynload/_ctypes.cpython-312-x86_64-linux-gnu.so")
    from dataclasses import replace

    f = replace(facts(uid=0, home="/root", roots=("/root/.pyenv/versions/3.11",)), ffi_libraries=(lib, cffi, other))
    plan = plan_mounts(Policy(), f)
    covered = {op.dest: op.source for op in plan if op.kind is MountKind.HIDE_FILE}
    assert covered == {lib: P("/dev/null"), cffi: P("/dev/null")}  # not the 3.12 one: /root is hidden
    dests = [op.dest for op in plan]
    assert dests.index(P("/root/.pyenv/versions/3.11")) < dests.index(lib)  # on top of its mount-back


