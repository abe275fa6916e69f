"""Red team (round 23b): the runner's loaders' rewritten default folder
(``/opt/sequester-verifier/a``, commit d8f846c) and the runner's ``find_library``
(``pysite._find_library`` / ``_CtypesUtil``, commit 60c3441), attacked from the agent's
view and from the programs the tests run.

Real episodes on the busybox image with a real verifier, built with the helpers of
``test_installed_libraries_attacks`` (the install is a tar standing in for the task's
image's apt; the host's real ``ensure_runner_libraries`` copies its libraries).

Wins (strict xfails, the mechanism in the reason):

* ``python3 -S`` (and ``-I -S``): the tree's ``python3`` shim adds ``-s`` only; ``-S`` skips
  ``site`` and so the tree's ``sitecustomize``, and with it every one of pysite's guards:
  ``ctypes.util.find_library`` is CPython's, which runs the view's ``/sbin/ldconfig`` and
  returns the path it prints (the agent's library loaded into the runner's Python, 1.0 for
  absent work);
* (residual, strict xfails saying so, and told in the trial's notes) an installed library
  that builds a plugin path at run time from a prefix string the redirection does not see
  (Qt5's ``qt_prfxpath=/usr`` + ``lib/<triplet>/qt5/plugins``): the copy in ``a`` loads the
  system's module, the agent's to change, as under Docker;
* (residual, the same) an installed library that loads modules from a per-user folder or
  file (GStreamer's ``~/.local/share/gstreamer-1.0/plugins``, the Vulkan loader's implicit
  layers): the tests run with the agent's ``HOME``, as under Docker;
* (residual, the same) a test script's own ``export LD_PRELOAD=/app/libhook.so`` (meant for
  the agent's program): every program the script runs after loads it, the runner's Python
  too, as under Docker (every mode);
* a test script's own ``export PYTHONPATH=/app`` (TB2 scripts do): the shims pass it to the
  real Python, whose ``site`` imports the agent's ``/app/sitecustomize.py`` in place of the
  runner's (every mode);
* the task's own ``PYTHONPATH=/app`` (image ENV or ``[verifier] env``), never exported by the
  script: the runner's sitecustomize puts it back for the programs it starts, and a runner
  Python the tests start (``sys.executable`` or ``python3``) imports the agent's
  ``/app/sitecustomize.py`` (every mode);
* a runner Python the tests start as ``sys.executable`` runs without ``-s``: the agent's
  user site (``~/.local/lib/python3.X/site-packages``, HOME being the agent's) runs its
  ``.pth`` import lines at start-up (shared, frozen).

Held (regular tests): the folder ``a`` and its hwcaps subfolders cannot be written or made
when the task installs nothing (the tree's own empty folder) or something; the runner's
``find_library`` answers names with regex metacharacters, a newline, an empty name or a
path with nothing outside its two folders, survives ``importlib.reload`` and an agent's
``/app/ctypes/util.py``; a test script's exported ``LD_LIBRARY_PATH`` naming the agent's
copies of the tree programs' libraries is never searched by the tree's bash, grep, sed,
tar, ls, id, curl (their DT_RPATH comes first and has every name).
"""

from __future__ import annotations

import json
import subprocess

import pytest
from registry import skip_unless_tools

from tests.environments.local.test_installed_libraries_attacks import (
    EVIL_C,
    LDCONFIG,
    TRIPLE,
    _gcc,
    _scenario,
)

MODES = ("shared", "frozen", "separate")
OWNED_IN_RUNNER = "/opt/sequester-verifier/"


def _owned(case: dict) -> str:
    return case.get("files", {}).get("owned.txt", "")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    skip_unless_tools("skopeo", "gcc")
    root = tmp_path_factory.mktemp("red23b")
    libs = root / "libs"
    libs.mkdir()
    (libs / "evil").mkdir()
    evil = _gcc(libs / "evil" / "evil.so", EVIL_C)
    plain = _gcc(libs / "libpkg.so.1", "int pkg_value(void) { return 1; }\n", "-Wl,-soname,libpkg.so.1")
    return root, {"evil": evil, "plain": plain}


