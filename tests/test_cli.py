"""The ``sequester`` command, run as a real process."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import sequester as sequester_package


REPO = Path(__file__).resolve().parent.parent
TASK = REPO / "examples" / "tasks" / "python-csv-stats"


def sequester(*args, stdin=None, timeout=120, cwd=None):
    # -P: the current folder is not put on sys.path, as with the installed `sequester` script.
    return subprocess.run([sys.executable, "-P", "-m", "sequester.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)


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
            "network allowlist", "processes blocked", "processes invisible", "capabilities zero",
            "own memory unwritable", "kernels apart"} <= names
    assert report["mode"] == "sandbox" and report["passed"]
    # Which first stage confined the probe kernel: the native one wherever a C compiler is.
    compiler = shutil.which("cc") or shutil.which("gcc")
    native = compiler and os.environ.get("SEQUESTER_NATIVE_STAGE") != "0"
    assert report["first_stage"] == ("native" if native else "python")
    # ... and, through it, the view its policy's template keeps.
    assert report["view"] == ("template" if native and os.environ.get("SEQUESTER_VIEW_TEMPLATE") != "0" else "bwrap")


def test_check_table():
    r = sequester("check")
    assert r.returncode == 0 and "processes blocked" in r.stdout and "FAIL" not in r.stdout


def test_check_fails_loudly_without_isolation():
    r = sequester("check", "--json", "--isolation", "false")
    report = json.loads(r.stdout)
    assert r.returncode == 1 and not report["passed"]
    failed = {f["name"] for f in report["findings"] if not f["passed"]}
    assert {"processes blocked", "processes invisible", "files hidden"} <= failed


# -- rough edges (issue #7) -----------------------------------------------------------------


def test_version_and_a_plain_help():
    r = sequester("--version")
    assert (r.returncode, r.stdout.strip()) == (0, f"sequester {sequester_package.__version__}")
    from importlib.metadata import version

    assert sequester_package.__version__ == version("sequester")  # one version: the package's metadata
    r = sequester("--help")
    assert r.returncode == 0 and "``" not in r.stdout and ":mod:" not in r.stdout
    for status in ("0 success", "1 the program failed", "2 bad input", "3 sequester could not run", "130 interrupted"):
        assert status in " ".join(r.stdout.split())  # every exit status, whatever the line breaks


@pytest.mark.parametrize("text, named", [
    ("[episode]\nexec_timeout = 5\n", "unknown table 'episode'"),
    ("[episodes]\nexec_timout = 5\n", "episodes.exec_timout"),
    ("[limits]\nmemory = 5\n", "limits.memory"),
    ("[runtime]\nisolaton = true\n", "runtime.isolaton"),
])
def test_every_command_checks_the_whole_config(tmp_path, text, named):
    config = tmp_path / "c.toml"
    config.write_text(text)
    for argv in (["exec", "-"], ["check"], ["run", str(TASK), "--agent", "nop", "-o", str(tmp_path / "jobs")]):
        r = sequester(argv[0], "--config", str(config), *argv[1:], stdin="print(1)\n")
        assert r.returncode == 2 and named in r.stderr and "Traceback" not in r.stderr, (argv, r.stderr)
    assert not (tmp_path / "jobs").exists()


def test_run_output_that_is_a_file_is_bad_input(tmp_path):
    (tmp_path / "afile").write_text("")
    for output, said in ((tmp_path / "afile", "is not a folder"), (tmp_path / "afile" / "sub", "cannot be made")):
        r = sequester("run", str(TASK), "--agent", "nop", "-o", str(output))
        assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, r.stderr


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


AGENTS = {
    "needs_args": ("class Agent:\n    def __init__(self, model):\n        pass\n    def run(self, i, e):\n        pass\n",
                   "constructed without arguments"),
    "broken": ("class Agent:\n    def run(self,:\n", "broken.py:2: syntax error"),
    "raises": ("raise RuntimeError('no API key')\n", "RuntimeError: no API key"),
    "fails_in_init": ("class Agent:\n    def __init__(self):\n        raise KeyError('model')\n", "KeyError"),
    "no_run": ("class Agent:\n    pass\n", "has no run(instruction, episode)"),
}


@pytest.mark.parametrize("module", sorted(AGENTS))
def test_a_bad_agent_module_is_bad_input(tmp_path, module):
    source, said = AGENTS[module]
    (tmp_path / f"{module}.py").write_text(source)
    r = sequester("run", str(TASK), "--agent", f"{module}:Agent", "-o", str(tmp_path / "jobs"), cwd=tmp_path)
    assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "jobs").exists()


def test_agent_modules_are_found_in_the_current_folder(tmp_path):
    """With -P nothing puts the current folder on sys.path: sequester does, for module:Class."""
    (tmp_path / "my_agent.py").write_text("class Agent:\n    def run(self, instruction, episode):\n        pass\n")
    r = sequester("run", str(TASK), "--agent", "my_agent:Missing", "-o", str(tmp_path / "jobs"), cwd=tmp_path)
    assert r.returncode == 2 and "module 'my_agent' has no 'Missing'" in r.stderr, r.stderr  # found, imported
    r = sequester("run", str(TASK), "--agent", "no_such_agent:Agent", "-o", str(tmp_path / "jobs"), cwd=tmp_path)
    assert r.returncode == 2 and "No module named 'no_such_agent'" in r.stderr  # control
