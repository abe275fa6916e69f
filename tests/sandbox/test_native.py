"""Foreign-function libraries kept out of a kernel (:mod:`sequester.sandbox.native`): ctypes
cannot come back, even with the audit hook switched off, and the writable mounts are
noexec and share one size cap. Each against a control that shows the attack works where
the protection is missing; then which libraries count as foreign-function ones (pure)."""

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from paths import HELPERS
from probes import probe

from sequester import Kernel, Limits, Policy
from sequester.kernel import launch
from sequester.kernel.check_native import DISABLE_HOOK, NATIVE_PROBE, sample_library
from sequester.kernel.launch import run_in_sandbox
from sequester.sandbox.host import gather_host_facts

ATTACK = DISABLE_HOOK + "\nimport ctypes\nprint(ctypes.CDLL(None).getpid())\n"
SAMPLE = sample_library()


def _libraries():
    return sorted({str(p) for p in gather_host_facts(scan_ffi=True).ffi_libraries if p.name.startswith("_ctypes.")})


def test_control_the_hook_can_be_switched_off_and_then_ctypes_loads_if_the_view_has_it(monkeypatch):
    """The attack, in a sandbox whose view does not cover _ctypes."""
    real = launch.gather_host_facts
    monkeypatch.setattr(launch, "gather_host_facts", lambda **kw: replace(real(**kw), ffi_libraries=()))
    with Kernel(Policy()) as k:
        r = k.run(ATTACK)
    assert r.error is None, r.error
    assert r.stdout.strip() == "1"  # the kernel's own pid (it is its namespace's pid 1), through libc: ctypes works


def test_with_the_hook_off_ctypes_is_not_loadable():
    with Kernel(Policy()) as k:
        assert k.run("import ctypes").error.message == "import of ctypes is blocked by the sandbox policy"
        r = k.run(ATTACK)
        assert r.error is not None and r.error.type in ("ModuleNotFoundError", "ImportError")
        assert "blocked" not in r.error.message  # the hook was really off: the file is what is missing
        seen = probe(k, f"LIBRARIES = {_libraries()!r}\nSAMPLE = {SAMPLE!r}\n" + NATIVE_PROBE)
    assert seen["hook_off"] == "disabled"
    loaded = {k: v for k, v in seen.items() if isinstance(v, str) and v.startswith(("LOADED", "MAPPED", "CREATED"))}
    assert loaded == {}
    assert seen["ctypes types in memory"] == []  # the first stage's ctypes died with its image
    assert seen["memfd_create"] == "Operation not permitted"
    assert all("Operation not permitted" in seen[f"exec map in {d}"] for d in ("/tmp/workspace", "/dev/shm"))


def test_control_a_library_in_bwraps_own_tmpfs_can_be_mapped_executable():
    """Without the kernel's noexec workspace (bwrap's --tmpfs has no noexec) the same map works."""
    code = ("import mmap, shutil\nshutil.copyfile(%r, '/tmp/copied.so')\n"
            "f = open('/tmp/copied.so', 'rb')\nmmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ | mmap.PROT_EXEC)\n"
            "print('MAPPED')" % SAMPLE)
    result = run_in_sandbox(Policy(), [sys.executable, "-c", code])
    assert result.stdout.strip() == "MAPPED", result.stderr


def test_the_view_covers_every_ffi_library_of_the_visible_installations():
    facts = gather_host_facts(scan_ffi=True)
    assert any(p.name.startswith("_ctypes.") for p in facts.ffi_libraries)
    with open(facts.ffi_libraries[0], "rb") as f:  # control: the host reads them
        assert f.read(4) == b"\x7fELF"
    with Kernel(Policy()) as k:
        seen = probe(k, "import json, os\nout = {}\n"
                        f"for p in {[str(p) for p in facts.ffi_libraries]!r}:\n"
                        "    try:\n        out[p] = open(p, 'rb').read(4).hex() if os.path.exists(p) else 'absent'\n"
                        "    except OSError as e:\n        out[p] = e.strerror\nprint(json.dumps(out))")
    assert set(seen.values()) <= {"", "absent", "Permission denied"}, seen  # /dev/null reads empty