# ---------------------------------------------------------------------------------------
# (1) python3 -S: no sitecustomize, so no _CtypesUtil (nor any other guard of pysite).
# ---------------------------------------------------------------------------------------

DASH_S = r"""apt-get install -y pkgfoo
cd /app
python3 -S - <<'PY' && r=1 || r=0
import ctypes, ctypes.util, sys
# As pyzbar, PyOpenGL, python-magic, wand and pyusb load their library.
name = ctypes.util.find_library("pkg")
open("/logs/verifier/found.txt", "w").write(repr(name))
ctypes.CDLL(name or "libpkg.so.1")
sys.exit(0 if open('/app/answer.txt').read().strip() == '42' else 1)
PY
echo $r > /logs/verifier/reward.txt
"""


@pytest.fixture(scope="module")
def dash_s(built):
    root, libs = built
    (root / "ldconfig").write_text(LDCONFIG)
    (root / "keep").write_text("")
    plants = [
        ["/sbin/ldconfig", str(root / "ldconfig"), "755"],
        ["/app/libpkg.x/keep", str(root / "keep"), "644"],
        ["/app/evil.so", str(libs["evil"]), "755"],
    ]
    cases = [{"name": "baseline-shared", "mode": "shared"}]
    cases += [{"name": f"planted-{m}", "mode": m, "plants": plants} for m in MODES]
    return _scenario(
        root / "dash-s",
        root,
        "dash-s",
        image_files={},
        tar=[(f"{TRIPLE}/libpkg.so.1", libs["plain"])],
        cases=cases,
        test_sh=DASH_S,
    )


@pytest.mark.slow
def test_dash_s_baseline_is_an_error_not_a_0(dash_s):
    """Without a plant too: the script's `python3 -S` is the task's set-up failing here."""
    case = dash_s["baseline-shared"]
    assert case["reward"] is None and "python-S" in (case["error"] or ""), case


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["shared", "frozen"])
def test_python_dash_S_never_runs_the_views_ldconfig(dash_s, mode):
    """`python3 -S` is refused by the runner's shims: a set-up failure, an error after the
    pristine re-run (the script is the task's), never the agent's library in the runner."""
    case = dash_s[f"planted-{mode}"]
    assert OWNED_IN_RUNNER not in _owned(case), case
    assert case["reward"] is None and "python-S" in (case["error"] or ""), case


@pytest.mark.slow
def test_python_dash_S_separate(dash_s):
    """Separate: refused the same way."""
    case = dash_s["planted-separate"]
    assert case["reward"] is None and OWNED_IN_RUNNER not in _owned(case), case


# ---------------------------------------------------------------------------------------
# (2) An installed library's plugin path the redirection does not see: built at run time
# from a prefix (Qt5's qt_prfxpath=/usr + lib/<triplet>/qt5/plugins), or read from the
# user's own configuration (ALSA's ~/.asoundrc `lib` entries), with the agent's HOME.
# ---------------------------------------------------------------------------------------

