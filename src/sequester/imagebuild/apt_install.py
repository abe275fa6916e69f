"""The packages a task's test script ``apt-get install``\\ s, installed ahead by trusted tools.

Under Harbor with Docker, ``apt-get install gcc`` in ``test.sh`` installs into the
container. The runner never runs the agent's ``apt`` (it may be replaced, its sources,
keyrings, proxies and ``/etc/hosts`` are the agent's): when an episode starts, the
packages the script names (:mod:`sequester.verifier.apt_pins`) are installed on the
task's **pristine image** by a build step of its own (``FROM`` the image, ``USER root``,
``RUN apt-get update && apt-get install -y ...``: the image's own ``apt`` and sources,
nothing of the agent's), through the build network of ``[images]``. What the installed
packages own of what the step wrote is packed as a tar (:func:`pack_layer`) and cached by
(image id, packages); the runner's ``apt-get`` unpacks it into the system the tests run on
when the script asks for those packages, as the tests' own process (so it can write
nothing a program under test could not), and runs nothing of the system's.

Not in the tar: anything the packages do not own (:func:`owned_paths`): dpkg's and apt's
databases, account files, ``ld.so.cache``, the CA bundle, files the maintainer scripts
generated (compiled ``.pyc``, keys), whiteouts. The agent's copies of those stay as they
are (a user it added, a CA it trusted); dpkg's database does not list the packages the
tests installed.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import stat
import tarfile
import tempfile
from pathlib import Path

from sequester.errors import BuildError
from sequester.imagebuild.builder import BuildOptions, build_image
from sequester.images.records import ImageRecord
from sequester.images.store import ImageStore
from sequester.sandbox.idmap import IdMap
from sequester.verifier.apt_pins import AptRequest

__all__ = [
    "FORMAT",
    "install_key",
    "install_dockerfile",
    "owned_paths",
    "pack_layer",
    "ensure_apt_install",
    "installed_packages",
    "unpacked_paths",
]

log = logging.getLogger("sequester.imagebuild")

FORMAT = "3"
PACK_LIMIT = 4 << 30  # bytes of packed files; a larger install is refused
_ENTRY_LIMIT = 500_000
_INFO = "var/lib/dpkg/info"
# Top folders a merged-/usr system reaches through links (a package lists /bin/sh; the
# step wrote usr/bin/sh).
_MERGED = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")


def install_key(image_id: str, request: AptRequest) -> str:
    """The cache key of ``request``'s packages installed on the image ``image_id``."""
    text = json.dumps([FORMAT, image_id, sorted(request.packages), request.no_recommends, request.reinstall])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def install_dockerfile(base: str, request: AptRequest) -> str:
    """The one-step build that installs ``request``'s packages on ``base`` with its own apt."""
    flags = "-y" + " --no-install-recommends" * request.no_recommends + " --reinstall" * request.reinstall
    return (
        f"FROM {base}\nUSER root\n"
        f"RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install {flags} {' '.join(request.packages)}\n"
    )


def owned_paths(layer: Path) -> set[str]:
    """What of ``layer`` (a step's folder) the packages it installed own: the files their
    ``var/lib/dpkg/info/*.list`` name (found where the step wrote them: a merged-/usr
    system's ``/bin/x`` is ``usr/bin/x``), their own ``info`` files, and the links their
    scripts made to ``/etc/alternatives`` (and those). Never a database or an account file
    rewritten whole (``/etc/passwd``, dpkg's ``status``, ``ld.so.cache``, the CA bundle):
    the agent's copies may hold its work."""
    info = layer / _INFO
    wanted: set[str] = set()
    try:
        entries = sorted(p for p in info.iterdir() if not p.is_symlink())
    except OSError:
        return wanted
    lists = [p for p in entries if p.name.endswith(".list") and p.is_file()]
    packages = tuple(p.name[: -len(".list")] + "." for p in lists)
    wanted.update(f"{_INFO}/{p.name}" for p in entries if p.name.startswith(packages))
    for listed in lists:
        for line in listed.read_text(errors="replace").splitlines():
            rel = line.strip().strip("/")
            if not rel or rel == ".":
                continue
            wanted.add(rel)
            if rel.split("/")[0] in _MERGED:
                wanted.add("usr/" + rel)
    alternatives = layer / "etc" / "alternatives"
    if alternatives.is_dir() and not alternatives.is_symlink():
        for entry in alternatives.iterdir():
            if entry.is_symlink():
                wanted.add(f"etc/alternatives/{entry.name}")
                wanted.add(f"/etc/alternatives/{entry.name}")  # (what links to it: see pack_layer)
    return wanted


