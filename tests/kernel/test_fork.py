"""Warm kernels and their forks (``Kernel(policy, init=CODE)``, ``Kernel.fork()``,
``KernelPool(init=)``; kernel/stage0_fork.c, kernel/fork.py): a fork has what init left
and nothing of another fork or of the warm kernel itself, with every property of a
kernel. Real kernels and processes, as the caller and (as root) as an ordinary user.

Each probe is a pair: fork A runs the first code, then fork B (of the same warm kernel)
answers the second; the warm kernel must still fork after both.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time

import pytest
from nobody_site import SYSTEM_PYTHON, nobody_site  # tests/helpers
from stages import native_available  # tests/helpers

from sequester import Kernel, Policy
from sequester.errors import KernelError
from sequester.kernel.check import tagged_service
from sequester.kernel.pool import KernelPool
from sequester.sandbox.probe import namespace_support

ROOT = os.geteuid() == 0


def _fork_module_missing() -> str | None:
    from sequester.errors import SandboxError
    from sequester.kernel.stage0 import fork_module

    try:
        fork_module()
    except SandboxError as exc:
        return str(exc)
    return None


pytestmark = [
    pytest.mark.skipif(not namespace_support().available or not native_available(),
                       reason="warm kernels need user namespaces and the native stage"),
    pytest.mark.skipif(bool(_fork_module_missing()), reason=f"{_fork_module_missing()}"),
]

INIT = r"""
import mmap, os, socket
init_value = 41
shared = mmap.mmap(-1, 4096)                    # MAP_SHARED and anonymous: copied into every fork
shared[:4] = b"init"
with open("/tmp/workspace/data", "wb") as _f:   # a file of the warm kernel's workspace
    _f.write(b"x" * 8192)
