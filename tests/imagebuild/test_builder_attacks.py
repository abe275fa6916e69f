"""Red team of ``sequester build`` (:mod:`sequester.imagebuild.builder`): the Dockerfile, its base layers and everything its RUN
lines write are the attacker's. Each test is one attack, asserting the protection holds
(HOLE in a docstring: it did not when written). A busybox base for every caller (its
``nc`` speaks raw HTTP to the proxy). Host-global state (a sysctl, a device node) is
attacked with harmless values and put back."""

from __future__ import annotations

import contextlib
import io
import ipaddress
import os
import socket
import subprocess
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from images import busybox_rootfs
from registry import skip_unless_tools

from sequester.imagebuild import BuildError, BuildOptions, build_image
from sequester.imagebuild.context import context_sources
from sequester.errors import BuildTimeout
from sequester.imagebuild.steps import CopyStep
from sequester.sandbox.cgroups.hierarchy import find_v1
from sequester.sandbox.remove import remove_tree
from sequester.images import ImageSettings, ImageStore
from sequester.images.stack import image_path_kind
from sequester.net.build.network import BuildNetwork
from sequester.net.build.proxy import BuildProxy
from sequester.net.build.upstream import Upstream, UpstreamProxy

BASE = "test/bb:1"
ROOT = os.geteuid() == 0
LEASE = Path("/proc/sys/fs/lease-break-time")  # a global sysctl whose value nothing here depends on


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> ImageStore:
    skip_unless_tools("skopeo")
    s = ImageStore(ImageSettings(store_dir=tmp_path_factory.mktemp("rt-store") / "store"))
    s.import_source(str(busybox_rootfs()), BASE)
    return s


class _Capture:
    """What the steps print (the first 4 MiB)."""

    def __init__(self):
        self.data = bytearray()
        self.step = lambda report, done: None

    def output(self, data: bytes):
        self.data += data[:max(0, (4 << 20) - len(self.data))]


def _build(store, runner, folder: Path, dockerfile: str, files=None, network="none", **kw):
    """(result or the BuildError, everything the steps printed)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "Dockerfile").write_text(dockerfile)
    for name, content in (files or {}).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    factory = kw.pop("proxy_factory", None)
    out = _Capture()
    try:
        result = build_image(store, folder / "Dockerfile", folder, name=f"localhost/rt/{folder.name}:1", runner=runner,
                             options=BuildOptions(network=BuildNetwork(network), no_cache=True, **kw), reporter=out,
                             proxy_factory=factory)
    except BuildError as exc:
        result = exc
    return result, out.data.decode(errors="replace")


def _tar(*members: tuple) -> bytes:
    """A tar of (name, content) files, (name, None, tarfile.SYMTYPE|LNKTYPE, target) links."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, body, *link in members:
            info = tarfile.TarInfo(name)
            info.mode, info.size = 0o644, len(body or b"")
            if link:
                info.type, info.linkname = link
            tar.addfile(info, io.BytesIO(body) if body is not None else None)
    return buf.getvalue()


def _fingerprint(top: Path) -> set[tuple]:
    return {(p, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns) for folder, dirs, files in os.walk(top)
            for p in (os.path.join(folder, n) for n in dirs + files) for st in (os.lstat(p),)}


@pytest.fixture
def lease_time() -> Iterator[int]:
    value = int(LEASE.read_text())
    yield value
    if int(LEASE.read_text()) != value:
        LEASE.write_text(f"{value}\n")


# -- 1. host files ------------------------------------------------------------------------

def test_run_cannot_write_the_kernels_global_settings(store, runner, tmp_path, lease_time):
    """HOLE as root: /proc/sys is writable by host uid 0 (core_pattern "|cmd": cmd runs as host
    root at the next crash); bwrap covers it only if access(W_OK) works, and it never does."""
    _, out = _build(store, runner, tmp_path / "sysctl", f"""FROM {BASE}
RUN (echo {lease_time + 1} > /proc/sys/fs/lease-break-time) 2>/dev/null && echo SYSCTL-WRITTEN; \
(: >> /proc/sys/kernel/core_pattern) 2>/dev/null && echo CORE-PATTERN-OPEN; \
(: >> /proc/sysrq-trigger) 2>/dev/null && echo SYSRQ-OPEN; true
""")
    assert int(LEASE.read_text()) == lease_time
    assert "SYSCTL-WRITTEN" not in out and "CORE-PATTERN-OPEN" not in out and "SYSRQ-OPEN" not in out


