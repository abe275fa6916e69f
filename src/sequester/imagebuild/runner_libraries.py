"""The shared libraries of a task's test-time ``apt-get install``, for the runner's loader.

A test script that installs ``ffmpeg libsm6 libxext6`` and then imports ``cv2`` loads
opencv's native module into the verifier's runner, a Python whose loader has no system
folders (it takes nothing from the view, which is the agent's to write: see
:mod:`sequester.verifier.elf`). Under Docker the same import finds ``libGL.so.1`` in the
container's ``/usr/lib``. Here it found nothing ("/: cannot read file data"), an error the
runner reported as ``runner-lacks-library``.

The runner gets the libraries from where the installs themselves come from, never from the
view: the install's tar (:mod:`.apt_install`, made by the task's pristine image's own
apt) and, for what those libraries need that the install did not bring (``libpcre2`` below
``libglib``, already in the image), the task's pristine image's layers. Both are the
host's, written before the episode started. :func:`ensure_runner_libraries` copies them,
flat (one file per name the loader asks for), into a folder next to the tar; the
verifier binds it read-only over the tree's empty folder ``layout.TASK_LIBS``, which the
runner's loaders search after every search path of the program and its libraries (their
built-in ``/usr/lib/<triplet>/``, rewritten: :mod:`sequester.verifier.tree`). Nothing else
looks there: the programs the tests start load the view's libraries, as in the container.

Each copy reads nothing of the view (red team: the install's bytes pointed into it):
its search paths (``RUNPATH``/``RPATH``: libpulse's ``/usr/lib/.../pulseaudio``, where the
runner's apt-get unpacks a library an agent process can put back) are removed, after the
closure followed them inside the tar and the image; every other path into the view's
system folders it holds (plugin and module folders: ALSA's, GDAL's, ...) is redirected
to one that cannot exist, as the tree's own libraries are (:func:`~sequester.verifier.elf.redirect_paths`);
a library that names one it needs by a path (``DT_NEEDED`` with a ``/``) is not copied.

Never copied: glibc's own libraries (the runner's are its own, and a second C library in
one process does not load), and the names the runner's tree already has (its
``libstdc++``, ``libz``, ...), which the runner's programs find by their own search path.
"""

from __future__ import annotations

import fcntl
import logging
import os
import platform
import posixpath
import re
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path

from sequester.errors import BuildError
from sequester.images.records import ImageRecord
from sequester.images.stack import image_link, read_image_file
from sequester.images.store import ImageStore
from sequester.verifier.elf import dynamic_names, is_elf, redirect_paths, view_paths_in
from sequester.verifier.tree import patchelf_program

__all__ = [
    "library_folders",
    "is_library_name",
    "is_glibc",
    "closure",
    "libraries_dir",
    "copy_libraries",
    "runner_libraries",
    "ensure_runner_libraries",
]

log = logging.getLogger("sequester.imagebuild")

_DONE = ".complete"  # written last: a folder without it is a crash's leftover
_LIBRARY = re.compile(r"^[A-Za-z0-9_+.-]+\.so(\.[0-9A-Za-z_]+)*$")
_GLIBC = re.compile(
    r"^(ld-linux[^/]*|ld64\.so\.[0-9]+|libc|libm|libmvec|libdl|librt|libpthread|libutil|libresolv|libnsl|libanl"
    r"|libBrokenLocale|libthread_db|libc_malloc_debug|libnss_[a-z0-9_]+|libmemusage|libpcprofile|libSegFault)"
    r"\.so(\.[0-9]+)*$"
)
_TRIPLES = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu", "arm64": "aarch64-linux-gnu"}
FILE_LIMIT = 20_000  # libraries in one folder
SIZE_LIMIT = 4 << 30  # bytes in one folder (the install's own limit)
_LIBRARY_LIMIT = 1 << 30  # bytes of one library
_HOPS = 16  # links followed to find one library


def library_folders(machine: str | None = None) -> tuple[str, ...]:
    """The folders (relative to the root, in the loader's order of preference) where a
    Debian or Ubuntu system keeps the libraries its loader finds by name."""
    triple = _TRIPLES.get(machine or platform.machine(), "x86_64-linux-gnu")
    return ("usr/local/lib", f"usr/lib/{triple}", f"lib/{triple}", "usr/lib", "lib", "usr/lib64", "lib64")


def is_library_name(name: str) -> bool:
    """``name`` is what a shared library's file is called (``libGL.so.1``, ``x.so``)."""
    return bool(_LIBRARY.match(name))


def is_glibc(name: str) -> bool:
    """``name`` is one of the C library's own (never copied: the runner has its own)."""
    return bool(_GLIBC.match(name))


