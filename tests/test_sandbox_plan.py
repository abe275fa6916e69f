"""The view and the bwrap command line are pure functions of the policy and host facts."""

from pathlib import Path

import pytest

from sequester import Policy
from sequester.sandbox.argv import BOOTSTRAP_CAPS, ROOT_BOOTSTRAP_CAPS, Identity, LaunchFds, SandboxSpec, build_argv
from sequester.kernel.environ import kernel_environment
from sequester.sandbox.host import DirEntry, HostFacts
from sequester.sandbox.mounts import MountKind, hidden_paths, plan_mounts

P = Path


def entry(path, owner=0, is_dir=True, link=None):
    return DirEntry(P(path), owner, is_dir, link is not None, link)


TOP = (
    entry("/bin", link="usr/bin"), entry("/etc"), entry("/usr"), entry("/var"), entry("/opt"),
    entry("/home"), entry("/root"), entry("/srv"), entry("/data"), entry("/tmp"), entry("/proc"),
    entry("/.dockerenv", is_dir=False),
)


def facts(uid=1000, entries=TOP, home="/home/alice", roots=("/usr",), package="/data/alice/proj/src"):
    return HostFacts(uid=uid, gid=uid, home=P(home) if home else None, python_executable=P("/usr/bin/python3"),
                     python_roots=tuple(P(r) for r in roots), package_root=P(package), entries=entries,
                     sys_cpu=P("/sys/devices/system/cpu"))


USER_ENTRIES = TOP + (entry("/home/alice", owner=1000), entry("/home/bob", owner=1001), entry("/data/alice", owner=1000),
                      entry("/data/alice/deep", owner=1000), entry("/data/shared"), entry("/scratch", owner=1000))


def ops_of(plan, kind):
    return [op.dest for op in plan if op.kind is kind]


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


def test_argv_user_flow():
    spec = SandboxSpec(plan_mounts(Policy(), facts(entries=USER_ENTRIES)), ("python", "-c", "pass"))
    argv = build_argv("bwrap", spec, LaunchFds(info=7))
    assert argv[:2] == ["bwrap", "--unshare-user"]
    for flag in ("--disable-userns", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
                 "--die-with-parent", "--new-session"):
        assert flag in argv
    assert argv[argv.index("--cap-drop") + 1] == "ALL"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--cap-add"] == list(BOOTSTRAP_CAPS)
    assert "--userns-block-fd" not in argv
    assert argv[-4:] == ["--", "python", "-c", "pass"]
    assert argv[argv.index("--chdir") + 1] == "/tmp/workspace"
    # Read-only remounts come after every mount and cover the root itself.
    first_remount = argv.index("--remount-ro")
    assert all(a != "--ro-bind" for a in argv[first_remount:])
    assert ["--remount-ro", "/"] == argv[argv.index("--chdir") - 2: argv.index("--chdir")]
    assert "--remount-ro" in argv and argv[argv.index("--remount-ro") + 1] == "/data/alice"


def test_argv_root_flow_waits_for_the_uid_map_and_keeps_only_bootstrap_caps():
    spec = SandboxSpec(plan_mounts(Policy(), facts(uid=0, home="/root")), ("true",), identity=Identity.NOBODY,
                       caps=ROOT_BOOTSTRAP_CAPS)
    argv = build_argv("bwrap", spec, LaunchFds(info=5, userns_block=6))
    assert argv[argv.index("--userns-block-fd") + 1] == "6"
    assert argv[argv.index("--info-fd") + 1] == "5"
    assert "--disable-userns" not in argv  # done by the kernel itself (max_user_namespaces=0)
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--cap-add"] == list(ROOT_BOOTSTRAP_CAPS)
    # DAC keeps nobody from writing the folders bwrap made: no read-only remounts needed.
    assert "--remount-ro" not in argv
    with pytest.raises(ValueError):
        build_argv("bwrap", spec, LaunchFds())


def test_argv_keeps_secrets_off_the_command_line():
    spec = SandboxSpec(plan_mounts(Policy(), facts()), ("true",), env={"OPENAI_API_KEY": "sk-secret"})
    assert not any("sk-secret" in a for a in build_argv("bwrap", spec, LaunchFds()))


def test_data_files_need_fds():
    plan = plan_mounts(Policy(), facts(), data_files={P("/etc/hosts"): "127.0.0.1 localhost\n"})
    spec = SandboxSpec(plan, ("true",))
    with pytest.raises(ValueError, match="/etc/hosts"):
        build_argv("bwrap", spec, LaunchFds())
    argv = build_argv("bwrap", spec, LaunchFds(data={P("/etc/hosts"): 9}))
    i = argv.index("--ro-bind-data")
    assert argv[i + 1: i + 3] == ["9", "/etc/hosts"]


def test_data_file_inside_a_fresh_folder_gets_its_parents():
    plan = plan_mounts(Policy(), facts(), data_files={P("/run/systemd/resolve/stub-resolv.conf"): "x"})
    assert P("/run/systemd/resolve") in ops_of(plan, MountKind.DIR)


def test_environment_is_an_allowlist():
    host = {"PATH": "/usr/bin", "LANG": "C.UTF-8", "LC_ALL": "C", "PYTHONPATH": "/x", "HOME": "/root",
            "AWS_SECRET_ACCESS_KEY": "s", "OPENAI_API_KEY": "k", "HTTPS_PROXY": "http://corp:3128", "LD_PRELOAD": "/evil.so"}
    env = kernel_environment(host, passthrough=["OPENAI_API_KEY"], proxy=[("HTTPS_PROXY", "http://127.0.0.1:3128")],
                             tmpdir="/tmp")
    assert env == {"PATH": "/usr/bin", "LANG": "C.UTF-8", "LC_ALL": "C", "PYTHONPATH": "/x", "OPENAI_API_KEY": "k",
                   "HTTPS_PROXY": "http://127.0.0.1:3128", "HOME": "", "TMPDIR": "/tmp"}
    guard = kernel_environment(host, passthrough=[], proxy=None, tmpdir="/w")
    assert guard["HTTPS_PROXY"] == "http://corp:3128" and "LD_PRELOAD" not in guard


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


def test_ffi_library_names_and_folders():
    from sequester.sandbox.native import is_ffi_library, package_dir_patterns

    assert is_ffi_library("_ctypes.cpython-311-x86_64-linux-gnu.so") and is_ffi_library("_ctypes.so")
    assert is_ffi_library("_cffi_backend.abi3.so") and is_ffi_library("_ctypes_test.cpython-311-x86_64-linux-gnu.so")
    assert not is_ffi_library("_ctypes_other.so") and not is_ffi_library("_ctypes") and not is_ffi_library("ctypes.py")
    patterns = package_dir_patterns(P("/opt/conda"))
    assert "/opt/conda" in patterns and "/opt/conda/lib/python3*/site-packages" in patterns
    assert "/opt/conda/lib/python3*/lib-dynload" in patterns


def test_kernel_caps_and_the_view_only_caps():
    from sequester.kernel.spawn import _caps

    assert "CAP_SYS_ADMIN" in _caps(False, True) and "CAP_NET_ADMIN" in _caps(True, True)
    assert "CAP_NET_BIND_SERVICE" not in _caps(False, True)  # the kernel's own netns lets every port bind
    assert not {"CAP_SYS_ADMIN", "CAP_NET_ADMIN"} & set(_caps(True, False) + _caps(False, False))
