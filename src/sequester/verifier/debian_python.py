"""Debian's optimised CPython builds for the runner, from Debian's own packages.

Test scripts ask uv for a Python (``uvx -p 3.13``: Terminal-Bench 2's standard) and time
their tests; a build compiled without optimisations (pyenv's default, what a host often
has) runs a CPU-bound loop 20-45 % slower than the task image's own interpreter, enough
to tip time-limited tests over. Debian builds its ``python3.X`` with profile-guided
optimisation and link-time optimisation, signs its archive, and is one of the package
registries every machine of this kind reaches; so the runner's Pythons are Debian's:

* :data:`SUITES`: the Debian release whose ``python3.X`` is the one wanted (bookworm's
  3.11, trixie's 3.13);
* :func:`ensure_debian_python` downloads ``python3.X-minimal``, ``libpython3.X-minimal``
  and ``libpython3.X-stdlib`` and the libraries they depend on with apt (a private apt
  state of its own: the host's package database and sources are never read or changed;
  the archive's signature checked with the host's Debian keyring), unpacks them with
  ``dpkg-deb -x`` into a folder of their own (never run as root by any package script:
  nothing of a package runs), and returns that folder as a :class:`HostPython` whose
  ``sysroot`` it is. The runner then gives that Python the release's own loader and C
  library (:mod:`.tree`): trixie's python3.13 needs glibc 2.38, newer than a Debian 12
  host's;
* cached per release and version below the toolchain folder (hidden from every episode),
  built aside and renamed into place.

Where it cannot be had (no apt, no Debian keyring, no route to the mirror) the runner
does without: a host build of that version is used only if it is an optimised one (see
:func:`sequester.verifier.pythons.optimised`), else the runner has none and a script
asking for it fails to bootstrap: ``VerifierCouldNotRun``, named.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = [
    "SUITES",
    "MIRROR",
    "KEYRING",
    "apt_options",
    "sources_line",
    "parse_depends",
    "package_names",
    "ensure_debian_python",
]

log = logging.getLogger("sequester.verifier")

SUITES = {"3.11": "bookworm", "3.13": "trixie"}
MIRROR = os.environ.get("SEQUESTER_DEBIAN_MIRROR", "http://deb.debian.org/debian")
KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
FORMAT = "2"  # of the unpacked folders: part of their name
# Pulled in by packages' maintainer scripts and data, never by a library the Python loads.
_NOT_NEEDED = frozenset(
    {
        "debconf",
        "cdebconf",
        "libdebian-installer4",
        "libnewt0.52",
        "libslang2",
        "libtextwrap1",
        "tzdata",
        "netbase",
        "readline-common",
        "media-types",
        "gcc-14-base",
        "gcc-12-base",
        "perl-base",
        "dpkg",
    }
)


def package_names(short: str) -> tuple[str, ...]:
    """The packages of Debian's ``python{short}`` without its helper scripts (pydoc,
    the ``python3`` link): the interpreter and its whole standard library."""
    return (f"python{short}-minimal", f"libpython{short}-minimal", f"libpython{short}-stdlib")


def apt_options(work: Path) -> list[str]:
    """apt's options for a private state in ``work``: its own lists, cache, status file
    (empty: nothing is installed) and sources; none of the host's configuration."""
    return [
        f"-o=Dir::State={work / 'state'}",
        f"-o=Dir::State::status={work / 'state' / 'status'}",
        f"-o=Dir::Cache={work / 'cache'}",
        f"-o=Dir::Etc::SourceList={work / 'sources.list'}",
        "-o=Dir::Etc::SourceParts=/nonexistent",
        "-o=Dir::Etc::Preferences=/nonexistent",
        "-o=Dir::Etc::PreferencesParts=/nonexistent",
        "-o=APT::Get::AllowUnauthenticated=false",
        "-o=Acquire::AllowInsecureRepositories=false",
        "-o=Debug::NoLocking=1",
        f"-o=APT::Sandbox::User={_user()}",  # (its own downloads: no switch to _apt)
    ]


def _user() -> str:
    import pwd

    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())