def pack_layer(layer: Path, out: Path, ids: IdMap | None) -> int:
    """Pack what the packages installed in ``layer`` own (:func:`owned_paths`; walked
    without following links) into the tar ``out``, with the folders above them; owners as
    the episode sees them (``ids``: host to inside; unmapped ones and no map: root). The
    number of entries; :class:`BuildError` beyond :data:`PACK_LIMIT`."""
    wanted = owned_paths(layer)
    parents = {rel.rsplit("/", i)[0] for rel in wanted if not rel.startswith("/") for i in range(1, rel.count("/") + 1)}

    def inside(host: int, gid: bool) -> int:
        if ids is None:
            return 0
        found = ids.inside_gid(host) if gid else ids.inside_uid(host)
        return 0 if found is None else found

    total = count = 0
    with tarfile.open(out, "w", format=tarfile.GNU_FORMAT) as tar:
        stack = [""]
        while stack:
            rel_dir = stack.pop()
            with os.scandir(layer / rel_dir if rel_dir else layer) as entries:
                names = sorted((e.name, e) for e in entries)
            for name, entry in names:
                rel = f"{rel_dir}/{name}" if rel_dir else name
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    if rel not in parents and rel not in wanted:
                        continue
                    stack.append(rel)
                elif rel not in wanted:
                    # an alternatives link (usr/bin/vim -> /etc/alternatives/vim) comes too
                    if not (stat.S_ISLNK(st.st_mode) and os.readlink(entry.path) in wanted):
                        continue
                elif not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                    continue  # a whiteout, a device, a FIFO: not unpacked
                count += 1
                if count > _ENTRY_LIMIT:
                    raise BuildError(f"the install has more than {_ENTRY_LIMIT} files")
                info = tar.gettarinfo(entry.path, arcname=rel)
                info.uid, info.gid = inside(st.st_uid, False), inside(st.st_gid, True)
                info.uname = info.gname = ""
                if info.isreg():
                    total += info.size
                    if total > PACK_LIMIT:
                        raise BuildError(f"the install is larger than {PACK_LIMIT >> 30} GiB")
                    with open(entry.path, "rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
    return count


def ensure_apt_install(
    store: ImageStore,
    record: ImageRecord,
    request: AptRequest,
    *,
    cache_dir: Path,
    options: BuildOptions,
    runner: Path | None,
) -> Path:
    """The tar of ``request``'s packages installed on ``record`` (see the module), built on
    first use into ``cache_dir``; :class:`BuildError` when the install fails."""
    key = install_key(record.id, request)
    tar = cache_dir / f"{key}.tar"
    if tar.is_file():
        return tar
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f"{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if tar.is_file():
            return tar
        base = record.id  # (by id: a name may since have moved to another image)
        with tempfile.TemporaryDirectory(prefix="apt-install-", dir=cache_dir) as work:
            dockerfile = Path(work) / "Dockerfile"
            dockerfile.write_text(install_dockerfile(base, request))
            result = build_image(store, dockerfile, Path(work), options=options, runner=runner)
            layers = result.record.layers[len(record.layers) :]
            partial = Path(work) / "install.tar"
            try:
                if layers:  # the RUN step's (none when everything was there already)
                    entries = pack_layer(store.layer_dir(layers[-1].diff_id), partial, store.ids)
                else:
                    (Path(work) / "empty").mkdir()
                    entries = pack_layer(Path(work) / "empty", partial, None)
            finally:  # the tar is what is kept: the build's own image and layer go
                try:
                    store.remove(result.record.id)
                except Exception as exc:  # noqa: BLE001 - a leftover, not a failure
                    log.debug("could not remove the install's build image: %s", exc)
            (cache_dir / f"{key}.json").write_text(
                json.dumps({"image": record.id, "packages": list(request.packages), "entries": entries}) + "\n"
            )
            os.replace(partial, tar)  # (last: a tar that is there has its record)
        log.info("installed %s on %s for the verifier (%d files)", " ".join(request.packages), base, entries)
        return tar


def installed_packages(tar: Path) -> list[str]:
    """The packages the install ``tar`` (of :func:`ensure_apt_install`) holds."""
    return list(json.loads(tar.with_suffix(".json").read_text())["packages"])


@functools.lru_cache(maxsize=64)
def unpacked_paths(tar: Path) -> frozenset[str]:
    """The paths (relative to the root) the install ``tar`` unpacks, its folders too."""
    try:
        with tarfile.open(tar) as archive:
            return frozenset(m.name.strip("/") for m in archive.getmembers())
    except (OSError, tarfile.TarError):
        return frozenset()
