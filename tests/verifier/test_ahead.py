"""What the runner installs for a test script before it runs (:mod:`sequester.verifier.ahead`):
read from the script's text, pure; and the shims finding what was installed ahead."""

from __future__ import annotations

import subprocess

from sequester.verifier import ahead, layout
from sequester.verifier.ahead import SEPARATOR, Tool, plan
from sequester.verifier.environ import runner_env
from sequester.verifier.image_python import IMAGE_PYTHON_VAR, IMAGE_SITE_VAR

TB2 = """#!/bin/bash
apt-get update
apt-get install -y curl
curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh
source $HOME/.local/bin/env
uvx \\
  -p 3.13 \\
  -w pytest==8.4.1 \\
  -w pytest-json-ctrf==0.3.5 \\
  pytest --ctrf /logs/verifier/ctrf.json /tests/test_outputs.py -rA
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""


def test_tb2s_uvx_line_is_installed_ahead_with_its_own_options():
    got = plan(TB2)
    words = ("-p", "3.13", "-w", "pytest==8.4.1", "-w", "pytest-json-ctrf==0.3.5", "pytest")
    uv_args = ("tool", "run", *words[:-1], "--from", "pytest", str(layout.BIN / "env"))
    assert got.tools == (Tool(words, "pytest", uv_args),)
    assert got.pip_lines == () and not got.pytest


def test_a_tool_with_from_or_a_version_runs_its_command():
    got = plan("uvx --from ruff==0.5.0 ruff check .\nuvx pytest@8.4.1 -q\nuvx -w numpy pytest@latest x\n")
    assert [(t.words, t.command) for t in got.tools] == [
        (("--from", "ruff==0.5.0", "ruff"), "ruff"),
        (("pytest@8.4.1",), "pytest"),
        (("-w", "numpy", "pytest@latest"), "pytest"),
    ]
    env = str(layout.BIN / "env")
    assert got.tools[0].uv_args == ("tool", "run", "--from", "ruff==0.5.0", env)
    assert got.tools[1].uv_args[-3:] == ("--from", "pytest@8.4.1", env)
    assert got.tools[2].uv_args[-3:] == ("--from", "pytest", env)


def test_what_a_shell_would_expand_is_made_as_the_script_runs():
    script = (
        'uvx -w "$PKG" pytest x\nuvx --with ${DEP} pytest\nuvx -w numpy* pytest\nUV_PYTHON=3.12 uvx pytest\n'
        "uvx python -c 1\nuvx\nuvx -w a -- pytest\npip install \"$X\"\n"
    )
    got = plan(script)
    assert got.tools == () and got.pip_lines == ()


def test_the_scripts_beside_test_sh_are_read_too():
    got = plan("bash /tests/run.sh\n", "pip install numpy==2.0.0\npytest /tests -rA\n")
    assert got.pip_lines == (("numpy==2.0.0",),) and got.pytest


def test_pip_lines_in_order_and_pytest_when_the_script_runs_it():
    got = plan(
        "pip install pytest==8.4.1 pytest-json-ctrf==0.3.5 --break-system-packages\n"
        "pip3 install -q numpy==2.0.0\npip install pytest==8.4.1 pytest-json-ctrf==0.3.5 --break-system-packages\n"
        "pip list\n"
    )
    assert got.pip_lines == (
        ("pytest==8.4.1", "pytest-json-ctrf==0.3.5", "--break-system-packages"),
        ("-q", "numpy==2.0.0"),
    )
    assert not got.pytest
    assert plan("cd /app && python3 -m pytest /tests -rA\n").pytest
    assert plan("timeout 60 pytest /tests\n").pytest
    assert not plan("echo pytest\n")


def test_the_request_names_the_runners_folders_and_pins_pytest_last():
    got = ahead.request(plan("pip install numpy==2.0.0\npytest /tests\n" + TB2), {"HOME": "/x"})
    steps = got["steps"]
    assert isinstance(steps, list)
    assert steps[0]["argv"][0] == str(layout.LIBEXEC / "uv") and steps[0]["tool"]["command"] == "pytest"
    assert steps[1] == {"argv": [str(layout.BIN / "pip"), "install", "numpy==2.0.0"], "pip_line": ["numpy==2.0.0"]}
    assert steps[2]["pip_line"] == ["pytest==8.4.1"] and steps[2]["unless"] == str(layout.RUN_PIP / "bin" / "pytest")
    # While it installs, nothing of the view's PATH (red team: the agent's printenv ran).
    assert got["env"] == {"HOME": "/x", "UV_CACHE_DIR": str(layout.RUN_CACHE), "UV_TOOL_DIR": str(layout.RUN_TOOLS),
                          "SEQUESTER_PIP_ENV": str(layout.RUN_PIP), "PATH": str(layout.BIN)}
    assert got["roots"] == [str(layout.RUN_CACHE), str(layout.RUN_TOOLS)]
    assert got["index"] == str(layout.TOOL_INDEX) and got["separator"] == SEPARATOR


def test_the_installs_get_nothing_of_the_images_environment():
    """Red team: the image's PYTHONPATH (/app) reached uv's interpreter query, which
    imported the agent's /app/_manylinux.py while the runner's folder was writable."""
    runner = runner_env({"PYTHONPATH": "/app", "UV_PYTHON": "/app/python", "VIRTUAL_ENV": "/app/v",
                         "PIP_INDEX_URL": "http://x", "LD_PRELOAD": "/app/x.so"}, {"UV_CONSTRAINT": "/app/c"},
                        runner_fd=3)
    env = ahead.install_env({**runner, IMAGE_PYTHON_VAR: "3.13", IMAGE_SITE_VAR: "/usr/lib/python3/dist-packages"})
    assert not {k for k in env if "PYTHONPATH" in k or k in ("UV_PYTHON", "VIRTUAL_ENV", "PIP_INDEX_URL",
                                                                "UV_CONSTRAINT", "BASH_ENV", IMAGE_SITE_VAR)}
    assert not any(k.startswith("SEQUESTER_") and k not in (IMAGE_PYTHON_VAR, "SEQUESTER_PIP_ENV") for k in env)
    assert env["PATH"] == str(layout.BIN) and env["UV_OFFLINE"] == "1" and env[IMAGE_PYTHON_VAR] == "3.13"


def test_words_naming_files_are_not_installed_ahead():
    """What a path names is the agent's (a setup.py would run while the folder is writable)."""
    got = plan("pip install -r /app/req.txt\npip install ./pkg\npip install -e /app\nuvx --from /app/x x\n"
               "uvx -w ~/w.whl pytest\npip install pkg/sub\n")
    assert got.tools == () and got.pip_lines == ()
    assert plan("uvx --index https://download.pytorch.org/whl/cpu -w torch==2.5.0 pytest\n").tools


