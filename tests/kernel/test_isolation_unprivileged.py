"""A kernel's isolation when the host process is an ordinary user (the user flow of
bwrap): the properties of tests/kernel/test_isolation.py, and an episode's.

A harness runs as the suite's user ``seqtest`` (removed with its home at the end of the
session) with Debian's own Python and a world-readable copy of sequester; the user has
secrets in its home and in a top-level folder of its own (conftest's ``user_site``).
"""

import os
from pathlib import Path

import pytest
from nobody_site import SYSTEM_PYTHON, run_as_user
from services import free_low_port, greeter
from users import SEQTEST_USER

USER = SEQTEST_USER

pytestmark = [
    pytest.mark.slow,  # every test reads what a harness run as the user (a module fixture) saw
    pytest.mark.skipif(os.geteuid() != 0, reason="creating a user needs root (CI runs as root)"),
    pytest.mark.skipif(not SYSTEM_PYTHON.exists(), reason="needs /usr/bin/python3 (.ci/run installs it)"),
]

HARNESS = r'''
import json, os, sys
from sequester import Kernel, Policy
from sequester.kernel.launch import run_in_sandbox
home, data = sys.argv[1], sys.argv[2]
out = {"host_home": sorted(os.listdir(home)), "host_data": sorted(os.listdir(data))}
with Kernel(Policy()) as k:
    def run(code):
        r = k.run(code)
        return json.loads(r.stdout) if r.error is None else f"{r.error.type}: {r.error.message}"
    out["mode"] = k.mode.value
    out["view"] = run(f"import json, os\nprint(json.dumps({{p: os.listdir(p) if os.path.isdir(p) else 'absent' for p in [{home!r}, {data!r}]}}))")
    out["ids"] = run("import json, os\nprint(json.dumps([os.getuid(), os.getgid()]))")
    out["caps"] = run("import json\nprint(json.dumps(sorted({l.split()[1] for l in open('/proc/self/status') if l.startswith('Cap')})))")
    out["proc"] = run("import json, os\nprint(json.dumps(sorted(int(p) for p in os.listdir('/proc') if p.isdigit())))")
    r = k.run("import os\nos.fork()")
    out["fork"] = f"{r.error.type}: {r.error.message}" if r.error else "forked"
    r = k.run("import ctypes")
    out["ctypes"] = r.error.type if r.error else "imported"
layer = run_in_sandbox(Policy(), ["sh", "-c", f"umount -l {home}; cat {home}/secret.txt || echo HIDDEN"])
out["umount"] = layer.stdout + layer.stderr

from sequester import Episode, load_agent
task = sys.argv[3]
for agent in ("oracle", "nop"):
    with Episode() as ep:
        ep.reset(task)
        if agent == "oracle":
            out["agent_view"] = ep.exec(f"id -u; ls -A {home} 2>&1; cat {data}/secret.txt 2>&1").stdout
        load_agent(agent).run(ep.instruction, ep)
        out[agent] = ep.evaluate().reward
        out["frozen"] = ep.evaluate(freeze=True).frozen
print(json.dumps(out))
'''


# The native-code and network protections, as an ordinary caller: ctypes with the hook off, the shared workspace cap, a
# service below 1024 (its port is argv[1]). Separate from HARNESS: no episode involved.
KERNEL_HARNESS = r'''
import json, sys
from sequester import Kernel, Policy
out = {}
from sequester import Limits
from sequester.kernel.check_native import NATIVE_PROBE, sample_library
from sequester.sandbox.host import gather_host_facts
libraries = sorted({str(p) for p in gather_host_facts(scan_ffi=True).ffi_libraries if p.name.startswith("_ctypes.")})
with Kernel(Policy()) as k:
    r = k.run(f"LIBRARIES = {libraries!r}\nSAMPLE = {sample_library()!r}\n" + NATIVE_PROBE)
    out["native"] = json.loads(r.stdout) if r.error is None else str(r.error)
    out["libraries"] = libraries
fill = "open({!r} + '/fill', 'wb').write(b'x' * 6 * 1024 * 1024)"
with Kernel(Policy(limits=Limits(workspace_mb=8))) as k:
    def attempt(code):
        r = k.run(code)
        return "ok" if r.error is None else r.error.message
    out["shm_alone"] = attempt(fill.format("/dev/shm"))
    attempt("import os\nos.remove('/dev/shm/fill')")
    out["shm_after_tmp"] = [attempt(fill.format("/tmp/workspace")), attempt(fill.format("/dev/shm"))]
    out["dev_write"] = attempt("open('/dev/planted', 'w')")
low = int(sys.argv[1])
with Kernel(Policy(allow=(f"127.0.0.1:{low}", "https://svc.sequester.test"))) as k:
    r = k.run(f"import socket\ns = socket.create_connection(('127.0.0.1', {low}), timeout=5)\ns.recv(1)")
    out["low_port"] = r.value if r.error is None else f"{r.error.type}: {r.error.message}"
print(json.dumps(out))
'''


