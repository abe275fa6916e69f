"""The wheels a task's test script pins beyond the runner's own, fetched once on the host.

TB2 test scripts install their test dependencies with uv at verify time (``uvx -p 3.13
-w pytest==8.4.1 -w pytest-json-ctrf==0.3.5 -w numpy==2.3.1 pytest ...``); the verifier's
runner (:mod:`sequester.verifier`) is offline and holds only
:data:`~sequester.verifier.tree.PINNED`. Here the rest:

* :func:`verifier_pins` (pure): the requirements of every ``uvx``, ``uv tool run``, ``uv
  run --with``, ``uv pip install`` and ``uv add`` of a script, and the Python asked for.
  Exact pins (``name==version``) are fetched. **Unpinned** ones (``-w pandas``,
  ``numpy>=2``, URLs, paths) never are (they cannot be fetched reproducibly): uv resolves
  them offline from the runner's and the task's wheels, and when nothing there fits, the
  bootstrap fails and the evaluation raises
  :class:`~sequester.environments.verdict.VerifierCouldNotRun` (an error, not the agent's 0).
* :func:`fetch_verifier_wheels`: the pins and their dependencies as wheels (``pip
  download --only-binary=:all:`` for the target Python and this host's platform, with the
  host's pip configuration: the trusted operator's). A pin published only as a source
  distribution (``chess==1.11.2``) is fetched as that file, from the index's JSON page
  with its sha256 checked (:func:`fetch_sdist`: never through pip, which would run its
  build code on the host to read its metadata), with wheels of what building and running
  it needs (its ``build-system`` requirements and ``Requires-Dist``); uv builds it at
  verify time, inside the verifier, as the tests' own process (as under Docker). Nothing
  from the index runs on the host. One folder per hash of (Pythons, platform tags, sorted
  pins), made aside and renamed into place.
* :func:`ensure_task_wheels`, the call site: the folder a task needs, or ``None``.

Trust: the folder is the host's, written only here; each evaluation copies its wheels into
a read-only tmpfs of the verifier's own mount namespace (:mod:`sequester.environments.local.evaluation`);
the agent's view never holds them (root's toolchain folder, in ``/var``, is hidden there).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sequester.errors import ImageError
from sequester.verifier.tree import PINNED
from sequester.verifier.wheel_pins import VerifierPins, verifier_pins

if TYPE_CHECKING:
    from sequester.tasks import Task

__all__ = [
    "VerifierPins",
    "FetchResult",
    "VerifierWheelsError",
    "verifier_pins",
    "fetch_verifier_wheels",
    "fetch_sdist",
    "ensure_task_wheels",
    "host_platform_tags",
    "cache_key",
    "TASK_WHEELS_DIR",
]

log = logging.getLogger("sequester.imagebuild")

FORMAT = "1"  # of the cache folders: part of their key
TASK_WHEELS_DIR = "task-wheels"  # below the toolchain folder (not "wheels": the runner's prune removes that)
MANIFEST = ".sequester-pins.json"  # in each folder: what it was fetched for (uv reads only wheel names)


class VerifierWheelsError(ImageError):
    """A task's pinned test dependencies could not be fetched; names the pin and pip's output."""

    def __init__(self, message: str, pin: str | None = None) -> None:
        super().__init__(message)
        self.pin = pin  # the requirement pip found no wheel for, when it said which


# -- fetching -------------------------------------------------------------------------------


@dataclass(frozen=True)
class FetchResult:
    """A folder of wheels for a pin set; ``cached``: it was there already (nothing ran)."""

    folder: Path
    key: str
    wheels: tuple[str, ...]
    requirements: tuple[str, ...]
    pythons: tuple[str, ...]
    platform_tags: tuple[str, ...]
    cached: bool


@functools.lru_cache(maxsize=1)
def host_platform_tags() -> tuple[str, ...]:
    """This host's wheel platform tags, best first: ``manylinux_2_X_<arch>`` for every glibc
    minor up to the host's (the runner's C library is the host's), the legacy aliases, and
    ``linux_<arch>``. (pip accepts ``any`` besides these.)"""
    arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine().lower())
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        libc = ""
    tags: list[str] = []
    match = re.fullmatch(r"glibc 2\.(\d+)", libc)
    for minor in range(int(match[1]) if match else 4, 4, -1):
        tags.append(f"manylinux_2_{minor}_{arch}")
        legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}.get(minor)
        if legacy and (minor == 17 or arch in ("x86_64", "i686")):
            tags.append(f"{legacy}_{arch}")
    return (*tags, f"linux_{arch}")


def cache_key(requirements: Sequence[str], pythons: Sequence[str], tags: Sequence[str]) -> str:
    data = json.dumps([FORMAT, sorted(set(pythons)), sorted(set(tags)), sorted(set(requirements))])
    return hashlib.sha256(data.encode()).hexdigest()[:20]


def fetch_verifier_wheels(
    pins: VerifierPins | Sequence[str],
    dest: Path,
    *,
    python: str | Sequence[str],
    platform_tags: Sequence[str] | None = None,
    pip: Sequence[str] | None = None,
    timeout: float = 1800.0,
) -> FetchResult:
    """The wheels of ``pins`` (a :class:`VerifierPins`' requirements, or pins) and their
    dependencies for ``python`` (``X.Y``, or several) and ``platform_tags`` (default: this
    host's), in ``dest/<key>``, downloaded with ``pip`` (default: this Python's) unless
    that folder exists. Concurrent callers wait for one download. Raises
    :class:`VerifierWheelsError` naming the pin that failed, with the tail of pip's output."""
    requirements = tuple(sorted(set(pins.requirements if isinstance(pins, VerifierPins) else pins)))
    pythons = tuple(dict.fromkeys([python] if isinstance(python, str) else python))
    tags = tuple(platform_tags) if platform_tags is not None else host_platform_tags()
    if not requirements or not pythons or not all(re.fullmatch(r"3\.\d{1,2}", p) for p in pythons):
        raise ValueError(f"fetch_verifier_wheels needs pins and Pythons like 3.13: {requirements!r}, {pythons!r}")
    key = cache_key(requirements, pythons, tags)
    folder = dest / key
    fetched = False
    if not folder.is_dir():
        dest.mkdir(parents=True, exist_ok=True)
        lock = os.open(dest / f".{key}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not folder.is_dir():  # else another process made it meanwhile
                _fetch(folder, requirements, pythons, tags, list(pip or [sys.executable, "-m", "pip"]), timeout)
                fetched = True
        finally:
            os.close(lock)
    wheels = tuple(sorted(p for p in os.listdir(folder) if p.endswith(".whl")))
    return FetchResult(folder, key, wheels, requirements, pythons, tags, cached=not fetched)


def _fetch(
    folder: Path,
    requirements: tuple[str, ...],
    pythons: tuple[str, ...],
    tags: tuple[str, ...],
    pip: list[str],
    timeout: float,
) -> None:
    for stale in folder.parent.glob(f".fetch-{folder.name}-*"):  # a dead process's (we hold the lock)
        shutil.rmtree(stale, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=f".fetch-{folder.name}-", dir=folder.parent))
    try:
        sdists: dict[str, str] = {}  # pin -> its source distribution's file name
        wanted = list(requirements)
        for version in pythons:
            while True:
                try:
                    _pip_download(pip, staging, tuple(wanted), version, tags, timeout)
                    break
                except VerifierWheelsError as exc:
                    pin = exc.pin
                    if (
                        pin is None
                        or pin in sdists
                        or pin not in wanted
                        or not re.fullmatch(r"[\w.-]+==[\w.!+-]+", pin)
                    ):
                        raise
                    name, needs = fetch_sdist(pip, pin, staging, timeout)
                    if name is None:
                        raise
                    sdists[pin] = name
                    wanted = [r for r in wanted if r != pin] + [n for n in needs if n not in wanted]
        built = set(sdists.values())
        others = sorted(
            p.name
            for p in staging.iterdir()
            if p.name not in built and (not p.name.endswith(".whl") or not p.is_file())
        )
        if others:  # --only-binary allows none: never hand uv anything it would build but the pins' own
            raise VerifierWheelsError(
                f"pip left files that are not wheels for {', '.join(requirements)}: {', '.join(others[:5])}"
            )
        (staging / MANIFEST).write_text(
            json.dumps(
                {
                    "format": FORMAT,
                    "requirements": requirements,
                    "pythons": pythons,
                    "platform_tags": tags,
                    "source_distributions": sdists,
                },
                indent=1,
            )
            + "\n"
        )
        for path in staging.iterdir():
            path.chmod(0o644)
        staging.chmod(0o755)
        os.rename(staging, folder)
        log.info(
            "fetched the verifier's wheels for %s (Python %s) into %s",
            ", ".join(requirements),
            ", ".join(pythons),
            folder,
        )
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _pip_download(
    pip: list[str], dest: Path, requirements: tuple[str, ...], python: str, tags: tuple[str, ...], timeout: float
) -> None:
    argv = [
        *pip,
        "download",
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar",
        "off",
        "--only-binary=:all:",
        "--python-version",
        python,
        "--implementation",
        "cp",
        "--abi",
        "cp" + python.replace(".", ""),
        *(a for tag in tags for a in ("--platform", tag)),
        "--dest",
        str(dest),
        *requirements,
    ]
    what = f"could not fetch the verifier's wheels for Python {python}"
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise VerifierWheelsError(f"{what} ({', '.join(requirements)}): pip ran over {timeout:g} s") from None
    except OSError as exc:
        raise VerifierWheelsError(f"{what}: pip could not start ({exc})") from None
    if proc.returncode != 0:
        output = (proc.stdout + "\n" + proc.stderr).strip()
        failed = re.findall(r"(?:distribution found for|satisfies the requirement) (\S+)", output)
        pin = failed[-1] if failed else f"one of {', '.join(requirements)}"
        raise VerifierWheelsError(
            f"{what}: {pin} (pip exited {proc.returncode}): ...{output[-1200:]}", pin=failed[-1] if failed else None
        )


def _index_url(pip: list[str]) -> str:
    """The index the host's pip uses (its configuration: the operator's), as a simple URL."""
    url = os.environ.get("PIP_INDEX_URL", "")
    if not url:
        try:
            proc = subprocess.run(
                [*pip, "config", "get", "global.index-url"], capture_output=True, text=True, timeout=60
            )
            url = proc.stdout.strip() if proc.returncode == 0 else ""
        except (OSError, subprocess.SubprocessError):
            url = ""
    return (url or "https://pypi.org/simple").rstrip("/")


def fetch_sdist(pip: list[str], pin: str, dest: Path, timeout: float) -> tuple[str | None, list[str]]:
    """``pin``'s source distribution (``name==version``) into ``dest``, from the index's
    JSON page (PEP 691), its sha256 checked; and what building and running it need: its
    ``build-system.requires`` (PEP 517's default when it has none) and its
    ``Requires-Dist``, read from the archive, never run. (None, []) when the index has
    no source distribution of that version."""
    import tarfile
    import tomllib
    import urllib.request
    from email.parser import HeaderParser

    name, version = pin.split("==", 1)
    normal = re.sub(r"[-_.]+", "-", name).lower()
    request = urllib.request.Request(
        f"{_index_url(pip)}/{normal}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=min(timeout, 120)) as answer:
            page = json.loads(answer.read(16 << 20))
    except (OSError, ValueError):
        return None, []
    stem = re.sub(r"[-_.]+", "_", name).lower() + "-" + version
    wanted = {f"{stem}.tar.gz", f"{normal}-{version}.tar.gz", f"{name}-{version}.tar.gz"}
    entry = next(
        (f for f in page.get("files", ()) if f.get("filename", "").lower() in {w.lower() for w in wanted}), None
    )
    if entry is None or "sha256" not in entry.get("hashes", {}):
        return None, []
    target = dest / entry["filename"]
    digest = hashlib.sha256()
    with urllib.request.urlopen(entry["url"], timeout=min(timeout, 600)) as answer, open(target, "wb") as out:
        while chunk := answer.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != entry["hashes"]["sha256"]:
        target.unlink()
        raise VerifierWheelsError(f"{entry['filename']}: its sha256 is not the index's")
    build, runtime = ["setuptools>=40.8.0", "wheel"], []
    with tarfile.open(target, "r:gz") as archive:
        for member in archive.getmembers()[:10000]:
            parts = member.name.split("/")
            if len(parts) != 2 or not member.isfile() or member.size > 1 << 20:
                continue
            data = archive.extractfile(member)
            if data is None:
                continue
            if parts[1] == "pyproject.toml":
                requires = tomllib.loads(data.read().decode(errors="replace")).get("build-system", {}).get("requires")
                if isinstance(requires, list):
                    build = [str(r) for r in requires]
            elif parts[1] == "PKG-INFO":
                runtime = HeaderParser().parsestr(data.read().decode(errors="replace")).get_all("Requires-Dist") or []
    return entry["filename"], [*build, *runtime]


# -- the call site ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _runner_pythons() -> tuple[str, ...]:
    """``X.Y`` of every Python the runner offers (one of them is uv's choice when a script
    names none)."""
    from sequester.verifier.pythons import runner_versions

    return runner_versions()


_warned: set[tuple[str, tuple[str, ...]]] = set()


def ensure_task_wheels(task: Task, toolchain_dir: Path) -> Path | None:
    """The folder of wheels ``task``'s test script needs beyond the runner's PINNED ones,
    fetched on first use into ``toolchain_dir/task-wheels/``, or ``None`` when it needs
    none. Cheap once cached: a parse of ``test.sh`` and a stat. Unpinned requirements and
    requirements files are not fetched (logged once). Raises :class:`VerifierWheelsError`
    when a pin cannot be fetched."""
    script = task.test_script
    if script is None:
        return None  # the fallback runs PINNED pytest only
    pins = verifier_pins(script.read_text(errors="replace"))
    requirements, unpinned = pins.requirements, [*pins.unpinned, *(f"-r {f}" for f in pins.requirement_files)]
    if unpinned and (str(task.path), tuple(unpinned)) not in _warned:
        _warned.add((str(task.path), tuple(unpinned)))
        log.warning(
            "%s: test.sh asks for %s without an exact version: not fetched (uv resolves them offline from "
            "the wheels the verifier has, or the evaluation cannot run)",
            task.name,
            ", ".join(unpinned),
        )
    if all(r in PINNED for r in requirements):
        return None
    pythons = [*pins.pythons, *(_runner_pythons() if pins.default_python or not pins.pythons else ())]
    return fetch_verifier_wheels(requirements, toolchain_dir / TASK_WHEELS_DIR, python=pythons).folder