def _uvx_lookup(index: str, args: list[str]) -> str:
    """The runner's uvx lookup (the shim's own text) against ``index``, in bash: what it
    would run, or "fallback"."""
    from sequester.verifier.shims import _UVX_AHEAD

    run = 'exec "$__b/$__c" "$@"'
    assert run in _UVX_AHEAD
    text = _UVX_AHEAD.replace(str(layout.TOOL_INDEX), index).replace(run, 'echo "$__b/$__c" "$@"; exit 0')
    script = "__sequester_say() { :; }\n" + text + 'echo "fallback $*"\n'
    done = subprocess.run(["bash", "-c", script, "uvx", *args], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_the_runners_uvx_runs_what_was_installed_ahead_for_exactly_its_words(tmp_path):
    env = tmp_path / "env" / "bin"
    env.mkdir(parents=True)
    (env / "pytest").write_text("#!/bin/sh\n")
    (env / "pytest").chmod(0o755)
    index = tmp_path / "index"
    words = ["-p", "3.13", "-w", "pytest==8.4.1", "pytest"]
    index.write_text(f"{env}\tpytest\t{SEPARATOR.join(words)}\n")
    assert _uvx_lookup(str(index), [*words, "/tests/t.py", "-rA"]) == f"{env}/pytest /tests/t.py -rA"
    assert _uvx_lookup(str(index), words) == f"{env}/pytest"
    assert _uvx_lookup(str(index), ["-p", "3.12", "-w", "pytest==8.4.1", "pytest", "x"]).startswith("fallback")
    assert _uvx_lookup(str(index), ["-p", "3.13", "pytest"]).startswith("fallback")
    assert _uvx_lookup(str(tmp_path / "none"), words).startswith("fallback")


def test_a_tool_whose_install_ahead_failed_is_a_set_up_failure_never_made_as_the_script_runs(tmp_path):
    """Red team: an agent made the install ahead fail (a jemalloc setting of the view's
    aborted uv); the runner's uvx then made the tool as the script ran, where the agent's
    program could write, and the failing tests passed."""
    from sequester.verifier.shims import _UVX_AHEAD

    index = tmp_path / "index"
    words = ["-w", "pytest==8.4.1", "pytest"]
    index.write_text(f"-\tpytest\t{SEPARATOR.join(words)}\n")
    said = tmp_path / "said"
    script = (f'__sequester_say() {{ echo "$1" >> {said}; }}\n' + _UVX_AHEAD.replace(str(layout.TOOL_INDEX), str(index))
              + 'echo "fallback $*"\n')
    done = subprocess.run(["bash", "-c", script, "uvx", *words, "/tests/t.py"], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 1 and "fallback" not in done.stdout
    assert said.read_text().split() == ["setup-failed:uvx-ahead"]