RUNTIME_C = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
/* Qt5Core's shape: the prefix patched in place after the build, the folders relative. */
static const char prefix[] = "qt_prfxpath=/usr";
int pkg_value(void) { return 1; }
__attribute__((constructor)) static void modules(void) {
    char p[1024];
    snprintf(p, sizeof p, "%s/%s", prefix + 12, "lib/x86_64-linux-gnu/pkg-modules/mod.so");
    dlopen(p, RTLD_NOW);
    /* A per-user configuration naming a module to load (GStreamer's user plugins, Vulkan layers). */
    const char *home = getenv("HOME");
    if (home) {
        snprintf(p, sizeof p, "%s/.pkgrc", home);
        FILE *f = fopen(p, "r");
        if (f) {
            char line[512];
            if (fgets(line, sizeof line, f)) { line[strcspn(line, "\n")] = 0; dlopen(line, RTLD_NOW); }
            fclose(f);
        }
    }
}
"""

IMPORT_THEN_CHECK = (
    "apt-get install -y pkgfoo\n"
    'echo "HOME=$HOME" > /logs/verifier/home.txt\n'
    "cp -r /tests/ext /tmp/ext\n"
    "python3 - <<'PY' && r=1 || r=0\n"
    "import os, sys\n"
    "open('/logs/verifier/home.txt', 'a').write('python HOME=' + os.environ.get('HOME', '-') + '\\n')\n"
    "sys.path.insert(0, '/tmp/ext')\n"
    "import pkgcheck._contextvars\n"
    "sys.exit(0 if open('/app/answer.txt').read().strip() == '42' else 1)\n"
    "PY\n"
    "echo $r > /logs/verifier/reward.txt\n"
)


@pytest.fixture(scope="module")
def runtime_paths(built):
    root, libs = built
    runtime = root / "runtime"
    runtime.mkdir()
    lib = _gcc(runtime / "libpkg.so.1", RUNTIME_C, "-Wl,-soname,libpkg.so.1", "-ldl")
    (root / "pkgrc").write_text("/app/evil.so\n")
    prefix = [[f"/{TRIPLE}/pkg-modules/mod.so", str(libs["evil"]), "755"]]
    home = [["/root/.pkgrc", str(root / "pkgrc"), "644"], ["/app/evil.so", str(libs["evil"]), "755"]]
    cases = [{"name": "baseline-shared", "mode": "shared"}]
    cases += [{"name": f"prefix-{m}", "mode": m, "plants": prefix} for m in MODES]
    cases += [{"name": f"home-{m}", "mode": m, "plants": home} for m in MODES]
    # The same with a module that does nothing (the agent's that ends the Python at once also
    # ends its report): the residual, told.
    told = str(libs["plain"])
    cases += [{"name": "prefix-told", "mode": "shared", "plants": [[prefix[0][0], told, "755"]]}]
    cases += [{"name": "home-told", "mode": "shared", "plants": [home[0], ["/app/evil.so", told, "755"]]}]
    return _scenario(
        root / "runtime-paths",
        root,
        "runtime-paths",
        image_files={},
        tar=[(f"{TRIPLE}/libpkg.so.1", lib)],
        cases=cases,
        test_sh=IMPORT_THEN_CHECK,
    )


@pytest.mark.slow
def test_runtime_paths_baseline_scores_0(runtime_paths):
    case = runtime_paths["baseline-shared"]
    assert case["error"] is None and case["reward"] == 0.0, case


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason=(
        "RESIDUAL (docs/security.md, residual risks: native code the tests' imports load): a library the "
        "tests import builds a plugin path at run time from a prefix (Qt5Core's 'qt_prfxpath=/usr' joined with "
        "'lib/<triplet>/qt5/plugins') and loads the system's plugin, the agent's to change, as under Docker; "
        "the trial's notes name it (test below)"
    ),
)
@pytest.mark.parametrize("mode", ["shared", "frozen"])
def test_an_installed_librarys_run_time_plugin_path_never_loads_the_agents_module(runtime_paths, mode):
    case = runtime_paths[f"prefix-{mode}"]
    assert OWNED_IN_RUNNER not in _owned(case), case
    assert case["reward"] == 0.0, case


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason=(
        "RESIDUAL (docs/security.md, residual risks: native code the tests' imports load): the tests run with "
        "the agent's HOME (as under Docker: tests read the agent's files there); a library they import that "
        "reads a per-user folder or configuration naming a module (GStreamer's user plugins, the Vulkan "
        "loader's implicit layers) loads the agent's module into their Python; the trial's notes name it "
        "(test below)"
    ),
)
@pytest.mark.parametrize("mode", ["shared", "frozen"])
def test_an_installed_librarys_user_configuration_never_loads_the_agents_module(runtime_paths, mode):
    case = runtime_paths[f"home-{mode}"]
    assert OWNED_IN_RUNNER not in _owned(case), case
    assert case["reward"] == 0.0, case


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["prefix", "home"])
def test_native_code_the_tests_imports_load_from_the_agents_system_is_named_in_the_notes(runtime_paths, kind):
    """The residual above, told: the trial's notes name the agent's module the tests'
    Python ran (fails without pysite's mapped-code report)."""
    case = runtime_paths[f"{kind}-told"]
    named = [n for n in case["notes"] if "native code from outside the runner's folders" in n]
    assert named, case
    assert ("/usr/lib/" if kind == "prefix" else "/app/evil.so") in named[0], case


@pytest.mark.slow
def test_a_clean_run_names_only_the_native_code_the_tests_load_from_a_folder_the_agent_can_write(runtime_paths):
    """The tests copy their extension into /tmp (a folder the agent writes) and import it:
    that is named; the installed library loaded from the runner's copy is not, nor any file
    of the runner's."""
    case = runtime_paths["baseline-shared"]
    assert not [n for n in case["notes"] if "started with LD_" in n], json.dumps(case)
    native = [n for n in case["notes"] if "native code" in n]
    assert len(native) == 1 and native[0].endswith("/tmp/ext/pkgcheck/_contextvars.cpython-311-x86_64-linux-gnu.so"), (
        json.dumps(case)
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["prefix", "home"])
def test_runtime_paths_separate(runtime_paths, kind):
    """Separate: only /app is copied; /usr/lib and /root are the pristine image's."""
    case = runtime_paths[f"{kind}-separate"]
    assert case["reward"] == 0.0 and OWNED_IN_RUNNER not in _owned(case), case


# ---------------------------------------------------------------------------------------
# (3) Held: the folder a and its hwcaps subfolders, the find_library hook's edges, and a
# script's exported LD_LIBRARY_PATH against the tree's own programs.
# ---------------------------------------------------------------------------------------

EDGES = r"""{install}
L=/opt/sequester-verifier/a
A=/logs/verifier/attempts.txt
ls -la $L > /logs/verifier/before.txt 2>&1
for a in "mkdir -p $L/glibc-hwcaps/x86-64-v3" "mkdir -p $L/glibc-hwcaps/x86-64-v2" "mkdir $L/tls" \
         "mkdir $L/x86_64" "mkdir $L/haswell" "cp /app/evil.so $L/libpkg.so.1" "touch $L/libnew.so.1" \
         "ln -s /app $L/glibc-hwcaps" "mount -t tmpfs none $L/glibc-hwcaps" "mount -t tmpfs none $L" \
         "mount --bind /app $L" "mount -o remount,rw $L" "umount -l $L"; do
  if sh -c "$a" 2>>$A; then echo "DONE: $a" >> $A; fi
done
ls -la $L > /logs/verifier/after.txt 2>&1
# The tree's own programs with the script's own LD_LIBRARY_PATH (the agent's copies of
# their libraries there, named as they are).
export LD_LIBRARY_PATH=/app/lib
T=/logs/verifier/tools.txt
bash -c true; echo "bash $?" >> $T
echo x | grep -P x > /dev/null; echo "grep $?" >> $T
echo x | sed -n 1p > /dev/null; echo "sed $?" >> $T
tar cf /dev/null /tests/test.sh; echo "tar $?" >> $T
ls -l / > /dev/null; echo "ls $?" >> $T
id > /dev/null; echo "id $?" >> $T
curl -s file:///tests/test.sh > /dev/null; echo "curl $?" >> $T
sort /tests/test.sh > /dev/null; echo "sort $?" >> $T
unset LD_LIBRARY_PATH
cd /app
python3 - <<'PY' > /logs/verifier/found.json
import ctypes.util, importlib, json, sys
names = ["pkg", "c", "stdc++", "z", ".*", "p.g", "pkg|evil", "pkg\n", "pkg.so.1\n", "", "..", "pkg/../evil",
         "../../app/evil", "evil", "[a-z]+", "pkg)(", "\\d"]
out = {"names": {repr(n): ctypes.util.find_library(n) for n in names}}
out["hooked"] = ctypes.util.find_library.__code__.co_filename
importlib.reload(ctypes.util)
out["after-reload"] = ctypes.util.find_library.__code__.co_filename
from ctypes import util as u2
out["from-import"] = u2.find_library.__code__.co_filename
out["file"] = ctypes.util.__file__
print(json.dumps(out))
PY
echo 0 > /logs/verifier/reward.txt
"""


@pytest.fixture(scope="module")
def edges(built):
    root, libs = built
    evil = libs["evil"]
    lib_names = [
        "libpcre2-8.so.0",
        "libtinfo.so.6",
        "libselinux.so.1",
        "libacl.so.1",
        "libcurl.so.4",
        "libz.so.1",
        "libnghttp2.so.14",
        "libidn2.so.0",
        "libgcc_s.so.1",
        "libpkg.so.1",
    ]
    plants = [[f"/app/lib/{n}", str(evil), "755"] for n in lib_names]
    plants += [["/app/evil.so", str(evil), "755"]]
    util = root / "ctypes-util.py"
    util.write_text("def find_library(name):\n    return '/app/evil.so'\n")
    plants += [["/app/ctypes/__init__.py", str(util), "644"], ["/app/ctypes/util.py", str(util), "644"]]
    out = {}
    for install, label in (("apt-get install -y pkgfoo", "install"), ("", "none")):
        cases = [{"name": f"{label}-{m}", "mode": m, "plants": plants} for m in ("shared", "frozen")]
        out.update(
            _scenario(
                root / f"edges-{label}",
                root,
                f"edges-{label}",
                image_files={},
                tar=[(f"{TRIPLE}/libpkg.so.1", libs["plain"])],
                cases=cases,
                test_sh=EDGES.replace("{install}", install),
            )
        )
    return out


CASES = [f"{k}-{m}" for k in ("install", "none") for m in ("shared", "frozen")]


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_the_default_folder_and_its_hwcaps_subfolders_cannot_be_written(edges, name):
    case = edges[name]
    assert case["error"] is None, case
    assert "DONE" not in case["files"].get("attempts.txt", ""), case["files"]
    assert case["files"]["before.txt"] == case["files"]["after.txt"], case["files"]


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_an_exported_ld_library_path_never_reaches_the_trees_own_programs(edges, name):
    case = edges[name]
    assert OWNED_IN_RUNNER not in _owned(case), case
    tools = case["files"].get("tools.txt", "")
    assert tools.count(" 0") >= 7, case["files"]


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_find_library_names_nothing_outside_the_runners_folders(edges, name):
    case = edges[name]
    found = json.loads(case["files"]["found.json"].strip().splitlines()[-1])
    for key, value in found["names"].items():
        assert value is None or ("/" not in value and "\n" not in value and value.startswith("lib")), (key, value)
    assert found["names"]["'c'"] == "libc.so.6", found
    if name.startswith("install"):
        assert found["names"][repr("pkg")] == "libpkg.so.1", found
    for key in ("hooked", "after-reload", "from-import"):
        assert found[key].startswith("/opt/sequester-verifier/python/"), found
    assert found["file"].startswith("/opt/sequester-verifier/python/"), found
    assert OWNED_IN_RUNNER not in _owned(case), case


def test_module_imports():
    """(Fast: the helpers this module borrows are there.)"""
    assert callable(_scenario) and subprocess is not None


# ---------------------------------------------------------------------------------------
# (4) The test script's own exported LD_PRELOAD (a task whose tests preload the agent's
# interposer into the programs they check): the shims take the script's LD_LIBRARY_PATH
# out for the runner's programs, not its LD_PRELOAD.
# ---------------------------------------------------------------------------------------

PRELOAD = r"""apt-get install -y pkgfoo
export LD_PRELOAD=/app/libhook.so
/app/prog > /tmp/out.txt 2>&1 || true
python3 - <<'PY' && r=1 || r=0
import sys
sys.exit(0 if open('/app/answer.txt').read().strip() == '42' else 1)
PY
echo $r > /logs/verifier/reward.txt
"""


@pytest.fixture(scope="module")
def preload(built):
    root, libs = built
    (root / "prog").write_text("#!/bin/sh\necho hello\n")
    plants = [["/app/libhook.so", str(libs["evil"]), "755"], ["/app/prog", str(root / "prog"), "755"]]
    cases = [{"name": f"preload-{m}", "mode": m, "plants": plants} for m in MODES]
    told = [["/app/libhook.so", str(libs["plain"]), "755"], plants[1]]
    cases += [{"name": "preload-told", "mode": "shared", "plants": told}]
    return _scenario(
        root / "preload",
        root,
        "preload",
        image_files={},
        tar=[(f"{TRIPLE}/libpkg.so.1", libs["plain"])],
        cases=cases,
        test_sh=PRELOAD,
    )


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason=(
        "RESIDUAL (docs/security.md, residual risks: native code the tests' imports load): the test script's "
        "own `export LD_PRELOAD=/app/libhook.so` puts the agent's library into every program it runs after, "
        "the runner's Python too, as under Docker (the script's choice; its starting environment has none); "
        "the trial's notes name it (test below)"
    ),
)
@pytest.mark.parametrize("mode", MODES)
def test_a_scripts_own_ld_preload_never_reaches_the_runners_programs(preload, mode):
    case = preload[f"preload-{mode}"]
    assert OWNED_IN_RUNNER not in _owned(case), case
    assert case["reward"] == 0.0, case