def closure(
    have: dict[str, list[str]], find: Callable[[str], list[str] | None], skip: Callable[[str], bool]
) -> list[str]:
    """The names to take beyond ``have`` (name -> the names it needs): every name needed,
    transitively, that is neither in ``have`` nor ``skip``\\ ped, in the order first
    needed; ``find(name)`` takes one (returning what it needs) or says None (not there:
    the loader will say so when something asks for it)."""
    taken: list[str] = []
    known = set(have)
    queue = [need for needs in have.values() for need in needs]
    while queue:
        name = queue.pop(0)
        if name in known or skip(name):
            continue
        known.add(name)
        needs = find(name)
        if needs is not None:
            taken.append(name)
            queue.extend(needs)
    return taken


# The copy's format: a folder of another is made again (a change of what a copy is, such as
# its search paths removed, must not leave an older copy in use).
FORMAT = "2"


def libraries_dir(tar: Path) -> Path:
    """Where the folder of the install ``tar``'s libraries is kept."""
    return tar.with_suffix(f".libs{FORMAT}")


def runner_libraries(tar: Path) -> Path | None:
    """The folder of the install ``tar``'s libraries, when it was made and holds any."""
    folder = libraries_dir(tar)
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    return folder if _DONE in names and len(names) > 1 else None


def ensure_runner_libraries(
    store: ImageStore, record: ImageRecord, tar: Path, *, provided: Collection[str]
) -> Path | None:
    """The folder of the libraries of ``tar`` (the install :mod:`.apt_install` made on
    ``record``) and those they need from ``record``'s layers, less glibc's and the
    ``provided`` names (the runner's own); made on first use next to the tar (see the
    module). None when there are none. :class:`BuildError` when it cannot be made."""
    folder = libraries_dir(tar)
    if (folder / _DONE).exists():
        return runner_libraries(tar)
    with open(tar.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / _DONE).exists():
            return runner_libraries(tar)
        for old in tar.parent.glob(f"{tar.stem}.libs*"):  # a crash's leftover, another format's
            shutil.rmtree(old, ignore_errors=True)
        layers = [store.layer_dir(layer.diff_id) for layer in record.layers]
        with tempfile.TemporaryDirectory(prefix="libs-", dir=tar.parent) as work:
            made = Path(work) / "libs"
            made.mkdir()
            try:
                count = copy_libraries(tar, layers, made, provided)
            except (OSError, tarfile.TarError) as exc:
                raise BuildError(f"the libraries of {tar.name} could not be copied for the verifier: {exc}") from None
            (made / _DONE).write_text("")
            os.chmod(made, 0o755)
            os.rename(made, folder)
        log.info("copied %d libraries of %s for the verifier's runner", count, tar.name)
        return runner_libraries(tar)


def copy_libraries(
    tar: Path, layers: Sequence[Path], out: Path, provided: Collection[str], *, patchelf: str | None = None
) -> int:
    """Copy into the folder ``out`` the libraries the install ``tar`` puts in the loader's
    folders and, transitively, what they need of the install and the merged image
    ``layers`` (lowest first; in the loader's folders and those the libraries' search
    paths name), less glibc's and the ``provided`` names; one file per name (a file's
    other names are hard links to it), each made to read nothing of the view (see the
    module; ``patchelf``: the program that removes search paths, default the runner's).
    The number of names."""
    folders = list(library_folders())
    budget = _Budget(patchelf or patchelf_program())

    def skip(name: str) -> bool:
        return is_glibc(name) or name in provided or not is_library_name(name)

    have: dict[str, list[str]] = {}
    first: dict[str, str] = {}  # the tar's file -> the name it was first written as
    with tarfile.open(tar) as archive:
        install = _Install(archive)
        i = 0
        while i < len(folders):  # (a library's search path found on the way adds a folder)
            for name, member in install.libraries(folders[i]):
                if name in have or skip(name):
                    continue
                if member.name in first:  # another name of one file (libGL.so.1 -> libGL.so.1.7.0)
                    os.link(out / first[member.name], out / name)
                    have[name] = have[first[member.name]]
                    continue
                found = _write(out / name, install.read(member), budget)
                if found is not None:
                    have[name] = found[0]
                    first[member.name] = name
                    _search(folders, folders[i], found[1])
            i += 1

        def find(name: str) -> list[str] | None:
            got = install.lookup(folders, name)
            data, folder = (install.read(got[1]), got[0]) if got is not None else _image_library(layers, folders, name)
            if data is None:
                return None
            found = _write(out / name, data, budget)
            if found is None:
                return None
            _search(folders, folder, found[1])
            return found[0]

        taken = closure(have, find, skip)
    return len(have) + len(taken)  # (names: some are links to the same file)


