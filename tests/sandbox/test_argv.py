"""The bwrap command line (:mod:`sequester.sandbox.argv`): a pure function of the sandbox's
spec, for the user flow and the root flow."""

from pathlib import Path

import pytest
from host_facts import USER_ENTRIES, facts

from sequester import Policy
from sequester.sandbox.argv import BOOTSTRAP_CAPS, ROOT_BOOTSTRAP_CAPS, Identity, LaunchFds, SandboxSpec, build_argv
from sequester.sandbox.mounts import plan_mounts


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
    plan = plan_mounts(Policy(), facts(), data_files={Path("/etc/hosts"): "127.0.0.1 localhost\n"})
    spec = SandboxSpec(plan, ("true",))
    with pytest.raises(ValueError, match="/etc/hosts"):
        build_argv("bwrap", spec, LaunchFds())
    argv = build_argv("bwrap", spec, LaunchFds(data={Path("/etc/hosts"): 9}))
    i = argv.index("--ro-bind-data")
    assert argv[i + 1: i + 3] == ["9", "/etc/hosts"]
