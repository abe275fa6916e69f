"""A real OCI registry on loopback, and skopeo to fill it: for tests that pull images.

The registry is Debian's ``docker-registry`` package (the reference "distribution"
registry, 2.8 here), run as ``docker-registry serve CONFIG.yml`` with filesystem storage
under a folder the test owns. Images go in with ``skopeo copy`` (Debian's ``skopeo``, 1.9
here), so what a test pulls was pushed by the same code real registries see.

What was found out on this machine (distribution 2.8.2, skopeo 1.9.3):

* **htpasswd auth works over plain HTTP.** The registry does not insist on TLS for
  ``auth: htpasswd`` (its docs only advise it): ``GET /v2/`` answers 401 with
  ``Www-Authenticate: Basic realm=...`` and 200 with the right Basic credentials. So
  ``running_registry(root, auth=(user, password))`` serves plain HTTP by default.
* The htpasswd file must hold bcrypt entries. They come from ``htpasswd -Bbn`` (Debian's
  ``apache2-utils``) or Python's ``bcrypt`` module; with neither, the auth variant skips.
* ``tls=True`` serves HTTPS with a self-signed certificate made by ``openssl req -x509``
  for ``IP:127.0.0.1``. skopeo then needs ``--dest-cert-dir DIR`` / ``--cert-dir DIR``
  where ``DIR/ca.crt`` is that certificate (``*.crt`` files in a cert dir are CA roots);
  without it skopeo fails with "x509: certificate signed by unknown authority".
  ``--tls-verify=false`` would also work, but would not prove that verification happens.
* skopeo reads credentials from ``$HOME/.docker/config.json`` (``{"auths": {HOST:
  {"auth": base64("user:password")}}}``) when ``$XDG_RUNTIME_DIR/containers/auth.json``
  has none: :meth:`Registry.write_docker_config` writes that file for a given home.
* Even at ``log.level: error`` the registry logs every 404 (skopeo's ``HEAD`` probes for
  blobs it has yet to upload) to stderr: stderr goes to a file, not a pipe, so a chatty
  registry can never block on a full pipe; its tail is quoted when start-up fails.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REGISTRY_BINARY = "/usr/bin/docker-registry"

# Every manifest type a client may ask for: the registry answers HEAD/GET with the stored
# manifest only if its type is acceptable (else it may convert or 404).
MANIFEST_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)

# Where tools live for root; an ordinary user's PATH often lacks the sbin folders, where
# debootstrap is, and the tests look there too.
_EXTRA_PATH = ("/usr/local/sbin", "/usr/sbin", "/sbin")


def which(name: str) -> str | None:
    """The path of tool ``name`` on PATH or in the sbin folders, or None."""
    path = os.environ.get("PATH", os.defpath) + os.pathsep + os.pathsep.join(_EXTRA_PATH)
    return shutil.which(name, path=path)


def missing_tools(*names: str) -> list[str]:
    """Those of ``names`` that are not installed."""
    return [name for name in names if which(name) is None]


def skip_unless_tools(*names: str) -> None:
    """Skip the calling test (or fixture) unless every tool in ``names`` is installed."""
    missing = missing_tools(*names)
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (Debian packages; .ci/run installs them)")


def needs_tools(*names: str) -> pytest.MarkDecorator:
    """The same check as a decorator: ``@needs_tools("skopeo", "umoci")``."""
    missing = missing_tools(*names)
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)} (Debian packages; .ci/run installs them)")


def run_bytes(argv: Sequence[str], *, timeout: float = 300, env: dict[str, str] | None = None,
              cwd: Path | None = None) -> bytes:
    """Run a tool; its stdout as bytes, or an AssertionError quoting the command and its
    stderr (so a failing fixture says which real tool refused and why)."""
    done = subprocess.run(list(argv), capture_output=True, timeout=timeout, env=env, cwd=cwd)
    if done.returncode != 0:
        stderr = done.stderr.decode(errors="replace").strip()
        raise AssertionError(f"{' '.join(map(str, argv))} exited {done.returncode}:\n{stderr}")
    return done.stdout


def run(argv: Sequence[str], *, timeout: float = 300, env: dict[str, str] | None = None,
        cwd: Path | None = None) -> str:
    """:func:`run_bytes`, decoded."""
    return run_bytes(argv, timeout=timeout, env=env, cwd=cwd).decode()


def skopeo(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> str:
    """Run skopeo. ``--insecure-policy``: the tests check transport, not signatures, and
    it spares needing /etc/containers/policy.json (or a per-user one) to exist."""
    if env is not None and "XDG_RUNTIME_DIR" in os.environ:  # (see tests/conftest.py)
        env = {"XDG_RUNTIME_DIR": os.environ["XDG_RUNTIME_DIR"], **env}
    return run(["skopeo", "--insecure-policy", *args], timeout=timeout, env=env)


def _free_port() -> int:
    """A loopback port nothing listens on now (the registry binds it a moment later; a
    lost race shows as an early exit, and start-up retries with another port)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def htpasswd_line(user: str, password: str) -> str:
    """A bcrypt htpasswd entry (the only kind the registry accepts), or skip."""
    tool = which("htpasswd")
    if tool:
        return run([tool, "-Bbn", user, password]).strip()
    try:
        import bcrypt  # type: ignore[import-not-found]
    except ImportError:
        pytest.skip("an authenticated registry needs htpasswd (apache2-utils) or Python's bcrypt")
    # Cost 5, like htpasswd -B's default: the registry checks it on every request.
    hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=5)).decode()
    return f"{user}:{hashed}"


