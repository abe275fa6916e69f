"""The guard alone (:mod:`sequester.guard`), where user namespaces are unavailable: "auto"
falls back to it, and it still holds.

The host process runs under a seccomp filter that refuses new user namespaces, as
Docker's default profile does (tests/helpers/no_userns.py).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from paths import HELPERS

HELPER = HELPERS / "no_userns.py"

HARNESS = r'''
import json, os, socket, sys
from sequester import Kernel, Policy, SandboxUnavailableError

port = int(sys.argv[1])
other = int(sys.argv[2])
out = {}
try:
    Kernel(Policy(isolation=True)).start()
    out["strict"] = "started"
except SandboxUnavailableError as e:
    out["strict"] = str(e)
with Kernel(Policy(isolation="auto", allow=(f"127.0.0.1:{port}",))) as k:
    out["mode"] = k.mode.value
    out["report"] = k.report
    def run(code):
        r = k.run(code)
        return r.value if r.error is None else f"{r.error.type}: {r.error.message}"
    out["home"] = run("import os\nos.listdir(os.path.expanduser('~root'))")
    out["shadow"] = run("open('/etc/shadow').read()[:4]")
    out["etc"] = run("'root:' in open('/etc/passwd').read()")
    out["write_outside"] = run("open('/var/tmp/guard-planted', 'w').write('x')")
    out["workspace"] = run("open('w.txt', 'w').write('ok')\nopen('w.txt').read()")
    out["subprocess"] = run("import subprocess\nsubprocess.run(['/bin/true'])")
    out["fork_exec"] = run("import _posixsubprocess, os\nr, w = os.pipe()\n"
        "_posixsubprocess.fork_exec([b'/bin/true'], [b'/bin/true'], True, (), None, None, -1, -1, -1, -1, -1, -1, r, w, "
        "True, False, -1, None, None, None, -1, None, False)")
    out["allowed"] = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=3).recv(1)")
    out["other"] = run(f"import socket\nsocket.create_connection(('127.0.0.1', {other}), timeout=3).recv(1)")
    out["ctypes"] = run("import ctypes")
    out["signal_host"] = run(f"import os, signal\nos.kill({os.getpid()}, signal.SIGTERM)")
    from sequester.kernel.check import _own_memory
    out["own_memory"] = _own_memory(k).evidence
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def guard_run(tmp_path_factory):
    import socket
    import threading

    servers = []
    for tag in (b"A", b"B"):
        server = socket.create_server(("127.0.0.1", 0))
        servers.append(server)

        def serve(server=server, tag=tag):
            while True:
                try:
                    c, _ = server.accept()
                except OSError:
                    return
                c.sendall(tag)
                c.close()

        threading.Thread(target=serve, daemon=True).start()
    script = tmp_path_factory.mktemp("guard") / "harness.py"
    script.write_text(HARNESS)
    proc = subprocess.run([sys.executable, str(HELPER), str(script), *(str(s.getsockname()[1]) for s in servers)],
                          capture_output=True, text=True, timeout=120)
    for server in servers:
        server.close()
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_strict_isolation_refuses_to_start_without_namespaces(guard_run):
    out, _ = guard_run
    assert "needs user namespaces" in out["strict"] and '"auto"' in out["strict"]


def test_auto_falls_back_to_the_guard_with_a_warning(guard_run):
    out, stderr = guard_run
    assert out["mode"] == "guard"
    assert "running with the guard alone" in stderr and "Not protected" in stderr
    assert out["report"]["seccomp"] == "2" and out["report"]["landlock_abi"] >= 1


def test_guard_blocks_processes(guard_run):
    out, _ = guard_run
    assert out["subprocess"] == "PermissionError: process creation is blocked by the sandbox policy"
    assert out["fork_exec"].startswith("PermissionError")  # seccomp, not the hook


def test_guard_hides_files_with_landlock(guard_run):
    out, _ = guard_run
    assert out["home"].startswith("PermissionError")
    assert out["shadow"].startswith("PermissionError")
    assert out["etc"] == "True"
    assert out["write_outside"].startswith("PermissionError")
    assert not Path("/var/tmp/guard-planted").exists()
    assert out["workspace"] == "'ok'"


def test_guard_network_by_port(guard_run):
    out, _ = guard_run
    assert out["allowed"] == "b'A'"
    assert out["other"].startswith("PermissionError")


def test_guard_keeps_ctypes_out_and_cannot_signal_the_host(guard_run):
    out, _ = guard_run
    assert out["ctypes"].startswith("ImportError")
    assert out["signal_host"].startswith("PermissionError")  # Landlock signal scoping (ABI 6+)


def test_guard_refuses_the_kernels_own_memory(guard_run):
    """/proc/self/mem (and a thread's /proc/<tid>/mem) would let a cell write its own code; in guard mode Landlock
    grants no write beneath /proc, so opening it for writing is refused."""
    out, _ = guard_run
    assert out["own_memory"].count("refused: Permission denied") == 3, out["own_memory"]  # self, thread-self, a thread