@pytest.mark.slow
def test_a_scripts_own_ld_preload_in_the_runners_python_is_named_in_the_notes(preload):
    """The residual above, told: the notes name the variable and the agent's library (fails
    without pysite's report), here one that does nothing (one that ends the Python at once
    ends its report too: information only)."""
    case = preload["preload-told"]
    assert any("LD_PRELOAD=/app/libhook.so" in n for n in case["notes"]), json.dumps(case)
    assert any("native code" in n and "/app/libhook.so" in n for n in case["notes"]), case


# ---------------------------------------------------------------------------------------
# (5) The test script's own exported PYTHONPATH (TB2 scripts: `export PYTHONPATH=/app`):
# the runner's environment carries the task's as SEQUESTER_PYTHONPATH, but the shims pass
# the script's own straight to the real Python, where `site` imports sitecustomize from it.
# ---------------------------------------------------------------------------------------

PYTHONPATH_SH = r"""cd /app
export PYTHONPATH=/app
python3 - <<'PY' && r=1 || r=0
import sys
sys.exit(0 if open('/app/answer.txt').read().strip() == '42' else 1)
PY
echo $r > /logs/verifier/reward.txt
"""
AGENT_SITECUSTOMIZE = (
    "import os, sys\n"
    "open('/logs/verifier/owned.txt', 'a').write(sys.executable + '\\n')\n"
    "if sys.executable.startswith('/opt/sequester-verifier/'):\n"
    "    os._exit(0)\n"
)


