"""View templates on hosts shaped like real ones (:mod:`sequester.kernel.template`): root's
container storage mounted below a folder only root may enter (podman's
``/var/lib/containers``, 0700; Docker's ``/var/lib/docker``, 0710), a hidden folder with a
mount below it, and a host whose view the keeper cannot make at all. A kernel starts on
each, through every first stage, for a root caller and an ordinary one; where no
template can be made it has a bwrap of its own and says why.

The host shapes are made in a private mount namespace of the test's own (root only):
nothing of them is seen outside it, and nothing is left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conditions import requires_root
from nobody_site import NOBODY, SYSTEM_PYTHON, copy_packages
from stages import STAGES, native_available

ROOT = os.geteuid() == 0

pytestmark = [requires_root, pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare")]

# Run by the caller (root here, or nobody on a copy of sequester) in the mount namespace
# the driver made: a kernel of each stage, and what it sees of the storage.
KERNEL = r'''
import json, os, sys
stage, hide = sys.argv[1], sys.argv[2:]
os.environ["SEQUESTER_NATIVE_STAGE"] = "0" if stage == "python" else "1"
os.environ["SEQUESTER_VIEW_TEMPLATE"] = "1" if stage == "template" else "0"
from sequester import Kernel, Policy, SandboxError
out = {}
try:
    with Kernel(Policy(isolation=True, hide=hide)) as k:
        r = k.run("import os\ntry:\n    os.listdir(STORE + '/overlay')\n    SEEN = 'listed'\nexcept OSError as e:\n"
                  "    SEEN = type(e).__name__\nSEEN".replace("STORE", repr(os.environ["STORE"])), timeout=30)
        out = {"view": k.report.get("view"), "note": k.report.get("view_note"), "stage": k.report["first_stage"],
               "storage": r.value if r.error is None else f"{r.error.type}: {r.error.message}"}
except SandboxError as exc:
    out = {"failed": str(exc)}
print(json.dumps(out))
'''

# ``sequester check --json``'s content (the command is a thin layer over run_check; the
# copied site has no rich for its table).
CHECK = r'''
import json
from sequester import Policy
from sequester.kernel.check import run_check
report = run_check(Policy())
print(json.dumps({"passed": report.passed, "view": report.view, "view_note": report.view_note,
                  "findings": [vars(f) for f in report.findings]}))
'''

# Run as root in a new mount namespace: the host's shape, then every flow in it.
DRIVER = r'''
import json, os, subprocess, sys, tempfile
shape, site, kernel_py, check_py = sys.argv[1:5]
store = "/var/lib/seqtest-" + str(os.getpid())
os.makedirs(store + "/overlay")
os.makedirs(store + "/volume")
os.chmod(store, 0o700)
def sh(*argv):
    subprocess.run(argv, check=True)
if shape == "storage":
    sh("mount", "-t", "tmpfs", "-o", "size=1m", "seqtest-overlay", store + "/overlay")
    sh("mount", "--bind", store + "/volume", store + "/volume")
elif shape == "too-many-mounts":
    os.chmod(store, 0o755)
    for _ in range(4100):  # more than a keeper reads (stage0_template.c: 4096)
        sh("mount", "-t", "tmpfs", "-o", "size=4k", "seqtest-many", store + "/overlay")
env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "LANG": "C.UTF-8", "STORE": store}
results = {}
def run(who, argv):
    home = os.path.join(site, "home")
    if who == "root":
        proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=600,
                              env={**env, "HOME": tempfile.mkdtemp(prefix="seqtest-home-"), "PYTHONPATH": os.environ["ROOT_PATH"]})
    else:
        proc = subprocess.run(["/usr/bin/python3", "-B", *argv], capture_output=True, text=True, timeout=600,
                              user=65534, group=65534, extra_groups=[], cwd=site,
                              env={**env, "HOME": home, "PYTHONPATH": site})
    for text in (proc.stdout, (proc.stdout.strip().splitlines() or [""])[-1]):  # check's JSON spans lines
        try:
            return json.loads(text)
        except ValueError:
            continue
    return {"stdout": proc.stdout[-2000:], "stderr": proc.stderr[-2000:], "rc": proc.returncode}
for who in ("root", "nobody"):
    for stage in json.loads(os.environ["STAGES"]):
        results[f"{who}/{stage}"] = run(who, [kernel_py, stage])
        if shape == "storage":
            results[f"{who}/{stage}/hidden"] = run(who, [kernel_py, stage, store])
    results[f"{who}/check"] = run(who, [check_py])
print(json.dumps(results))
'''


def _drive(shape: str, tmp_path: Path) -> dict:
    if not SYSTEM_PYTHON.exists():
        pytest.skip("the ordinary caller runs on /usr/bin/python3, which is missing")
    stages = [s for s in STAGES if s == "python" or native_available()]
    site = Path(tempfile.mkdtemp(prefix="seq-site-", dir="/var/tmp"))
    try:
        copy_packages(site)
        (site / "home").mkdir()
        for name, text in (("kernel.py", KERNEL), ("check.py", CHECK), ("driver.py", DRIVER)):
            (site / name).write_text(text)
        for root, _dirs, files in os.walk(site):
            os.chmod(root, 0o755)
            for f in files:
                os.chmod(Path(root, f), 0o755 if f in ("bwrap", "uv", "uvx", "patchelf") else 0o644)
        os.chown(site / "home", NOBODY, NOBODY)
        os.chmod(site / "home", 0o700)
        import sequester

        env = {**os.environ, "STAGES": json.dumps(stages), "ROOT_PATH": str(Path(sequester.__file__).parent.parent)}
        proc = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", sys.executable, str(site / "driver.py"), shape,
             str(site), str(site / "kernel.py"), str(site / "check.py")],
            capture_output=True, text=True, timeout=1800, env=env,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(site, ignore_errors=True)
        for left in Path("/var/lib").glob("seqtest-*"):  # the driver's folder (its mounts died with it)
            shutil.rmtree(left, ignore_errors=True)


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> dict:
    return _drive("storage", tmp_path_factory.mktemp("storage"))


@pytest.mark.slow
@pytest.mark.parametrize("who", ["root", "nobody"])
@pytest.mark.parametrize("stage", STAGES)
def test_a_kernel_starts_beside_roots_container_storage(storage, who, stage):
    """Root's storage with a tmpfs and a bind mount below a 0700 folder: the kernel starts
    (before, an ordinary caller's template failed: "making the view read-only at
    .../overlay: Permission denied"), from the template where the stage has one, and
    cannot reach the storage (the folder on the way refuses it, as on the host)."""
    out = storage.get(f"{who}/{stage}")
    if out is None:
        pytest.skip("the native stage cannot be built here")
    assert "failed" not in out, out
    assert out["view"] == ("template" if stage == "template" else "bwrap") and out["note"] is None, out
    assert out["storage"] == "'PermissionError'", out


@pytest.mark.slow
@pytest.mark.parametrize("who", ["root", "nobody"])
@pytest.mark.parametrize("stage", STAGES)
def test_a_kernel_starts_with_the_storage_folder_hidden(storage, who, stage):
    """``hide`` of the storage folder: the mounts below it are under the cover, out of
    reach (before: "No such file or directory" from the template's keeper)."""
    out = storage.get(f"{who}/{stage}/hidden")
    if out is None:
        pytest.skip("the native stage cannot be built here")
    assert "failed" not in out, out
    assert out["view"] == ("template" if stage == "template" else "bwrap"), out
    assert out["storage"] == "'FileNotFoundError'", out


@pytest.mark.slow
@pytest.mark.parametrize("who", ["root", "nobody"])
def test_sequester_check_passes_beside_roots_container_storage(storage, who):
    out = storage[f"{who}/check"]
    assert out.get("passed") is True, [f for f in out.get("findings", [out]) if not f.get("passed", False)]
    assert out["view"] == ("template" if native_available() else "bwrap")


@pytest.mark.slow
def test_a_view_no_template_can_hold_falls_back_to_a_bwrap_per_kernel(tmp_path):
    """A host whose view the keeper cannot make (more mounts than it reads): every kernel
    still starts, with a bwrap of its own, and says why in its report and in ``sequester
    check``; never a failed start."""
    if not native_available():
        pytest.skip("the native stage cannot be built here: no templates")
    out = _drive("too-many-mounts", tmp_path)
    for who in ("root", "nobody"):
        kernel = out[f"{who}/template"]
        assert "failed" not in kernel, kernel
        assert kernel["view"] == "bwrap" and "too many mounts" in (kernel["note"] or ""), kernel
        check = out[f"{who}/check"]
        assert check.get("passed") is True and "too many mounts" in (check.get("view_note") or ""), check


# -- the keeper's "unreachable" skip --------------------------------------------------

# A kernel's look at a host file on a mount of the view: the mount's flags, and whether it
# can change the file past Landlock (extended attribute, timestamps).
MOUNT_PROBE = r"""
import os
p = FILE
def attempt(call):
    try:
        call()
        return "changed"
    except OSError as e:
        return type(e).__name__ + ":" + str(e.errno)
flags = [l.split()[5].split(",")[0] for l in open("/proc/self/mountinfo") if " " + BOX + " " in l]
(flags, attempt(lambda: os.setxattr(p, "user.from_kernel", b"x")), attempt(lambda: os.utime(p)))
"""

ROOT_DRIVER = r'''
import json, os, subprocess, sys
stages = sys.argv[1:]
store = "/var/lib/seqrt-%d" % os.getpid()
box = store + "/inner/box"
os.makedirs(box)
# The folder on the way: its owner an id no namespace maps, its group root (no access),
# others may search. A root caller's bwrap and keeper (uid 0, gid 0, no DAC capability
# over an unmapped owner) cannot enter it; the kernel (nobody, KERNEL_HOST_ID) can.
os.chown(store + "/inner", 1234, 0)
os.chmod(store + "/inner", 0o701)
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=1777", "seqrt-box", box], check=True)
open(box + "/shared", "w").close()
os.chmod(box + "/shared", 0o666)
from sequester import Kernel, Policy
out = {}
try:
    for stage in stages:
        os.environ["SEQUESTER_NATIVE_STAGE"] = "0" if stage == "python" else "1"
        os.environ["SEQUESTER_VIEW_TEMPLATE"] = "1" if stage == "template" else "0"
        with Kernel(Policy()) as k:
            code = os.environ["PROBE"].replace("FILE", repr(box + "/shared")).replace("BOX", repr(box))
            r = k.run(code, timeout=30)
            out[stage] = {"view": k.report.get("view"), "note": k.report.get("view_note"),
                          "seen": eval(r.value) if r.error is None else str(r.error)}
    out["host_xattrs"] = os.listxattr(box + "/shared")
finally:
    subprocess.run(["umount", box])
    import shutil
    shutil.rmtree(store)
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def root_below_others_only() -> dict:
    if not ROOT or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare (a private mount namespace of the test's own)")
    stages = [s for s in STAGES if s == "python" or native_available()]
    import sequester

    env = {**os.environ, "PROBE": MOUNT_PROBE, "PYTHONPATH": str(Path(sequester.__file__).parent.parent)}
    argv = ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", ROOT_DRIVER, *stages]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@requires_root
@pytest.mark.parametrize("stage", STAGES)
def test_root_callers_kernel_gets_no_writable_mount_its_keeper_could_not_reach(root_below_others_only, stage):
    """The keeper decides "unreachable, so for every kernel" as uid 0 without
    CAP_DAC_OVERRIDE; a root caller's kernel is another identity (nobody), and permission
    bits are not monotone (owner/group denied, others allowed). The mount stays rw in the
    view; each kernel sets an xattr and a timestamp on the host's file (Landlock does not
    cover either), and sees the others' (a channel between kernels). Before the change the
    template failed closed ("making the view read-only at ...: Permission denied"). The
    bwrap stages ("native", "python") have the same hole from bwrap's own EACCES skip:
    pre-existing, and the fallback path of the change."""
    out = root_below_others_only
    if stage not in out:
        pytest.skip("the native stage cannot be built here")
    seen = out[stage]["seen"]
    assert isinstance(seen, list), seen
    flags, xattr, utime = seen
    assert flags and all(f == "ro" for f in flags), (stage, out)
    assert xattr.startswith("OSError:30") and utime.startswith("OSError:30"), (stage, out)  # EROFS


USER_HARNESS = r'''
import json, os, sys
os.environ["SEQUESTER_NATIVE_STAGE"] = "1"
probe, box = os.environ["PROBE"], os.environ["BOX"]
from sequester import Kernel, Policy
code = probe.replace("FILE", repr(box + "/shared")).replace("BOX", repr(box))
def look(k):
    r = k.run(code, timeout=30)
    return {"view": k.report.get("view"), "seen": r.value if r.error is None else f"{r.error.type}: {r.error.message}"}
out = {}
os.environ["SEQUESTER_VIEW_TEMPLATE"] = "1"
with Kernel(Policy()) as first:                  # the view's template is made now
    out["before"] = look(first)
    print("made", flush=True)
    sys.stdin.readline()                          # the host opens the folder meanwhile
    with Kernel(Policy()) as later:               # a later kernel of the same view
        out["template"] = look(later)
os.environ["SEQUESTER_VIEW_TEMPLATE"] = "0"
with Kernel(Policy()) as own:                     # a bwrap of its own, for comparison
    out["bwrap"] = look(own)
print(json.dumps(out), flush=True)
'''

USER_DRIVER = r'''
import os, subprocess, sys
site = sys.argv[1]
store = "/var/lib/seqrt-%d" % os.getpid()
box = store + "/box"
os.makedirs(box)
os.chmod(store, 0o700)                            # root's, like /var/lib/containers
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=1777", "seqrt-box", box], check=True)
open(box + "/shared", "w").close()
os.chmod(box + "/shared", 0o666)
env = {"PATH": "/usr/bin:/bin", "HOME": site + "/home", "PYTHONPATH": site, "LANG": "C.UTF-8",
       "PROBE": os.environ["PROBE"], "BOX": box}
try:
    proc = subprocess.Popen(["/usr/bin/python3", "-B", site + "/harness.py"], user=65534, group=65534,
                            extra_groups=[], cwd=site, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    made = proc.stdout.readline()
    os.chmod(store, 0o755)                        # later: the folder may be entered
    out, err = proc.communicate("go\n", timeout=300)
    sys.stderr.write(err[-3000:])
    print((made + out).strip().splitlines()[-1])
finally:
    subprocess.run(["umount", box])
    import shutil
    shutil.rmtree(store)
'''


@pytest.mark.slow
@requires_root
def test_a_later_kernel_of_a_view_gets_no_writable_mount_the_host_opened_since(tmp_path):
    """The keeper's skip is decided once per
    view: a mount below a folder the caller could not enter when the template was made
    (root's 0700 storage) stays rw for the view's lifetime. Once the folder may be entered
    (chmod, a rename), every later kernel of the view gets the mount writable and changes
    host files on it past Landlock (for an ordinary caller also chmod/chown of its own
    files); a bwrap started then would have remounted it read-only."""
    if not native_available() or not SYSTEM_PYTHON.exists() or shutil.which("unshare") is None:
        pytest.skip("needs the native stage, /usr/bin/python3 and unshare")
    site = Path(tempfile.mkdtemp(prefix="seq-rt-site-", dir="/var/tmp"))
    try:
        copy_packages(site)
        (site / "home").mkdir()
        (site / "harness.py").write_text(USER_HARNESS)
        for root, _dirs, files in os.walk(site):
            os.chmod(root, 0o755)
            for f in files:
                os.chmod(Path(root, f), 0o755 if f in ("bwrap", "uv", "uvx", "patchelf") or ".so" in f else 0o644)
        os.chown(site / "home", NOBODY, NOBODY)
        os.chmod(site / "home", 0o700)
        proc = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", USER_DRIVER, str(site)],
            capture_output=True, text=True, timeout=600, env={**os.environ, "PROBE": MOUNT_PROBE},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(site, ignore_errors=True)
    assert out["before"]["view"] == "template" and "PermissionError" in out["before"]["seen"], out
    bwrap = eval(out["bwrap"]["seen"])  # noqa: S307 - the probe's own repr
    assert bwrap[0] == ["ro"] and bwrap[1].startswith("OSError:30"), out  # holds: a fresh bwrap remounts it
    later = eval(out["template"]["seen"])  # noqa: S307
    assert out["template"]["view"] == "template", out
    assert later[0] == ["ro"] and later[1].startswith("OSError:30"), out