def test_add_archive_cannot_write_the_kernels_global_settings(store, runner, tmp_path, lease_time):
    """HOLE as root: the copier extracts into the live /proc (a member proc/sys/...)."""
    tar = _tar(("proc/sys/fs/lease-break-time", f"{lease_time + 1}\n".encode()))
    _build(store, runner, tmp_path / "addsysctl", f"FROM {BASE}\nADD s.tar /\n", {"s.tar": tar})
    assert int(LEASE.read_text()) == lease_time


def test_run_cannot_change_the_hosts_device_nodes(store, runner, tmp_path):
    """HOLE as root: bwrap binds the host's /dev/full etc. read-write; host uid 0 with
    CAP_FOWNER chmods them (chmod 000 /dev/null breaks the host). Same mode here: harmless."""
    before = os.stat("/dev/full").st_ctime_ns
    _, out = _build(store, runner, tmp_path / "dev", f"FROM {BASE}\nRUN chmod 666 /dev/full && echo CHMOD-DONE; true\n")
    assert "CHMOD-DONE" not in out and os.stat("/dev/full").st_ctime_ns == before


def test_mount_stub_removal_does_not_follow_a_link_out_of_the_layer(store, runner, tmp_path):
    """HOLE: /opt made a link to a host folder; drop_mount_stubs lstat()s and rmdir()s
    upper/opt/sequester-verifier through it, removing the host's empty folder."""
    victim = tmp_path / "victim" / "sequester-verifier"
    victim.mkdir(parents=True)
    _build(store, runner, tmp_path / "stub", f"FROM {BASE}\nRUN rm -rf /opt; ln -s {victim.parent} /opt\n")
    assert victim.is_dir(), "a folder on the host was removed by the build"


def test_image_path_kind_follows_no_link_below_an_opaque_folder(tmp_path):
    """HOLE: below an opaque folder the rest is is_dir()'d on the host, following links (a
    WORKDIR tells the build whether a host folder exists), and a link reads as absent (so
    /opt/sequester-verifier -> /oldroot/... passes _check_mount_points)."""
    host, layer = tmp_path / "host", tmp_path / "layer"
    (host / "exists").mkdir(parents=True)
    (layer / "a").mkdir(parents=True)
    os.setxattr(layer / "a", "user.overlay.opaque", b"y")
    (layer / "a" / "b").symlink_to(host)
    (layer / "a" / "sequester-verifier").symlink_to("/oldroot/tmp")
    assert image_path_kind([layer], "a/b/exists") == "other"
    assert image_path_kind([layer], "a/sequester-verifier") == "other"


def test_copy_and_add_cannot_write_the_verifiers_runner(store, runner, tmp_path):
    before = _fingerprint(runner)
    marker = tmp_path / "escaped"
    cases = {
        "members": _tar(("opt/sequester-verifier/ready", b"x"), ("opt/sequester-verifier/bin/python3", b"x")),
        "through-a-link": _tar(("l", None, tarfile.SYMTYPE, "/opt/sequester-verifier/bin"), ("l/python3", b"x")),
        "hardlink": _tar(("h", None, tarfile.LNKTYPE, "opt/sequester-verifier/ready")),
        "outside": _tar((f"../../../../..{marker}", b"x"), (str(marker), b"x")),
    }
    for name, tar in cases.items():
        _build(store, runner, tmp_path / name, f"FROM {BASE}\nADD a.tar /\n", {"a.tar": tar})
    for i, line in enumerate(("COPY f /opt/sequester-verifier/bin/python3", "WORKDIR /opt/sequester-verifier/new",
                              "COPY --chmod=777 f /opt/sequester-verifier/", "COPY f /dev/.sequester/src/f")):
        result, _ = _build(store, runner, tmp_path / f"copy{i}", f"FROM {BASE}\n{line}\n", {"f": "x"})
        assert isinstance(result, BuildError), line
    assert _fingerprint(runner) == before and not marker.exists()
    assert (tmp_path / "copy3" / "f").read_text() == "x" and len(os.listdir(tmp_path / "copy3")) == 2  # the context


def test_context_links_out_of_the_context_are_refused(store, runner, tmp_path):
    (folder := tmp_path / "ctx").mkdir()
    (folder / "etc").symlink_to("/etc")
    for line in ("COPY etc/passwd /x", "COPY ../ /x/", "COPY etc /x/"):
        result, _ = _build(store, runner, folder, f"FROM {BASE}\n{line}\n")
        assert isinstance(result, BuildError), line