def sources_line(suite: str, mirror: str = MIRROR, keyring: Path = KEYRING) -> str:
    return f"deb [signed-by={keyring}] {mirror} {suite} main\n"


def parse_depends(text: str) -> list[str]:
    """The package names ``apt-cache depends --recurse`` printed at the start of a line
    (the packages themselves; ``<virtual>`` ones and the dependency lines are indented or
    bracketed), less those no library of the Python needs."""
    names = []
    for line in text.splitlines():
        if re.fullmatch(r"[a-z0-9][a-z0-9.+-]+", line.strip()) and not line.startswith((" ", "\t")):
            if line not in _NOT_NEEDED:
                names.append(line)
    return sorted(set(names))


def _run(argv: list[str], timeout: float = 600) -> str:
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"}
    )
    if proc.returncode != 0:
        raise OSError(f"{' '.join(argv[:2])} failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()[-600:]}")
    return proc.stdout


def ensure_debian_python(folder: Path, short: str) -> Path | None:
    """The folder holding Debian's ``python{short}`` unpacked (``usr/bin/python{short}``,
    its standard library, the libraries it loads, the release's loader and C library),
    downloaded on first use into ``folder``; None where it cannot be had (logged once)."""
    suite = SUITES.get(short)
    if suite is None:
        return None
    root = folder / f"{suite}-python{short}-{FORMAT}"
    if (root / ".ready").exists():
        return root
    if not KEYRING.exists() or shutil.which("apt-get", path="/usr/bin:/bin") is None:
        log.warning("Debian's python%s is not used: this host has no apt or no Debian keyring (%s)", short, KEYRING)
        return None
    folder.mkdir(parents=True, exist_ok=True)
    lock = os.open(folder / f".{root.name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / ".ready").exists():
            return root
        work = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=folder))
        try:
            _fetch(work, suite, short)
            (work / "root" / ".ready").write_text(f"{suite} python{short}\n")
            if root.exists():  # (a half-made one of a dead process: we hold the lock)
                shutil.rmtree(root)
            os.rename(work / "root", root)
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("Debian's python%s (%s) could not be had: %s", short, suite, exc)
            return None
        finally:
            shutil.rmtree(work, ignore_errors=True)
    finally:
        os.close(lock)
    log.info("unpacked Debian's python%s (%s) into %s", short, suite, root)
    return root


def _fetch(work: Path, suite: str, short: str) -> None:
    for sub in ("state/lists/partial", "cache/archives/partial", "debs", "root"):
        (work / sub).mkdir(parents=True)
    (work / "state" / "status").write_text("")
    (work / "sources.list").write_text(sources_line(suite))
    options = apt_options(work)
    _run(["apt-get", "-q", *options, "update"])
    depends = _run(
        [
            "apt-cache",
            *options,
            "depends",
            "--recurse",
            "--no-recommends",
            "--no-suggests",
            "--no-conflicts",
            "--no-breaks",
            "--no-replaces",
            "--no-enhances",
            *package_names(short),
        ]
    )
    packages = parse_depends(depends)
    missing = [p for p in package_names(short) if p not in packages]
    if missing:
        raise OSError(f"{suite} has no {', '.join(missing)}")
    subprocess.run(
        ["apt-get", "-q", *options, "download", *packages],
        cwd=work / "debs",
        check=True,
        capture_output=True,
        timeout=900,
        env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"},
    )
    for deb in sorted((work / "debs").glob("*.deb")):
        _run(["dpkg-deb", "-x", str(deb), str(work / "root")])
    _anchor_links(work / "root")


def _anchor_links(root: Path) -> None:
    """Absolute links of the unpacked files point into the host; made relative links to
    the same path below ``root`` (a link to ``/etc/python3.13/sitecustomize.py`` must not
    read the host's, or the view's, file when copied; relative, so ``root`` can move)."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            if path.is_symlink():
                target = os.readlink(path)
                if target.startswith("/"):
                    path.unlink()
                    os.symlink(os.path.relpath(root / target.lstrip("/"), dirpath), path)
