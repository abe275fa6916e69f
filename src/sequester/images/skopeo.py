"""Fetching images with skopeo: the OCI distribution protocol, done by the field's tool.

Why skopeo (Debian's ``skopeo`` package) and not code of our own: it speaks every registry
people use (Docker Hub's token flow, other bearer and basic realms, credential helpers),
reads manifest lists and OCI indexes, Docker v2 schema 2 and OCI manifests, gzip and zstd
layers, OCI layouts and archives, ``docker save`` archives and a Docker-API engine
(``docker-daemon:``), verifies every blob's digest as it writes it, and is maintained with
the container stack it belongs to. We use it for transport only: it writes blobs into the
store's shared blob folder (``--dest-shared-blob-dir``), and the store reads, checks and
unpacks them itself (:mod:`.store`, :mod:`.unpack`).

The argv builders are pure; :func:`run_skopeo` runs one and turns its failure into an
:class:`ImageError` naming the reference and skopeo's reason.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from sequester.errors import ImageError
from sequester.images.manifest import Platform

if TYPE_CHECKING:
    from sequester.images.progress import Progress

__all__ = [
    "explain",
    "skopeo_path",
    "inspect_argv",
    "copy_argv",
    "run_skopeo",
    "POLICY",
    "select_manifest",
    "progress_lines",
]

log = logging.getLogger("sequester.images")

# Signatures are not checked (a gap the README names): what an episode runs is fixed by
# the digests we verify, and a registry's signature policy is the user's own business.
POLICY = '{"default": [{"type": "insecureAcceptAnything"}]}\n'
_TIMEOUT = "30m"
_FATAL = re.compile(r'level=fatal msg="(.*)"\s*$')
_STDERR_LIMIT = 64 * 1024


def skopeo_path() -> str:
    found = shutil.which("skopeo")
    if found is None:
        raise ImageError(
            "images need skopeo to be fetched or imported (Debian/Ubuntu: apt-get install skopeo; "
            "Fedora: dnf install skopeo); episodes in host mode do not"
        )
    return found


def _common(skopeo: str, policy: Path, plat: Platform, tmpdir: Path) -> list[str]:
    argv = [
        skopeo,
        "--policy",
        str(policy),
        "--command-timeout",
        _TIMEOUT,
        "--tmpdir",
        str(tmpdir),
        "--override-os",
        plat.os,
        "--override-arch",
        plat.architecture,
    ]
    if plat.variant:
        argv += ["--override-variant", plat.variant]
    return argv


def inspect_argv(
    skopeo: str,
    source: str,
    *,
    policy: Path,
    plat: Platform,
    tmpdir: Path,
    tls_verify: bool = True,
    authfile: Path | None = None,
) -> list[str]:
    """``skopeo inspect --raw SOURCE``: the manifest (or index) exactly as the source has it."""
    argv = [*_common(skopeo, policy, plat, tmpdir), "inspect", "--raw", "--retry-times", "2"]
    if source.startswith("docker://"):
        argv.append(f"--tls-verify={'true' if tls_verify else 'false'}")
        if authfile is not None:
            argv += ["--authfile", str(authfile)]
    return [*argv, source]


def copy_argv(
    skopeo: str,
    source: str,
    layout: Path,
    blobs: Path,
    *,
    policy: Path,
    plat: Platform,
    tmpdir: Path,
    tls_verify: bool = True,
    authfile: Path | None = None,
    daemon_host: str | None = None,
) -> list[str]:
    """``skopeo copy SOURCE oci:LAYOUT:image`` with every blob in the store's ``blobs``;
    ``daemon_host``: the Docker-API engine of a ``docker-daemon:`` source (``$DOCKER_HOST``)."""
    argv = [
        *_common(skopeo, policy, plat, tmpdir),
        "copy",
        "--retry-times",
        "2",
        "--dest-shared-blob-dir",
        str(blobs),
        "--dest-oci-accept-uncompressed-layers",
    ]
    if source.startswith("docker://"):
        argv.append(f"--src-tls-verify={'true' if tls_verify else 'false'}")
        if authfile is not None:
            argv += ["--src-authfile", str(authfile)]
    if source.startswith("docker-daemon:") and daemon_host:
        argv += ["--src-daemon-host", daemon_host]  # skopeo does not read $DOCKER_HOST itself
    return [*argv, source, f"oci:{layout}:image"]


def run_skopeo(
    argv: Sequence[str], what: str, *, on_line: Callable[[str], None] | None = None, timeout: float = 3600
) -> bytes:
    """Run skopeo; its stdout (bounded to 64 MiB); :class:`ImageError` naming ``what`` on failure.
    ``on_line`` gets each line skopeo prints about its progress (``Copying blob ...``)."""
    log.debug("skopeo: %s", " ".join(argv))  # (credentials are only ever in a file: see .credentials)
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as exc:
        raise ImageError(f"{what}: skopeo could not start: {exc}") from None
    err = bytearray()

    def drain() -> None:
        assert proc.stderr is not None
        while chunk := proc.stderr.read(4096):
            if len(err) < _STDERR_LIMIT:
                err.extend(chunk[: _STDERR_LIMIT - len(err)])

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    out = bytearray()
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            if len(out) < 64 << 20:
                out.extend(line)
            if on_line is not None:
                on_line(line.decode(errors="replace").rstrip())
        proc.wait(timeout=timeout)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        reader.join(5)
    if proc.returncode != 0:
        raise ImageError(f"{what}: {explain(_reason(err.decode(errors='replace')))}")
    return bytes(out)


_UNREACHABLE = re.compile(
    r'(?:Error parsing image name "[^"]*": )?pinging (?:container|docker) registry (?P<host>[^:\s]+(?::\d+)?): '
    r".*?(?P<why>connection refused|no such host|i/o timeout|network is unreachable|no route to host|"
    r"connection reset by peer|context deadline exceeded|server gave HTTP response to HTTPS client|"
    r"tls: [^\n]*|x509: [^\n]*)",
)


def explain(reason: str) -> str:
    """skopeo's reason as a user should read it: a registry that cannot be reached is said
    to be one (skopeo words it "Error parsing image name ...", which reads like a typo)."""
    m = _UNREACHABLE.search(reason)
    if m is None:
        return reason
    host, why = m["host"], m["why"]
    hint = (
        "the registry speaks plain HTTP: list it in [images] insecure"
        if "HTTP response to HTTPS" in why
        else "a certificate problem"
        if why.startswith(("tls:", "x509:"))
        else "check the network, the registry's address and [images] mirrors"
    )
    return f"cannot reach the registry {host} ({why}): {hint}"


def _reason(stderr: str) -> str:
    """skopeo's own message, without its log framing."""
    for line in reversed(stderr.strip().splitlines()):
        m = _FATAL.search(line)
        if m:
            return m.group(1).replace('\\"', '"')
    text = stderr.strip().splitlines()
    return text[-1][:2000] if text else "skopeo failed and said nothing"


def select_manifest(index: dict, what: str) -> str:
    entries = index.get("manifests")
    if not isinstance(entries, list) or len(entries) != 1 or not isinstance(entries[0], dict):
        raise ImageError(f"{what}: the fetched layout does not hold exactly one image")
    digest = entries[0].get("digest")
    if not isinstance(digest, str):
        raise ImageError(f"{what}: the fetched layout's index has no digest")
    return digest


def progress_lines(progress: Progress):
    """skopeo's 'Copying blob' lines as progress notes."""

    def on_line(line: str) -> None:
        if line.startswith("Copying blob"):
            progress.note(line)

    return on_line
