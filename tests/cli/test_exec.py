"""``sequester exec`` (:mod:`sequester.cli.exec`), run as a real process: a program run in
a kernel, its output, exit status and errors, the policy's flags, and bad input (exit 2)."""

import subprocess
import sys

import pytest
from command import sequester


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


@pytest.mark.slow
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


def test_exec_a_program_that_is_not_utf8(tmp_path):
    prog = tmp_path / "latin1.py"
    prog.write_bytes("print('caf\u00e9')\n".encode("latin-1"))
    for args, stdin in (((str(prog),), None), (("-",), prog.read_bytes())):
        r = subprocess.run([sys.executable, "-m", "sequester.cli", "exec", *args], input=stdin, capture_output=True,
                           timeout=60)
        err = r.stderr.decode()
        assert r.returncode == 2 and "not UTF-8" in err and "0xe9" in err and "Traceback" not in err, err


def test_exec_syntax_error_shows_the_users_code_only(tmp_path):
    prog = tmp_path / "bad.py"
    prog.write_text("x = 1\ndef f(:\n    pass\n")
    r = sequester("exec", str(prog))
    assert r.returncode == 1
    assert r.stderr.startswith(f'  File "{prog}", line 2\n') and r.stderr.rstrip().endswith("SyntaxError: invalid syntax")
    assert "ast.py" not in r.stderr and "Traceback" not in r.stderr
    r = sequester("exec", "-", stdin="x = (1,\n")
    assert r.returncode == 1 and r.stderr.startswith('  File "<stdin>", line 1') and "ast.py" not in r.stderr




@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_a_timeout_that_is_not_a_positive_number_is_exit_2_naming_it(value):
    """It was a raw ValueError traceback, exit 1."""
    r = sequester("exec", "--timeout", value, "-", stdin="print(1)\n")
    assert r.returncode == 2 and f"'{value}' is not a positive number" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("table, key", [("limits", "cell_timeout"), ("limits", "kernel_timeout")])
def test_a_nan_in_the_config_is_exit_2_naming_the_key(tmp_path, table, key):
    """`cell_timeout = nan` was accepted (then every cell failed)."""
    config = tmp_path / "c.toml"
    config.write_text(f"[{table}]\n{key} = nan\n")
    r = sequester("exec", "--config", str(config), "-", stdin="print(1)\n")
    assert r.returncode == 2 and f"{table}.{key}: nan is not a positive number" in r.stderr, r.stderr
