"""The ``sequester`` command, run as a real process."""

import json
import subprocess
import sys

import pytest


def sequester(*args, stdin=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "sequester.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout)


def test_exec_relays_output_and_succeeds(tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text("import sys\nprint('hello')\nprint('warn', file=sys.stderr)\n")
    r = sequester("exec", "--isolation", "true", str(prog))
    assert (r.returncode, r.stdout, r.stderr) == (0, "hello\n", "warn\n")


def test_exec_from_stdin_fails_with_the_traceback():
    r = sequester("exec", "-", stdin="print('before')\nraise ValueError('boom')\n")
    assert r.returncode == 1 and r.stdout == "before\n"
    assert "ValueError: boom" in r.stderr and 'File "<stdin>", line 2' in r.stderr


def test_exec_blocked_program_fails():
    r = sequester("exec", "--isolation", "true", "-", stdin="import subprocess\nsubprocess.run(['ls'])\n")
    assert r.returncode == 1
    assert "PermissionError: process creation is blocked by the sandbox policy" in r.stderr


def test_exec_exit_status():
    assert sequester("exec", "-", stdin="import sys\nsys.exit(3)\n").returncode == 3
    assert sequester("exec", "-", stdin="raise SystemExit(0)\n").returncode == 0


def test_exec_allow_flag(tagged_service):
    port = tagged_service(b"Z")
    code = f"import socket\nprint(socket.create_connection(('127.0.0.1', {port})).recv(1).decode())\n"
    assert sequester("exec", "--isolation", "true", "-", stdin=code).returncode == 1
    r = sequester("exec", "--isolation", "true", "--allow", f"127.0.0.1:{port}", "-", stdin=code)
    assert (r.returncode, r.stdout) == (0, "Z\n")


def test_exec_readonly_and_hide_flags(tmp_path):
    shown = tmp_path / "shown"
    shown.mkdir()
    (shown / "f.txt").write_text("visible")
    tmp_path.chmod(0o755)
    shown.chmod(0o755)
    (shown / "f.txt").chmod(0o644)
    code = f"print(open({str(shown / 'f.txt')!r}).read())\n"
    r = sequester("exec", "--isolation", "true", "--readonly", str(shown), "-", stdin=code)
    assert (r.returncode, r.stdout) == (0, "visible\n"), r.stderr


def test_bad_config_names_the_key(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("[runtime]\nallow = ['nonsense']\n")
    r = sequester("exec", "--config", str(config), "-", stdin="print(1)\n")
    assert r.returncode == 2 and "runtime.allow[0]" in r.stderr and "'nonsense'" in r.stderr
    r = sequester("exec", "--allow", "no-port", "-", stdin="print(1)\n")
    assert r.returncode == 2 and "'no-port'" in r.stderr
    r = sequester("exec", "--readonly", "/no/such/path", "-", stdin="print(1)\n")
    assert r.returncode == 2 and "/no/such/path" in r.stderr


def test_exec_missing_file():
    r = sequester("exec", "/no/such/program.py")
    assert r.returncode == 2 and "/no/such/program.py" in r.stderr


def test_check_passes_here_and_reports_json():
    r = sequester("check", "--json", "--isolation", "true")
    report = json.loads(r.stdout)
    assert r.returncode == 0, r.stdout
    names = {f["name"] for f in report["findings"]}
    assert {"user namespaces available", "files hidden", "source read-only", "workspace writable",
            "network allowlist", "processes blocked", "processes invisible", "capabilities zero"} <= names
    assert report["mode"] == "sandbox" and report["passed"]


def test_check_table():
    r = sequester("check")
    assert r.returncode == 0 and "processes blocked" in r.stdout and "FAIL" not in r.stdout


def test_check_fails_loudly_without_isolation():
    r = sequester("check", "--json", "--isolation", "false")
    report = json.loads(r.stdout)
    assert r.returncode == 1 and not report["passed"]
    failed = {f["name"] for f in report["findings"] if not f["passed"]}
    assert {"processes blocked", "processes invisible", "files hidden"} <= failed