def test_run_cannot_change_the_layers_below_it(store, runner, tmp_path):
    (lease := store.lease(store.get(BASE))).release()
    before = {layer: _fingerprint(layer) for layer in lease.layers}
    result, out = _build(store, runner, tmp_path / "lower", f"""FROM {BASE}
RUN echo x >> /etc/passwd; chmod 777 /bin/busybox; touch /etc/group; rm -f /bin/ls; ln /bin/busybox /hl; \
mv /etc /etc2; echo done
""")
    assert not isinstance(result, BuildError) and "done" in out
    assert {layer: _fingerprint(layer) for layer in lease.layers} == before


# -- 4. cache integrity --------------------------------------------------------------------

def test_context_digest_tells_apart_names_and_link_targets_with_newlines(tmp_path):
    """HOLE: "L name target\\n" / "F name mode size\\n", unescaped: a link whose target holds
    "\\nF run.sh 644 12\\n..." hashes as a link plus a file: two contexts, one cache key."""
    script = "echo benign\n"
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (b / "l").symlink_to("x")
    (b / "run.sh").write_text(script)
    os.chmod(b / "run.sh", 0o644)
    (a / "l").symlink_to(f"x\nF run.sh 644 {len(script)}\n{script[:-1]}")
    step = CopyStep(1, "COPY . /app/", "", False, (".",), "/app", True)
    assert context_sources(step, a, "A").digest != context_sources(step, b, "B").digest


# -- 3. host robustness ---------------------------------------------------------------------

@pytest.mark.slow
def test_prune_survives_a_deep_tree_in_a_layer(store, runner, tmp_path):
    """HOLE: cleanup._size walks with os.walk (recursive before 3.12): a RUN's 1,200-deep
    folders make every 'image prune' / 'image rm' raise RecursionError."""
    result, _ = _build(store, runner, tmp_path / "deep", f"""FROM {BASE}
RUN mkdir /w && cd /w && mkdir a && i=0; while [ $i -lt 1200 ]; do mkdir b && mv a b/a && mv b a || exit 1; \
i=$((i+1)); done
""")
    assert not isinstance(result, BuildError), result
    built = [store.root / "layers" / ref.diff_id.split(":")[1] for ref in result.record.layers[1:]]
    try:
        store.remove(result.record.id)
        store.prune()
        assert not any(layer.is_dir() for layer in built)
    finally:  # pytest's own clean-up of old temporary folders (shutil.rmtree) would recurse too deep
        for layer in built:
            remove_tree(layer)


def test_a_tag_is_never_taken_for_an_image_id_prefix(store, runner, tmp_path):
    """HOLE: ImageStore.find takes what follows the ':' of a 12+ character name as an id
    prefix: FROM/COPY --from=ghcr.io/a/b:1 (or 'image rm') gets any image whose id starts '1'."""
    result, _ = _build(store, runner, tmp_path / "tagged", f"FROM {BASE}\nRUN echo x > /x\n")
    tag = result.record.id.split(":")[1][:2]
    assert store.find(f"localhost/nobody/gave-this:{tag}") is None


@pytest.mark.parametrize("network", ["none", "public"])
def test_run_gets_the_process_limits_with_or_without_network(store, runner, tmp_path, network):
    """HOLE (none; a race): held (--block-fd) only with a proxy, the command may start before
    the pids cgroup and RLIMIT_NPROC land on the sandbox's init (root: a fork bomb is free)."""
    _, out = _build(store, runner, tmp_path / f"nproc-{network}", f"FROM {BASE}\nRUN echo nproc=$(ulimit -u); "
                    "grep pids /proc/self/cgroup; true\n", network=network)
    assert "nproc=4096" in out
    if ROOT and find_v1("pids") is not None:  # root: the step's own pids cgroup
        assert "-build" in out.split("pids:", 1)[1].split("\n", 1)[0]


def test_nothing_outlives_the_step_and_no_host_fd_is_inside(store, runner, tmp_path):
    tag = f"98{os.getpid() % 1000:03d}7"
    _, out = _build(store, runner, tmp_path / "procs", f"""FROM {BASE}
RUN (setsid sleep {tag} &); (nohup sleep {tag} >/dev/null 2>&1 &); sleep {tag} </dev/null >/dev/null 2>&1 & \
for f in /proc/1/fd/* /proc/$$/fd/*; do echo "FD $f $(readlink $f)"; done
""")
    time.sleep(0.5)
    assert f"sleep {tag}" not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    fds = [line.split(" ", 2)[2] for line in out.splitlines() if line.startswith("FD ")]
    assert fds and all(t == "/dev/null" or t.startswith(("pipe:", "anon_inode:", "/proc/")) for t in fds), fds