def self_signed_cert(folder: Path) -> tuple[Path, Path]:
    """(certificate, key) for ``IP:127.0.0.1`` made by openssl, or skip."""
    skip_unless_tools("openssl")
    folder.mkdir(parents=True, exist_ok=True)
    cert, key = folder / "cert.pem", folder / "key.pem"
    run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)])
    return cert, key


@dataclass
class Registry:
    """A running registry: where it listens and how to talk to it."""

    host: str  # "127.0.0.1:PORT", the part of an image reference before the name
    root: Path  # holds config.yml, the storage, the log and any auth/TLS files
    process: subprocess.Popen[bytes]
    credentials: tuple[str, str] | None = None
    ca_cert: Path | None = None  # the self-signed certificate, when serving TLS
    log: Path = field(default=Path("/dev/null"))

    @property
    def scheme(self) -> str:
        return "https" if self.ca_cert else "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}"

    @property
    def cert_dir(self) -> Path | None:
        """A folder whose ``ca.crt`` is the registry's certificate: skopeo's --cert-dir."""
        return self.ca_cert.parent / "skopeo-certs" if self.ca_cert else None

    def ref(self, name: str) -> str:
        """``docker://HOST/NAME`` (NAME is ``repo:tag`` or ``repo@sha256:...``)."""
        return f"docker://{self.host}/{name}"

    def tls_args(self, prefix: str = "") -> list[str]:
        """skopeo's options to reach this registry: its CA when serving TLS, else plain HTTP.
        ``prefix`` is "dest-" or "src-" for copy, "" for inspect."""
        if self.cert_dir:
            return [f"--{prefix}cert-dir={self.cert_dir}"]
        return [f"--{prefix}tls-verify=false"]

    def creds_args(self, prefix: str = "") -> list[str]:
        return [f"--{prefix}creds={self.credentials[0]}:{self.credentials[1]}"] if self.credentials else []

    def push(self, source: str, name: str, *, all: bool = False) -> str:
        """``skopeo copy`` SOURCE (e.g. ``oci:/path:tag``) to HOST/NAME (``repo:tag``);
        ``all``: every image of an index (``--all``), not only the host's platform.
        Returns the pushed manifest's digest (skopeo's own ``--digestfile``)."""
        digest_file = self.root / f".digest-{os.getpid()}-{time.monotonic_ns()}"
        skopeo("copy", *self.tls_args("dest-"), *self.creds_args("dest-"), *(["--all"] if all else []),
               f"--digestfile={digest_file}", source, self.ref(name))
        digest = digest_file.read_text().strip()
        digest_file.unlink()
        return digest

    def inspect(self, name: str) -> dict:
        """``skopeo inspect`` of HOST/NAME: skopeo's summary (Digest, Architecture, Layers...)."""
        return json.loads(skopeo("inspect", *self.tls_args(), *self.creds_args(), self.ref(name)))

    def raw_manifest(self, name: str) -> bytes:
        """The manifest (or index) bytes as stored, by ``skopeo inspect --raw``."""
        # Bytes, not text: the digest is over the exact bytes (no newline translation).
        return run_bytes(["skopeo", "--insecure-policy", "inspect", "--raw", *self.tls_args(),
                          *self.creds_args(), self.ref(name)])

    def digest(self, name: str) -> str:
        """The manifest digest of ``repo:tag`` (or ``repo@digest``) from the registry's HTTP API: ``HEAD
        /v2/<repo>/manifests/<tag>``'s ``Docker-Content-Digest`` (equal to the sha256 of
        :meth:`raw_manifest`: the tests check both)."""
        # "repo@sha256:..." or "repo:tag" (a tag has no "/", a host:port would come first).
        repo, _, tag = name.partition("@") if "@" in name else name.rpartition(":")
        request = urllib.request.Request(f"{self.url}/v2/{repo}/manifests/{tag}", method="HEAD",
                                         headers={"Accept": ", ".join(MANIFEST_TYPES)})
        if self.credentials:
            token = base64.b64encode(f"{self.credentials[0]}:{self.credentials[1]}".encode()).decode()
            request.add_header("Authorization", f"Basic {token}")
        with self.urlopen(request) as response:
            return response.headers["Docker-Content-Digest"]

    def urlopen(self, request: urllib.request.Request | str, timeout: float = 10):
        """urllib's urlopen, trusting this registry's certificate when it serves TLS."""
        context = ssl.create_default_context(cafile=str(self.ca_cert)) if self.ca_cert else None
        return urllib.request.urlopen(request, timeout=timeout, context=context)

    def write_docker_config(self, home: Path) -> Path:
        """``HOME/.docker/config.json`` holding this registry's credentials, the way
        ``docker login`` stores them; the path written."""
        assert self.credentials, "an anonymous registry needs no credentials"
        token = base64.b64encode(f"{self.credentials[0]}:{self.credentials[1]}".encode()).decode()
        path = home / ".docker" / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"auths": {self.host: {"auth": token}}}, indent=2) + "\n")
        path.chmod(0o600)
        return path


