"""The runner's sitecustomize as written into a tree: it compiles (a Python that cannot
run it only warns, and would run with none of its guards), and its reports of native code
from outside the runner's folders name what a real process mapped."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sequester.verifier import pysite


def test_the_written_sitecustomize_compiles(tmp_path):
    pysite.write_sitecustomize(tmp_path, probed={"numpy"})
    text = (tmp_path / "sitecustomize.py").read_text()
    compile(text, "sitecustomize.py", "exec")
    assert "'numpy'" in text


def test_a_sitecustomize_that_does_not_compile_is_never_written(tmp_path, monkeypatch):
    monkeypatch.setattr(pysite, "SITECUSTOMIZE", pysite.SITECUSTOMIZE + "\nx = 'unterminated\n")
    with pytest.raises(SyntaxError):
        pysite.write_sitecustomize(tmp_path)
    assert not (tmp_path / "sitecustomize.py").exists()


@pytest.mark.parametrize("preload", [False, True])
def test_a_python_running_it_tells_its_preload_and_the_native_code_it_mapped_from_outside(tmp_path, preload):
    """A real Python with the written sitecustomize on its path and the report pipe: at exit
    it names the extension module it loaded from outside /opt/sequester-verifier (this
    Python's own _json, its standard library being outside), and an LD_PRELOAD it started
    with."""
    pysite.write_sitecustomize(tmp_path)
    r, w = os.pipe()
    env = {"PATH": os.environ.get("PATH", ""), pysite.RUNNER_FD_VAR: str(w), "PYTHONPATH": str(tmp_path)}
    libc = next(p for p in ("/lib/x86_64-linux-gnu/libc.so.6", "/lib/aarch64-linux-gnu/libc.so.6") if os.path.exists(p))
    if preload:
        env["LD_PRELOAD"] = libc
    proc = subprocess.run([sys.executable, "-c", "import _json, sys; sys.exit(0)"], env=env, pass_fds=[w], timeout=60)
    os.close(w)
    with os.fdopen(r, "rb") as said:
        words = said.read().decode().split()
    assert proc.returncode == 0
    native = [x.partition(":")[2] for x in words if x.startswith("agent-native:")]
    assert native and all(not p.startswith("/opt/sequester-verifier/") for p in native), words
    assert any(p.endswith("libc.so.6") for p in native), words
    assert (f"agent-preload:LD_PRELOAD={libc}" in words) == preload, words
