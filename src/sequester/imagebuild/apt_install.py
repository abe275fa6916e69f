"""The packages a task's test script ``apt-get install``\\ s, installed ahead by trusted tools.

Under Harbor with Docker, ``apt-get install gcc`` in ``test.sh`` installs into the
container. The runner never runs the agent's ``apt`` (it may be replaced, its sources,
keyrings, proxies and ``/etc/hosts`` are the agent's): when an episode starts, the
packages the script names (:mod:`sequester.verifier.apt_pins`) are installed on the
task's **pristine image** by a build step of its own (``FROM`` the image, ``USER root``,
``RUN apt-get update && apt-get install -y ...``: the image's own ``apt`` and sources,
nothing of the agent's), through the build network of ``[images]``. What the step wrote
is packed as a tar (:func:`pack_layer`) and cached by (image, packages); the runner's
``apt-get`` unpacks it into the system the tests run on when the script asks for those
packages, as the tests' own process (so it can write nothing a program under test could
not).

Left out of the tar: apt's and dpkg's bookkeeping (package lists, caches, logs, dpkg's
``status``: the agent's database is left as it is), ``/tmp``, ``/root``, ``/run`` and
``/etc/ld.so.cache`` (the runner's ``apt-get`` runs the system's ``ldconfig`` after
unpacking, over the system as the agent left it). Whiteouts (files the step removed) are
not applied.
"""

from __future__ import annotations

import fcntl
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
    "kept",
    "pack_layer",
    "ensure_apt_install",
    "installed_packages",
]

log = logging.getLogger("sequester.imagebuild")

FORMAT = "2"
PACK_LIMIT = 4 << 30  # bytes of packed files; a larger install is refused
_ENTRY_LIMIT = 500_000
_LEFT_OUT = (
    "var/lib/apt/lists",
    "var/cache",
    "var/log",
    "var/lib/dpkg/status",
    "var/lib/dpkg/status-old",
    "var/lib/dpkg/lock",
    "var/lib/dpkg/lock-frontend",
    "var/lib/dpkg/triggers",
    "var/lib/dpkg/updates",
    "tmp",
    "root",
    "run",
    "proc",
    "dev",
    "sys",
    "etc/ld.so.cache",
)


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


def kept(rel: str) -> bool:
    """Whether the file at ``rel`` (relative to the root) is part of what is unpacked."""
    return not any(rel == p or rel.startswith(p + "/") for p in _LEFT_OUT)


def pack_layer(layer: Path, out: Path, ids: IdMap | None) -> tuple[int, bool]:
    """Pack ``layer`` (a folder of the store, walked without following links) into the tar
    ``out``, owners as the episode sees them (``ids``: host to inside; unmapped ones and no
    map: root); the number of entries, and whether any is a shared library (``ldconfig``
    is then due). :class:`BuildError` beyond :data:`PACK_LIMIT`."""

    def inside(host: int, gid: bool) -> int:
        if ids is None:
            return 0
        found = ids.inside_gid(host) if gid else ids.inside_uid(host)
        return 0 if found is None else found

    total = count = 0
    libraries = False
    with tarfile.open(out, "w", format=tarfile.GNU_FORMAT) as tar:
        stack = [""]
        while stack:
            rel_dir = stack.pop()
            with os.scandir(layer / rel_dir if rel_dir else layer) as entries:
                names = sorted((e.name, e) for e in entries)
            for name, entry in names:
                rel = f"{rel_dir}/{name}" if rel_dir else name
                if not kept(rel):
                    continue
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                    continue  # a whiteout: not applied
                if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                    continue  # devices, FIFOs, sockets: no package installs them
                count += 1
                if count > _ENTRY_LIMIT:
                    raise BuildError(f"the install has more than {_ENTRY_LIMIT} files")
                info = tar.gettarinfo(entry.path, arcname=rel)
                info.uid, info.gid = inside(st.st_uid, False), inside(st.st_gid, True)
                info.uname = info.gname = ""
                libraries |= ".so" in name and not stat.S_ISDIR(st.st_mode)
                if info.isreg():
                    total += info.size
                    if total > PACK_LIMIT:
                        raise BuildError(f"the install is larger than {PACK_LIMIT >> 30} GiB")
                    with open(entry.path, "rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
                if stat.S_ISDIR(st.st_mode):
                    stack.append(rel)
    return count, libraries


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
        base = record.names[0] if record.names else record.id
        with tempfile.TemporaryDirectory(prefix="apt-install-", dir=cache_dir) as work:
            dockerfile = Path(work) / "Dockerfile"
            dockerfile.write_text(install_dockerfile(base, request))
            result = build_image(store, dockerfile, Path(work), options=options, runner=runner)
            layers = result.record.layers[len(record.layers) :]
            partial = Path(work) / "install.tar"
            try:
                if layers:  # the RUN step's (none when everything was there already)
                    entries, libraries = pack_layer(store.layer_dir(layers[-1].diff_id), partial, store.ids)
                else:
                    (Path(work) / "empty").mkdir()
                    entries, libraries = pack_layer(Path(work) / "empty", partial, None)
            finally:  # the tar is what is kept: the build's own image and layer go
                try:
                    store.remove(result.record.id)
                except Exception as exc:  # noqa: BLE001 - a leftover, not a failure
                    log.debug("could not remove the install's build image: %s", exc)
            (cache_dir / f"{key}.json").write_text(
                json.dumps(
                    {"image": record.id, "packages": list(request.packages), "entries": entries, "ldconfig": libraries}
                )
                + "\n"
            )
            os.replace(partial, tar)  # (last: a tar that is there has its record)
        log.info("installed %s on %s for the verifier (%d files)", " ".join(request.packages), base, entries)
        return tar


def installed_packages(tar: Path) -> tuple[list[str], bool]:
    """The packages the install ``tar`` (of :func:`ensure_apt_install`) holds, and whether
    it holds shared libraries (``ldconfig`` is due after unpacking it)."""
    record = json.loads(tar.with_suffix(".json").read_text())
    return list(record["packages"]), bool(record.get("ldconfig", True))