def manifest_digest(raw: bytes) -> str:
    """A manifest's digest: the sha256 of its exact bytes."""
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def _config(root: Path, port: int, htpasswd: Path | None, tls: tuple[Path, Path] | None) -> str:
    """The registry's config.yml (YAML is a superset of JSON: written as JSON, no PyYAML)."""
    config: dict = {
        "version": 0.1,
        "log": {"level": "error"},
        # delete: lets tests remove tags/manifests through the API (gone-image errors).
        "storage": {"filesystem": {"rootdirectory": str(root / "storage")}, "delete": {"enabled": True}},
        "http": {"addr": f"127.0.0.1:{port}"},
        # No health section: the storage-driver health check stays off.
    }
    if htpasswd:
        config["auth"] = {"htpasswd": {"realm": "sequester-test", "path": str(htpasswd)}}
    if tls:
        config["http"]["tls"] = {"certificate": str(tls[0]), "key": str(tls[1])}
    return json.dumps(config, indent=2) + "\n"


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Terminate, give it 5 s to go, then kill; always reap."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
    process.wait()


def _log_tail(log: Path) -> str:
    try:
        return log.read_text(errors="replace")[-4000:].strip() or "(nothing on stderr)"
    except OSError:
        return "(no log)"


def _wait_ready(registry: Registry, timeout: float) -> None:
    """Until ``GET /v2/`` answers 200 (with the credentials, if any)."""
    deadline = time.monotonic() + timeout
    request = urllib.request.Request(f"{registry.url}/v2/")
    if registry.credentials:
        token = base64.b64encode(":".join(registry.credentials).encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    last = "no answer yet"
    while time.monotonic() < deadline:
        if registry.process.poll() is not None:
            raise RuntimeError(f"docker-registry exited {registry.process.returncode} at start-up:\n"
                               f"{_log_tail(registry.log)}")
        try:
            with registry.urlopen(request, timeout=2) as response:
                if response.status == 200:
                    return
                last = f"HTTP {response.status}"
        except urllib.error.HTTPError as error:
            last = f"HTTP {error.code}"
        except (OSError, ssl.SSLError) as error:
            last = str(error)
        time.sleep(0.05)
    raise RuntimeError(f"docker-registry did not answer 200 on {registry.url}/v2/ within {timeout:g} s "
                       f"(last: {last}); its stderr:\n{_log_tail(registry.log)}")


@contextmanager
def running_registry(root: Path, *, auth: tuple[str, str] | None = None, tls: bool = False,
                     timeout: float = 20) -> Iterator[Registry]:
    """A registry serving on a free loopback port with its storage under ``root``.

    ``auth=(user, password)``: htpasswd auth (skips without htpasswd or bcrypt). ``tls``:
    HTTPS with a self-signed certificate (skips without openssl). The process is stopped
    and reaped on exit, whatever the test did.
    """
    if not os.access(REGISTRY_BINARY, os.X_OK):
        pytest.skip(f"needs {REGISTRY_BINARY} (Debian package docker-registry; .ci/run installs it)")
    root.mkdir(parents=True, exist_ok=True)
    htpasswd = None
    if auth:
        htpasswd = root / "htpasswd"
        htpasswd.write_text(htpasswd_line(*auth) + "\n")
    cert_key = self_signed_cert(root / "tls") if tls else None
    if cert_key:
        certs = root / "tls" / "skopeo-certs"
        certs.mkdir(exist_ok=True)
        shutil.copy(cert_key[0], certs / "ca.crt")
    log = root / "registry.log"
    for attempt in range(3):
        port = _free_port()
        (root / "config.yml").write_text(_config(root, port, htpasswd, cert_key))
        with open(log, "wb") as stderr:
            process = subprocess.Popen([REGISTRY_BINARY, "serve", str(root / "config.yml")],
                                       stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr)
        registry = Registry(f"127.0.0.1:{port}", root, process, auth, cert_key[0] if cert_key else None, log)
        try:
            _wait_ready(registry, timeout)
        except RuntimeError:
            _stop(process)
            # A port taken between _free_port and the bind: try another one.
            if attempt < 2 and "address already in use" in _log_tail(log):
                continue
            raise
        except BaseException:
            _stop(process)
            raise
        break
    try:
        yield registry
    finally:
        _stop(registry.process)