@pytest.fixture(scope="module")
def exported_pythonpath(built):
    root, libs = built
    (root / "sitecustomize.py").write_text(AGENT_SITECUSTOMIZE)
    plants = [["/app/sitecustomize.py", str(root / "sitecustomize.py"), "644"]]
    cases = [{"name": f"pythonpath-{m}", "mode": m, "plants": plants} for m in MODES]
    return _scenario(
        root / "pythonpath",
        root,
        "pythonpath",
        image_files={},
        tar=[(f"{TRIPLE}/libpkg.so.1", libs["plain"])],
        cases=cases,
        test_sh=PYTHONPATH_SH,
    )


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_scripts_own_pythonpath_never_replaces_the_runners_sitecustomize(exported_pythonpath, mode):
    case = exported_pythonpath[f"pythonpath-{mode}"]
    assert OWNED_IN_RUNNER not in _owned(case), case
    assert case["reward"] == 0.0, case


# The task's own PYTHONPATH (image ENV or [verifier] env: PYTHONPATH=/app), which the
# script never exports: the runner's environment carries it as SEQUESTER_PYTHONPATH, and
# the runner's sitecustomize puts PYTHONPATH back for every program it starts; a runner
# Python the tests start (sys.executable, or python3 through the shim) gets it at start-up.
CHILD_SH = r"""cd /app
python3 - <<'PY' && r=1 || r=0
import subprocess, sys
check = "import sys; sys.exit(0 if open('/app/answer.txt').read().strip() == '42' else 1)"
a = subprocess.run([sys.executable, "-c", check]).returncode
b = subprocess.run(["python3", "-c", check]).returncode
open("/logs/verifier/child.txt", "w").write(f"{a} {b}\n")
sys.exit(a or b)
PY
echo $r > /logs/verifier/reward.txt
"""