def _harness(site: Path, name: str, text: str) -> str:
    (site / name).write_text(text)
    (site / name).chmod(0o644)
    return name


@pytest.fixture(scope="module")
def unprivileged(user_site):
    entry, home, data, site = user_site
    return entry, run_as_user(user_site, _harness(site, "harness.py", HARNESS), str(home), str(data), str(site / "task"))


@pytest.fixture(scope="module")
def unprivileged_kernel(user_site):
    site = user_site[3]
    with greeter(b"P", free_low_port()) as low_port:  # a root-owned service below 1024
        return run_as_user(user_site, _harness(site, "kernel_harness.py", KERNEL_HARNESS), str(low_port))


def test_control_the_user_can_read_its_own_secrets(unprivileged):
    _, out = unprivileged
    assert "secret.txt" in out["host_home"] and "secret.txt" in out["host_data"]


def test_user_home_and_owned_top_level_dir_are_hidden(unprivileged):
    entry, out = unprivileged
    assert out["mode"] == "sandbox"
    assert out["view"][entry.pw_dir] == []
    assert out["view"][f"/{USER}-data"] in ([], "absent")


def test_user_kernel_keeps_its_uid_and_has_no_capabilities(unprivileged):
    entry, out = unprivileged
    assert out["ids"] == [entry.pw_uid, entry.pw_gid]
    assert out["caps"] == ["0000000000000000"]


def test_user_kernel_processes(unprivileged):
    _, out = unprivileged
    assert out["proc"] == [1]  # the kernel alone: no init of bwrap's beside it
    assert out["fork"] == "PermissionError: process creation is blocked by the sandbox policy"
    assert out["ctypes"] == "ImportError"


def test_user_episode_scores_and_hides_the_users_files(unprivileged):
    entry, out = unprivileged
    assert (out["oracle"], out["nop"]) == (1.0, 0.0)
    lines = out["agent_view"].splitlines()
    assert lines[0] == "0"  # root in its own user namespace
    assert "data secret" not in out["agent_view"]  # the user's top-level folder: absent
    assert lines[1] == "" or "cannot access" in lines[1]  # its home: empty or absent
    assert out["frozen"] == "SIGSTOP"  # no cgroup for an ordinary user: signals


def test_user_flow_hidden_tmpfs_cannot_be_unmounted(unprivileged):
    _, out = unprivileged
    assert "HIDDEN" in out["umount"] and "home secret" not in out["umount"]


def test_user_kernel_cannot_load_ctypes_even_with_the_hook_off(unprivileged_kernel):
    out = unprivileged_kernel
    native = out["native"]
    assert isinstance(native, dict), native
    assert out["libraries"] and native["hook_off"] == "disabled"
    assert "blocked" not in native["import ctypes"] and not native["import ctypes"].startswith("LOADED")
    assert all(not native[p].startswith("LOADED") for p in out["libraries"])
    assert all("Operation not permitted" in v for k, v in native.items() if k.startswith("exec map in"))
    assert native["memfd_create"] == "Operation not permitted" and native["ctypes types in memory"] == []


def test_user_kernel_dev_shm_counts_in_the_workspace_cap(unprivileged_kernel):
    out = unprivileged_kernel
    assert out["shm_alone"] == "ok"  # control: /dev/shm is writable
    assert out["shm_after_tmp"][0] == "ok" and "No space left" in out["shm_after_tmp"][1]
    assert "Read-only file system" in out["dev_write"]


def test_user_kernel_reaches_an_allowed_service_below_1024(unprivileged_kernel):
    out = unprivileged_kernel
    assert out["low_port"] == "b'P'"