@pytest.mark.slow
def test_timeout_kills_a_step_that_ignores_sigterm_and_floods_output(store, runner, tmp_path):
    started = time.monotonic()
    result, _ = _build(store, runner, tmp_path / "slow", f"FROM {BASE}\nRUN trap '' TERM INT HUP; "
                       "(trap '' TERM; sleep 1000) & yes | head -c 30000000; sleep 1000\n", timeout=6)
    assert isinstance(result, BuildTimeout) and time.monotonic() - started < 30
    assert len(str(result)) < 5000


def test_copy_from_an_empty_stage_is_a_build_error_or_nothing(store, runner, tmp_path):
    """HOLE (robustness): no layers -> --ro-overlay of no source: a SandboxError."""
    _build(store, runner, tmp_path / "empty", f"FROM scratch AS e\nFROM {BASE}\nCOPY --from=e / /x/\n")  # or BuildError


@pytest.mark.slow
@pytest.mark.parametrize("network", ["none", "public"])
def test_a_sandbox_that_cannot_be_made_is_a_build_error(store, runner, tmp_path, network):
    """HOLE (robustness): ~30 layers overflow the overlay's mount options (a page); bwrap
    dies after reporting its pid: ProcessLookupError (enrol, prlimit) or BrokenPipeError."""
    lines = "".join(f"RUN echo {i} > /f{i}\n" for i in range(45))
    _build(store, runner, tmp_path / f"many-{network}", f"FROM {BASE}\n{lines}", network=network)  # or BuildError


# -- 2. network ---------------------------------------------------------------------------------

@pytest.fixture
def host_service() -> Iterator[tuple[int, list]]:
    """A dual-stack TCP service on every host address; the list collects who connected."""
    server = socket.socket(socket.AF_INET6)
    server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    server.bind(("::", 0))
    server.listen(64)
    hits: list = []

    def answer(conn):
        hits.append(conn.getpeername())
        conn.sendall(b"HTTP/1.0 200 OK\r\n\r\nHOST-SECRET\n")
        conn.close()
    threading.Thread(target=_accept_loop, args=(server, answer), daemon=True).start()
    yield server.getsockname()[1], hits
    server.close()


def _accept_loop(server: socket.socket, handle) -> None:
    with contextlib.suppress(OSError):
        while True:
            handle(server.accept()[0])


def _host_addresses() -> list[str]:
    out = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout  # iproute2: Debian's own
    return [f.split()[3].split("/")[0] for f in out.splitlines() if len(f.split()) > 3]


def _requests(port: int) -> dict[str, str]:
    hosts = ["127.0.0.1", "[::1]", "[::ffff:127.0.0.1]", "2130706433", "0177.0.0.1", "0x7f000001", "127.1",
             "localhost", "localhost.", "LocalHost", "0", "0.0.0.0", "[::]", "[64:ff9b::7f00:1]", "[2002:7f00:1::]",
             "[::127.0.0.1]", "169.254.169.254", "10.0.0.1"]
    for address in _host_addresses():
        ip = ipaddress.ip_address(address)
        hosts += [f"[{ip}]", f"[::ffff:{ip}]"] if ip.version == 6 else [str(ip), str(int(ip)), f"[::ffff:{ip}]"]
    reqs = {f"c{i}": f"CONNECT {host}:{port} HTTP/1.1\r\n\r\n" for i, host in enumerate(hosts)}
    reqs |= {f"g{i}": f"GET http://{host}:{port}/ HTTP/1.1\r\nHost: x\r\n\r\n" for i, host in enumerate(hosts)}
    reqs["userinfo"] = f"GET http://example.com@127.0.0.1:{port}/ HTTP/1.1\r\n\r\n"
    reqs["fragment"] = f"GET http://127.0.0.1:{port}#@example.com/ HTTP/1.1\r\n\r\n"
    return reqs


_SEND = "for f in /reqs/*; do timeout 5 nc 127.0.0.1 3128 < $f; echo; done; " \
        "for a in 127.0.0.1 ::1 {addresses}; do timeout 3 nc $a {port} </dev/null; done; true"


def _send(port: int) -> str:
    return _SEND.format(port=port, addresses=" ".join(_host_addresses()))