@pytest.fixture(scope="module")
def task_pythonpath(built):
    import tests.environments.local.test_installed_libraries_attacks as base

    root, libs = built
    (root / "sitecustomize.py").write_text(AGENT_SITECUSTOMIZE)
    original = base._task

    def task_with_env(*args, **kwargs):
        task = original(*args, **kwargs)
        toml = task / "task.toml"
        toml.write_text(toml.read_text().replace("[verifier]\n", '[verifier]\nenv = { PYTHONPATH = "/app" }\n'))
        return task

    mp = pytest.MonkeyPatch()
    mp.setattr(base, "_task", task_with_env)
    plants = [["/app/sitecustomize.py", str(root / "sitecustomize.py"), "644"]]
    cases = [{"name": "baseline-shared", "mode": "shared"}]
    cases += [{"name": f"child-{m}", "mode": m, "plants": plants} for m in MODES]
    try:
        return _scenario(
            root / "task-pythonpath",
            root,
            "task-pythonpath",
            image_files={},
            tar=[(f"{TRIPLE}/libpkg.so.1", libs["plain"])],
            cases=cases,
            test_sh=CHILD_SH,
        )
    finally:
        mp.undo()


@pytest.mark.slow
def test_task_pythonpath_baseline_scores_0(task_pythonpath):
    case = task_pythonpath["baseline-shared"]
    assert case["error"] is None and case["reward"] == 0.0, case


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_runner_python_started_by_the_tests_never_imports_the_agents_sitecustomize(task_pythonpath, mode):
    case = task_pythonpath[f"child-{mode}"]
    assert OWNED_IN_RUNNER not in _owned(case), case
    assert case["reward"] == 0.0, case