@pytest.mark.parametrize("first,second", [("/tmp/workspace", "/dev/shm"), ("/dev/shm", "/tmp/workspace")])
def test_tmp_and_dev_shm_share_one_workspace_cap(first, second):
    write = "open({!r} + '/fill', 'wb').write(b'x' * 6 * 1024 * 1024)"
    with Kernel(Policy(limits=Limits(workspace_mb=8))) as k:
        assert k.run(write.format(second)).error is None  # control: 6 MB fit in either alone
        k.run(f"import os\nos.remove({second!r} + '/fill')")
        assert k.run(write.format(first)).error is None
        r = k.run(write.format(second))
        assert r.error is not None and "No space left" in r.error.message
        seen = probe(k, "import json, os\nprint(json.dumps([os.statvfs(p).f_blocks * os.statvfs(p).f_frsize "
                        "for p in ('/tmp', '/dev/shm')]))")
    assert seen == [8 * 1024 * 1024] * 2


def test_dev_is_read_only_and_nothing_else_is_writable():
    with Kernel(Policy()) as k:
        seen = probe(k, "import json\nout = {}\nfor d in ('/dev', '/run', '/', '/var/tmp', '/etc'):\n"
                        "    try:\n        open(d + '/planted', 'w'); out[d] = 'WROTE'\n"
                        "    except OSError as e:\n        out[d] = e.strerror\nprint(json.dumps(out))")
    assert all(v in ("Read-only file system", "Permission denied") for v in seen.values()), seen


def test_guard_mode_withholds_ctypes_but_not_executable_maps(tmp_path):
    """Guard only (no user namespaces): Landlock makes _ctypes unreadable; it has no right
    for executable mappings, so a library written to the workspace maps (documented)."""
    import subprocess

    helper = HELPERS / "no_userns.py"
    script = tmp_path / "guard.py"
    code = "LIBRARIES = %r\nSAMPLE = %r\n" % (_libraries(), SAMPLE) + NATIVE_PROBE
    script.write_text(
        "import json\nfrom sequester import Kernel, Policy\n"
        f"code = {code!r}\n"
        "with Kernel(Policy(isolation='auto')) as k:\n"
        "    r = k.run(code)\n    print(r.stdout if r.error is None else json.dumps({'error': str(r.error)}))\n")
    proc = subprocess.run([sys.executable, str(helper), str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["hook_off"] == "disabled"
    assert not seen["import ctypes"].startswith("LOADED")
    assert all(not seen[p].startswith("LOADED") for p in _libraries())
    assert seen["memfd_create"] == "Operation not permitted"
    assert any(v == "MAPPED" for k, v in seen.items() if k.startswith("exec map in"))  # the documented gap


def test_a_readonly_path_below_tmp_survives_the_new_workspace(tmp_path):
    shown = tmp_path / "shown"
    shown.mkdir()
    (shown / "f.txt").write_text("visible")
    for p in (tmp_path, shown):
        p.chmod(0o755)
    (shown / "f.txt").chmod(0o644)
    with Kernel(Policy(readonly=(shown,))) as k:
        assert k.run(f"open({str(shown / 'f.txt')!r}).read()").value == "'visible'"
        r = k.run(f"open({str(shown / 'new.txt')!r}, 'w')")
        assert r.error is not None and r.error.type in ("OSError", "PermissionError")


# -- which libraries are foreign-function ones ---------------------------------------------

def test_ffi_library_names_and_folders():
    from sequester.sandbox.native import is_ffi_library, package_dir_patterns

    assert is_ffi_library("_ctypes.cpython-311-x86_64-linux-gnu.so") and is_ffi_library("_ctypes.so")
    assert is_ffi_library("_cffi_backend.abi3.so") and is_ffi_library("_ctypes_test.cpython-311-x86_64-linux-gnu.so")
    assert not is_ffi_library("_ctypes_other.so") and not is_ffi_library("_ctypes") and not is_ffi_library("ctypes.py")
    patterns = package_dir_patterns(Path("/opt/conda"))
    assert "/opt/conda" in patterns and "/opt/conda/lib/python3*/site-packages" in patterns
    assert "/opt/conda/lib/python3*/lib-dynload" in patterns