mapped_file = mmap.mmap(os.open("/tmp/workspace/data", os.O_RDWR), 8192)  # MAP_SHARED of a file
pipe_r, pipe_w = os.pipe()                      # a pipe every fork would share
os.set_blocking(pipe_r, False)
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen()
listen_port = listener.getsockname()[1]
held = open("/tmp/workspace/data", "r+b")       # a file object init left open
"""

PROBES = {
    "init_state": ("init_value + 1", "init_value"),
    "variables": ("mine = 'A'\n'set'", "'mine' in dir()"),
    "workspace_files": ("open('/tmp/workspace/a', 'w').write('A')\nopen('/dev/shm/a', 'w').write('A')\n"
                        "sorted(os.listdir('/tmp/workspace'))",
                        "sorted(os.listdir('/tmp/workspace')), os.listdir('/dev/shm')"),
    "shared_anonymous_mapping": ("shared[:4] = b'AAAA'\nbytes(shared[:4])", "bytes(shared[:4])"),
    "shared_file_mapping": ("mapped_file[:4] = b'AAAA'\nbytes(mapped_file[:4])", "bytes(mapped_file[:4])"),
    "inherited_pipe": ("os.write(pipe_w, b'from A')",
                       "import errno\ntry:\n    r = os.read(pipe_r, 100)\nexcept OSError as e:\n    r = errno.errorcode[e.errno]\nr"),
    "inherited_file": ("held.write(b'AAAA'); held.flush()\nheld.seek(0); held.read(4)",
                       "held.seek(0); held.read(4)"),
    "loopback": ("import socket\nl = socket.socket(); l.bind(('127.0.0.1', 0)); l.listen()\nl.getsockname()[1]",
                 "import socket\ntry:\n    socket.create_connection(('127.0.0.1', @A@), timeout=1).close(); r = 'reached'\n"
                 "except OSError as e:\n    r = type(e).__name__\nr"),
    "init_listener": ("'nothing'",
                      "import socket\ntry:\n    socket.create_connection(('127.0.0.1', listen_port), timeout=1).close();"
                      " r = 'reached'\nexcept OSError as e:\n    r = type(e).__name__\nr"),
    "processes": ("sorted(int(p) for p in os.listdir('/proc') if p.isdigit())",
                  "sorted(int(p) for p in os.listdir('/proc') if p.isdigit())"),
    "kill_process_group": ("import signal\nos.kill(0, signal.SIGKILL)\n'sent'", "'alive'"),
    "kill_everyone": ("import signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError:\n    pass\n'sent'",
                      "'alive'"),
    "stop_process_group": ("import signal\nos.kill(0, signal.SIGSTOP)\n'sent'", "'alive'"),
    "abstract_socket": ("import socket\ntry:\n    s = socket.socket(socket.AF_UNIX); r = 'made'\nexcept OSError as e:\n"
                        "    r = type(e).__name__\nr", "'-'"),
    "confinement": ("import json\nst = dict(l.split(':', 1) for l in open('/proc/self/status') if ':' in l)\n"
                    "json.dumps({k: st[k].strip() for k in ('CapEff', 'CapPrm', 'CapBnd', 'Seccomp', 'NoNewPrivs')})",
                    "open('/proc/sys/user/max_user_namespaces').read().strip()"),
    "process_creation": ("import os\ntry:\n    os.fork(); r = 'forked'\nexcept OSError as e:\n    r = type(e).__name__\nr",
                         "import _posixsubprocess, os\ntry:\n    _posixsubprocess.fork_exec(['/bin/true'], [b'/bin/true'], True,"
                         " (), None, None, -1, -1, -1, -1, -1, -1, *os.pipe(), False, False, -1, None, None, None, -1,"
                         " None, False)\n    r = 'ran'\nexcept OSError as e:\n    r = type(e).__name__\nr"),
    "hostname": ("import socket\nsocket.sethostname('forkA') if False else socket.gethostname()",
                 "import socket\nsocket.gethostname()"),
}

FORKS = r'''
import json, os, sys, time
os.environ.update(SEQUESTER_NATIVE_STAGE="1", SEQUESTER_VIEW_TEMPLATE="1")
from sequester import Kernel, Policy
request = json.load(sys.stdin)
out = {}
with Kernel(Policy(), init=request["init"]) as warm:
    out["warm_report"] = warm.report
    for name, (code_a, code_b) in request["probes"].items():
        a, b = warm.fork(), warm.fork()
        try:
            ra = a.run(code_a, timeout=20)
            time.sleep(0.1)
            rb = b.run(code_b.replace("@A@", str(ra.value)), timeout=10)
            after = warm.fork()
            rc = after.run("init_value", timeout=10)
            after.close()
            out[name] = {
                "a": ra.value, "b": rb.value, "c": rc.value, "a_alive": a.alive(), "warm_alive": warm.alive(),
                "views": [a.report["view"], b.report["view"]],
                "forked": [a.report.get("forked"), b.report.get("forked")],
                "errors": [None if r.error is None else f"{r.error.type}: {r.error.message}" for r in (ra, rb, rc)],
            }
        finally:
            a.close()
            b.close()
print(json.dumps(out))
'''


@pytest.fixture(scope="module", params=["caller", "nobody"])
def forks(request):
    stdin = json.dumps({"init": INIT, "probes": PROBES})
    if request.param == "caller":
        proc = subprocess.run([sys.executable, "-c", FORKS], input=stdin, capture_output=True, text=True, timeout=900)
    else:
        if not ROOT:
            pytest.skip("the ordinary-user flow is the caller's flow here")
        if not SYSTEM_PYTHON.exists():
            pytest.skip("as root the user flow runs on /usr/bin/python3, which is missing")
        with nobody_site() as run:
            proc = run(FORKS, stdin)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _seen(forks, name):
    seen = forks[name]
    assert seen["views"] == ["fork", "fork"] and seen["forked"] == [True, True], seen
    assert seen["c"] == "41" and seen["warm_alive"], seen  # the warm kernel still forks, its state intact
    return seen


@pytest.mark.slow
def test_a_fork_has_what_init_left(forks):
    seen = _seen(forks, "init_state")
    assert (seen["a"], seen["b"]) == ("42", "41")


@pytest.mark.slow
def test_a_forks_variables_are_its_own(forks):
    seen = _seen(forks, "variables")
    assert seen["b"] == "False"


@pytest.mark.slow
def test_a_forks_workspace_is_its_own_and_starts_empty(forks):
    # Init's workspace file is not in any fork (its writable mounts are its own).
    seen = _seen(forks, "workspace_files")
    assert seen["a"] == "['a']"
    assert seen["b"] == "([], [])"


@pytest.mark.slow
def test_a_shared_mapping_init_made_is_each_forks_own_copy(forks):
    seen = _seen(forks, "shared_anonymous_mapping")
    assert (seen["a"], seen["b"]) == ("b'AAAA'", "b'init'")
    seen = _seen(forks, "shared_file_mapping")
    assert (seen["a"], seen["b"]) == ("b'AAAA'", "b'xxxx'")


@pytest.mark.slow
def test_descriptors_init_left_open_are_no_channel_between_forks(forks):
    seen = _seen(forks, "inherited_pipe")
    assert seen["b"] in ("b''", "'EAGAIN'"), seen  # /dev/null: the pipe is gone in each fork
    seen = _seen(forks, "inherited_file")
    assert seen["b"] != "b'AAAA'", seen


@pytest.mark.slow
def test_a_fork_cannot_reach_anothers_loopback_nor_the_warm_kernels(forks):
    assert _seen(forks, "loopback")["b"] == "'ConnectionRefusedError'"
    assert _seen(forks, "init_listener")["b"] == "'ConnectionRefusedError'"


@pytest.mark.slow
def test_a_fork_sees_only_itself_in_proc(forks):
    seen = _seen(forks, "processes")
    assert (seen["a"], seen["b"]) == ("[1]", "[1]")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["kill_process_group", "kill_everyone", "stop_process_group"])
def test_signals_of_a_fork_reach_no_other_fork_nor_the_warm_kernel(forks, name):
    seen = _seen(forks, name)
    assert seen["b"] == "'alive'" and seen["a_alive"], seen


@pytest.mark.slow
def test_a_fork_is_confined_as_a_kernel(forks):
    seen = _seen(forks, "confinement")
    status = json.loads(ast.literal_eval(seen["a"]))
    assert status == {"CapEff": "0000000000000000", "CapPrm": "0000000000000000", "CapBnd": "0000000000000000",
                      "Seccomp": "2", "NoNewPrivs": "1"}
    assert seen["b"] == "'0'"  # no user namespace below a fork
    assert _seen(forks, "abstract_socket")["a"] == "'PermissionError'"
    seen = _seen(forks, "process_creation")
    assert (seen["a"], seen["b"]) == ("'PermissionError'", "'PermissionError'"), seen


@pytest.mark.slow
def test_the_warm_kernel_reports_warm_and_its_forks_fork(forks):
    report = forks["warm_report"]
    assert report["warm"] is True and report["view"] == "template"
    assert "landlock_abi" not in report  # it has none (Landlock would refuse its forks every mount)


# -- the host side ---------------------------------------------------------------------------


def test_a_warm_kernel_runs_only_its_init():
    with Kernel(Policy(), init="x = 1") as warm:
        assert warm.init_result is not None and warm.init_result.error is None
        with pytest.raises(KernelError, match="runs only its init"):
            warm.run("x")
        with warm.fork() as fork:
            assert fork.run("x").value == "1"
            with pytest.raises(KernelError, match="only a warm kernel forks"):
                fork.fork()


@pytest.mark.parametrize("init", ["raise ValueError('no data')", "import os\nos._exit(3)"])
def test_an_init_that_fails_is_an_error_not_a_kernel(init):
    warm = Kernel(Policy(), init=init)
    with pytest.raises(KernelError, match="init cell failed"):
        warm.start()
    assert not warm.alive()


def test_a_forks_restart_is_a_fresh_fork_and_forks_end_with_their_warm_kernel():
    warm = Kernel(Policy(), init="x = 7").start()
    try:
        fork = warm.fork()
        fork.run("x = 8")
        fork.restart()
        assert fork.report["view"] == "fork"
        assert fork.run("x").value == "7"
        pid = fork.process.popen.pid
    finally:
        warm.close()
    deadline = time.monotonic() + 10
    while fork.process.popen.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not fork.alive()
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/status").read().find("State:\tZ") >= 0


def test_a_fork_has_the_network_its_policy_allows():
    with tagged_service(b"hello") as port, tagged_service(b"other") as other:
        policy = Policy(allow=[f"127.0.0.1:{port}"])
        with Kernel(policy, init="import socket") as warm, warm.fork() as a, warm.fork() as b:
            for fork in (a, b):
                got = fork.run(f"socket.create_connection(('127.0.0.1', {port})).recv(5)")
                assert got.value == "b'hello'", got
                refused = fork.run(f"socket.create_connection(('127.0.0.1', {other}), timeout=2)")
                assert refused.error is not None and refused.error.type in ("ConnectionRefusedError", "TimeoutError")


def test_a_pool_with_init_hands_out_forks_each_used_once():
    with KernelPool(Policy(), size=2, init="import json\nloaded = json.dumps({'n': 1})") as pool:
        first = pool.acquire(timeout=120)
        assert first.report["view"] == "fork"
        assert first.run("loaded").value == "'{\"n\": 1}'"
        first.run("loaded = 'changed'")
        pool.release(first)
        second = pool.acquire(timeout=120)
        assert second.run("loaded").value == "'{\"n\": 1}'"
        pool.release(second)


def test_the_warm_kernels_own_memory_and_proc_are_out_of_its_init_reach():
    # No Landlock on a warm kernel, so its /proc is covered whole: no mem file of any of
    # its threads to write its own code through, and the bare /proc kept for its forks is
    # below a folder it cannot enter.
    probe = (
        "import os, threading, json\nout = {}\n"
        "for p in ('/proc/self/mem', '/proc/1/mem', '/proc/2/mem', '/run/p/proc/1/mem', '/run/p'):\n"
        "    try:\n        os.close(os.open(p, os.O_RDONLY)); out[p] = 'opened'\n"
        "    except OSError as e:\n        out[p] = type(e).__name__\n"
        "probed = out\n"
    )
    with Kernel(Policy(), init=probe) as warm, warm.fork() as fork:
        seen = json.loads(ast.literal_eval(fork.run("import json\njson.dumps(probed)").value))
    assert all(v != "opened" for v in seen.values()), seen


@pytest.mark.slow
def test_sequester_check_proves_every_property_on_a_fork():
    proc = subprocess.run([sys.executable, "-m", "sequester.cli", "check", "--fork", "--json"], capture_output=True,
                          text=True, timeout=600)
    report = json.loads(proc.stdout)
    failed = [f for f in report["findings"] if not f["passed"]]
    assert proc.returncode == 0 and not failed, failed or proc.stderr[-2000:]
    assert report["view"] == "fork"
    names = {f["name"] for f in report["findings"]}
    assert {"forks apart", "a fork has init's state, not its kernel", "processes blocked",
            "capabilities zero", "own memory unwritable"} <= names