# ---------------------------------------------------------------------------------------
# (6) A runner Python the tests start as sys.executable runs without -s: the user site of
# the agent's HOME (given back to the runner's Pythons) is on, and its .pth import lines
# and usercustomize run at start-up.
# ---------------------------------------------------------------------------------------

USER_SITE_SH = r"""cd /tests
python3 - <<'PY' && r=1 || r=0
import subprocess, sys
check = "import sys; sys.exit(0 if open('/app/answer.txt').read().strip() == '42' else 1)"
sys.exit(subprocess.run([sys.executable, "-c", check]).returncode)
PY
echo $r > /logs/verifier/reward.txt
"""
AGENT_PTH = (
    "import os, sys; open('/logs/verifier/owned.txt', 'a').write(sys.executable + '\\n'); "
    "sys.executable.startswith('/opt/sequester-verifier/') and os._exit(0)\n"
)


@pytest.fixture(scope="module")
def user_site_pth(built):
    root, libs = built
    (root / "evil.pth").write_text(AGENT_PTH)
    (root / "usercustomize.py").write_text(AGENT_SITECUSTOMIZE)
    plants = []
    for version in ("3.11", "3.13"):
        site = f"/root/.local/lib/python{version}/site-packages"
        plants += [[f"{site}/evil.pth", str(root / "evil.pth"), "644"]]
        plants += [[f"{site}/usercustomize.py", str(root / "usercustomize.py"), "644"]]
    cases = [{"name": "baseline-shared", "mode": "shared"}]
    cases += [{"name": f"usersite-{m}", "mode": m, "plants": plants} for m in MODES]
    return _scenario(
        root / "user-site",
        root,
        "user-site",
        image_files={},
        tar=[(f"{TRIPLE}/libpkg.so.1", libs["plain"])],
        cases=cases,
        test_sh=USER_SITE_SH,
    )


@pytest.mark.slow
def test_user_site_baseline_scores_0(user_site_pth):
    case = user_site_pth["baseline-shared"]
    assert case["error"] is None and case["reward"] == 0.0, case


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["shared", "frozen"])
def test_a_runner_python_started_as_sys_executable_runs_no_user_site_of_the_agents(user_site_pth, mode):
    case = user_site_pth[f"usersite-{mode}"]
    assert OWNED_IN_RUNNER not in _owned(case), case
    assert case["reward"] == 0.0, case


@pytest.mark.slow
def test_user_site_separate(user_site_pth):
    """Separate: only /app is copied; the agent's /root/.local is not there."""
    case = user_site_pth["usersite-separate"]
    assert case["reward"] == 0.0 and OWNED_IN_RUNNER not in _owned(case), case