@pytest.mark.parametrize("mode", ["public", "allowlist", "none"])
def test_proxy_never_reaches_the_host_whatever_the_spelling(store, runner, tmp_path, host_service, mode):
    port, hits = host_service
    reqs = _requests(port)
    files = {f"reqs/{k}": v for k, v in reqs.items()}
    network = BuildNetwork(mode, ("example.com",) if mode == "allowlist" else ())
    _, out = _build(store, runner, tmp_path / f"net-{mode}", f"FROM {BASE}\nCOPY reqs /reqs\n"
                    f"RUN --network=default {_send(port)}\n", files, network=mode,
                    proxy_factory=None if mode == "none" else (lambda: BuildProxy(network)))
    assert hits == [] and "HOST-SECRET" not in out
    answered = out.count("HTTP/1.1 403 ") + out.count("HTTP/1.1 400 ")
    assert answered == (0 if mode == "none" else len(reqs)), out  # every one refused by the proxy (none: no proxy)


def test_host_abstract_unix_sockets_are_not_reachable(store, runner, tmp_path):
    name = f"sequester-rt-{os.getpid()}"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind("\0" + name)
        listener.listen(1)
        _, out = _build(store, runner, tmp_path / "abstract", f"FROM {BASE}\nRUN grep -c {name} /proc/net/unix; "
                                                               "echo checked\n")
    assert "checked" in out and f"@{name}" not in out and out.split("\n", 1)[0].strip() == "0"


def test_proxy_lets_no_request_be_smuggled_to_the_hosts_upstream_proxy(store, runner, tmp_path, host_service):
    """HOLE (an upstream proxy in the host's environment): headers go on as read, so a bare
    LF ends the head, for an upstream that takes LF (most do), before the proxy's own
    Connection: close: the rest is a second request nobody checked (here: host loopback)."""
    port, hits = host_service
    upstream = socket.create_server(("127.0.0.1", 0))

    def handle(conn):  # a lenient upstream: LF or CRLF ends a line, keep-alive unless told to close
        buf = b""
        while b"connection: close" not in buf.lower() and (data := conn.recv(65536)):
            buf += data.replace(b"\r\n", b"\n")
            while b"\n\n" in buf:
                head, _, buf = buf.partition(b"\n\n")
                host, _, p = head.split()[1].decode().split("/")[2].rpartition(":")
                if host == "127.0.0.1":
                    with socket.create_connection((host, int(p))) as t:
                        t.sendall(b"GET / HTTP/1.0\r\n\r\n")
                        conn.sendall(t.recv(65536))
                if b"connection: close" in head.lower():
                    break
        conn.close()

    threading.Thread(target=_accept_loop, args=(upstream, handle), daemon=True).start()
    request = (f"GET http://93.184.216.34/ HTTP/1.1\r\nHost: a\r\nX: y\n\nGET http://127.0.0.1:{port}/ HTTP/1.1\r\n"
               "Host: b\r\n\r\n")
    via = Upstream(http=UpstreamProxy("127.0.0.1", upstream.getsockname()[1]))
    try:
        _, out = _build(store, runner, tmp_path / "smuggle", f"FROM {BASE}\nCOPY reqs /reqs\nRUN {_send(1)}\n",
                        {"reqs/1": request}, network="public",
                        proxy_factory=lambda: BuildProxy(BuildNetwork("public"), upstream=via))
    finally:
        upstream.close()
    assert "HOST-SECRET" not in out and hits == []


@pytest.mark.slow
def test_proxy_survives_a_connection_flood_and_slow_heads(store, runner, tmp_path):
    started = time.monotonic()
    _, out = _build(store, runner, tmp_path / "flood", f"""FROM {BASE}
RUN i=0; while [ $i -lt 40 ]; do (sleep 4 | nc 127.0.0.1 3128 >/dev/null 2>&1 &); i=$((i+1)); done; sleep 0.5; \
printf 'CONNECT 127.0.0.1:1 HTTP/1.1\\r\\n\\r\\n' | timeout 5 nc 127.0.0.1 3128; sleep 3; \
printf 'CONNECT 127.0.0.1:1 HTTP/1.1\\r\\n\\r\\n' | timeout 5 nc 127.0.0.1 3128; true
""", network="public", proxy_factory=lambda: BuildProxy(BuildNetwork("public"), max_connections=8, head_timeout=1))
    assert "503" in out and "403" in out and time.monotonic() - started < 60