def _search(folders: list[str], origin: str, paths: list[str]) -> None:
    """Add a library's search paths (``$ORIGIN``: ``origin``, its folder in the tar or the
    image) to the ``folders`` the closure looks in, as paths inside the image."""
    for entry in paths:
        entry = entry.replace("${ORIGIN}", "$ORIGIN").replace("$ORIGIN", "/" + origin)
        if entry.startswith("/"):
            folder = posixpath.normpath(entry).lstrip("/")
            if folder and folder not in folders and len(folders) < 64:
                folders.append(folder)


class _Budget:
    def __init__(self, patchelf: str) -> None:
        self.files = 0
        self.size = 0
        self.patchelf = patchelf

    def take(self, size: int) -> None:
        self.files += 1
        self.size += size
        if self.files > FILE_LIMIT or self.size > SIZE_LIMIT:
            raise BuildError(f"the install has more than {FILE_LIMIT} libraries or {SIZE_LIMIT >> 30} GiB of them")


def _write(path: Path, data: bytes, budget: _Budget) -> tuple[list[str], list[str]] | None:
    """``data`` written at ``path``, made to read nothing of the view, when it is an ELF
    library that names what it needs by name: (the names it needs, its search paths);
    else None (not written)."""
    if not is_elf(data):
        return None  # (a linker script named libc.so, a text file)
    names = dynamic_names(data)
    if names is None or any("/" in need for need in names[0]):
        return None  # (a library it needs named by a path would be looked up in the view)
    budget.take(len(data))
    data, _ = redirect_paths(data, view_paths_in(data))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    if names[1]:
        proc = subprocess.run(
            [budget.patchelf, "--remove-rpath", str(path)], capture_output=True, text=True, timeout=120
        )
        if proc.returncode != 0:
            path.unlink()
            log.warning(
                "%s: its search path could not be removed (%s): not copied", path.name, proc.stderr.strip()[:200]
            )
            return None
    return names


class _Install:
    """The install's tar, indexed once: its libraries by folder, links resolved inside it."""

    def __init__(self, archive: tarfile.TarFile):
        self.archive = archive
        self.members = {m.name.strip("/").removeprefix("./"): m for m in archive.getmembers()}
        self.by_folder: dict[str, list[str]] = {}
        for path in self.members:
            folder, _, name = path.rpartition("/")
            if is_library_name(name):
                self.by_folder.setdefault(folder, []).append(name)

    def libraries(self, folder: str) -> Iterable[tuple[str, tarfile.TarInfo]]:
        """(name, the file it is) of each library in ``folder``."""
        for name in sorted(self.by_folder.get(folder, ())):
            member = _follow(self.members, f"{folder}/{name}")
            if member is not None and member.size <= _LIBRARY_LIMIT:
                yield name, member

    def lookup(self, folders: Sequence[str], name: str) -> tuple[str, tarfile.TarInfo] | None:
        """(the folder, the file) of ``name`` in the first of ``folders`` that has it."""
        for folder in folders:
            if name in self.by_folder.get(folder, ()):
                member = _follow(self.members, f"{folder}/{name}")
                if member is not None and member.size <= _LIBRARY_LIMIT:
                    return folder, member
        return None

    def read(self, member: tarfile.TarInfo) -> bytes:
        f = self.archive.extractfile(member)
        return f.read() if f is not None else b""


def _follow(members: dict[str, tarfile.TarInfo], path: str) -> tarfile.TarInfo | None:
    for _ in range(_HOPS):
        member = members.get(path)
        if member is None:
            return None
        if member.isreg():
            return member
        if not member.issym():
            return None
        path = _target(path, member.linkname)
    return None


def _target(path: str, link: str) -> str:
    joined = link if link.startswith("/") else posixpath.join(posixpath.dirname(path), link)
    return posixpath.normpath("/" + joined).lstrip("/")


def _image_library(layers: Sequence[Path], folders: Sequence[str], name: str) -> tuple[bytes | None, str]:
    """The content of the library ``name`` in the merged image ``layers``: the first of
    ``folders`` that has it, links followed inside the image (a merged-/usr image's
    ``/lib/x`` is looked up as ``/usr/lib/x``); nothing of the host's is ever read. With
    the folder it was found in."""
    for folder in folders:
        path = f"{folder}/{name}"
        for _ in range(_HOPS):
            data = read_image_file(layers, path, _LIBRARY_LIMIT + 1)
            if data is not None:
                return (data, folder) if len(data) <= _LIBRARY_LIMIT else (None, "")
            link = image_link(layers, path)
            if link is None:
                head = path.split("/", 1)[0]
                if head in ("lib", "lib64", "bin", "sbin") and not path.startswith("usr/"):
                    path = "usr/" + path  # (a link on the way: a merged-/usr system)
                    continue
                break
            path = _target(path, link)
    return None, ""
