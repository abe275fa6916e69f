"""The build proxy (:mod:`sequester.net.build.proxy`): on host sockets, and with its listener inside a real bwrap sandbox.

Real sockets throughout; the sandbox tests run curl in a bwrap sandbox with only ``lo``,
reaching the package indexes (pypi.org, deb.debian.org) through the proxy only. The
policy it applies, unit by unit: tests/net/test_build_network.py.
"""

from __future__ import annotations

import ipaddress
import json
import os
import pwd
import socket
import socketserver
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from paths import HELPERS, SRC
from proxied_curl import curl, start_sandbox
from services import own_address

from sequester.errors import SandboxError
from sequester.net.build.network import Upstream, UpstreamProxy, parse_build_network, parse_host_rule
from sequester.net.build.proxy import BuildProxy
from sequester.net.netns_listener import open_listener_in
from sequester.sandbox.probe import bwrap_path



# -- the proxy, on host sockets ----------------------------------------------------------

@contextmanager
def host_proxy(policy="public", hosts=(), **options):
    """A proxy serving a listener on the host's loopback (its clients: this test)."""
    proxy = BuildProxy(parse_build_network(policy, hosts), upstream=options.pop("upstream", Upstream()), **options)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    proxy.serve(listener)
    try:
        yield proxy, port
    finally:
        proxy.close()


CLIENTS: list[socket.socket] = []


@pytest.fixture(autouse=True)
def _close_clients():
    yield
    while CLIENTS:
        CLIENTS.pop().close()


def ask(port, head: bytes, timeout=10):
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    CLIENTS.append(sock)
    sock.sendall(head)
    return sock


def answer(sock) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data and (chunk := sock.recv(4096)):
        data += chunk
    return data


@contextmanager
def tcp_service(handler, host="127.0.0.1"):
    class Handler(socketserver.BaseRequestHandler):
        def handle(self):
            handler(self.request)

    server = socketserver.ThreadingTCPServer((host, 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def echo(sock):
    sock.settimeout(30)
    try:
        while data := sock.recv(4096):
            sock.sendall(data)
    except OSError:
        pass


def test_configured_index_may_be_loopback_only_if_it_names_loopback():
    with tcp_service(echo) as port, host_proxy(index_hosts=frozenset({f"127.0.0.1:{port}"}), connect_timeout=1) as (
            proxy, pport):
        ok = ask(pport, f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode())
        assert answer(ok).startswith(b"HTTP/1.1 200")
        ok.sendall(b"ping")
        assert ok.recv(4) == b"ping"
        other = answer(ask(pport, f"CONNECT 127.0.0.1:{port + 1 if port < 65535 else 1} HTTP/1.1\r\n\r\n".encode()))
        assert other.startswith(b"HTTP/1.1 403") and b"loopback" in other
        assert proxy._address_refusal(ipaddress.ip_address("127.0.0.1"), parse_host_rule("localhost:80")) is None
        assert proxy._address_refusal(ipaddress.ip_address("127.0.0.1"), parse_host_rule("mirror.corp:80"))
        assert proxy._address_refusal(ipaddress.ip_address("10.0.0.1"), parse_host_rule("mirror.corp:80")) is None
    with host_proxy(index_hosts=frozenset({"10.1.2.3:80"}), connect_timeout=0.5) as (proxy, pport):
        # A configured private mirror is not refused (whatever answers there, or nothing: 502).
        head = answer(ask(pport, b"GET http://10.1.2.3/x HTTP/1.1\r\nHost: 10.1.2.3\r\n\r\n"))
        assert head.startswith(b"HTTP/1.1 ") and not head.startswith(b"HTTP/1.1 403")
        assert proxy.refusals == []


def test_private_literal_refused_without_connecting():
    with host_proxy(connect_timeout=30) as (proxy, port):
        start = time.monotonic()
        head = answer(ask(port, b"CONNECT 10.1.2.3:443 HTTP/1.1\r\nHost: 10.1.2.3\r\n\r\n"))
        assert time.monotonic() - start < 2  # a connection attempt would hang for 30 s
        assert head.startswith(b"HTTP/1.1 403") and b"X-Sequester-Reason: 10.1.2.3:443: 10.1.2.3 is private" in head
        assert proxy.refusals == ["10.1.2.3:443: 10.1.2.3 is private (RFC 1918)"]


def test_close_ends_open_tunnels():
    with tcp_service(echo) as port:
        proxy_cm = host_proxy(index_hosts=frozenset({f"127.0.0.1:{port}"}))
        proxy, pport = proxy_cm.__enter__()
        tunnels = [ask(pport, f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode()) for _ in range(3)]
        for t in tunnels:
            assert answer(t).startswith(b"HTTP/1.1 200")
        start = time.monotonic()
        proxy.close()
        proxy.close()  # idempotent
        assert time.monotonic() - start < 5
        for t in tunnels:
            try:
                assert t.recv(10) == b""
            except ConnectionResetError:
                pass
        proxy_cm.__exit__(None, None, None)
        assert proxy.stats.bytes_out == 0
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", pport), timeout=2)


def test_slowloris_head_is_cut_at_the_deadline():
    with host_proxy(head_timeout=1.0) as (_, port):
        sock = ask(port, b"CONNECT pypi.org:443 HTTP/1.1\r\n")
        start, got = time.monotonic(), b""
        try:
            for _ in range(40):
                sock.sendall(b"X")  # one header byte at a time, never the blank line
                time.sleep(0.1)
                sock.setblocking(False)
                try:
                    got += sock.recv(4096)
                except BlockingIOError:
                    pass
                sock.setblocking(True)
                if got:
                    break
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert got.startswith(b"HTTP/1.1 408") and time.monotonic() - start < 3


def test_more_than_max_connections_refused_without_hanging():
    with host_proxy(max_connections=2, head_timeout=30) as (proxy, port):
        held = [ask(port, b"") for _ in range(2)]
        time.sleep(0.3)
        head = answer(ask(port, b"", timeout=3))
        assert head.startswith(b"HTTP/1.1 503") and b"too many connections" in head
        assert proxy.stats.n_over_limit == 1
        held[0].close()
        time.sleep(0.3)
        again = answer(ask(port, b"CONNECT 10.0.0.1:1 HTTP/1.1\r\n\r\n"))
        assert again.startswith(b"HTTP/1.1 403")


@pytest.mark.slow
def test_idle_tunnel_closed_and_plain_http_rewritten():
    seen = []

    def http(sock):
        seen.append(sock.recv(4096))
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    with tcp_service(echo) as eport, tcp_service(http) as hport, host_proxy(
            idle_timeout=1.0, index_hosts=frozenset({f"127.0.0.1:{eport}", f"127.0.0.1:{hport}"})) as (proxy, port):
        t = ask(port, f"CONNECT 127.0.0.1:{eport} HTTP/1.1\r\n\r\n".encode())
        assert answer(t).startswith(b"HTTP/1.1 200")
        start = time.monotonic()
        assert t.recv(10) == b"" and 0.8 < time.monotonic() - start < 3
        r = ask(port, f"GET http://127.0.0.1:{hport}/a?b=1 HTTP/1.1\r\nHost: x\r\nProxy-Connection: keep-alive\r\n\r\n"
                .encode())
        assert answer(r).startswith(b"HTTP/1.1 200")
        assert seen[0] == b"GET /a?b=1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        assert proxy.stats.bytes_in > 0 and proxy.stats.bytes_out >= len(seen[0])
        assert answer(ask(port, b"BREW coffee\r\n\r\n")).startswith(b"HTTP/1.1 400")
        assert answer(ask(port, b"CONNECT a%2fb:443 HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 400")


def test_chains_through_the_hosts_upstream_proxy():
    heads = []

    def upstream(sock):
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(4096)
        heads.append(data)
        sock.sendall(b"HTTP/1.1 200 OK\r\n\r\n" if data.startswith(b"CONNECT") else b"HTTP/1.1 204 No\r\n\r\n")
        echo(sock)

    with tcp_service(upstream) as up:
        via = UpstreamProxy("127.0.0.1", up, authorization="Basic eA==")
        with host_proxy(upstream=Upstream(http=via, https=via, no_proxy=("nothing.example",))) as (proxy, port):
            for target in ("pypi.org:443", "no-such-name.invalid:443"):  # the latter: the upstream resolves it
                t = ask(port, f"CONNECT {target} HTTP/1.1\r\n\r\n".encode())
                assert answer(t).startswith(b"HTTP/1.1 200")
                t.sendall(b"tls?")
                assert t.recv(4) == b"tls?"
                assert heads[-1].startswith(f"CONNECT {target} HTTP/1.1\r\n".encode())
                assert b"Proxy-Authorization: Basic eA==" in heads[-1]
            plain = answer(ask(port, b"GET http://deb.debian.org/debian/ HTTP/1.1\r\nHost: deb.debian.org\r\n\r\n"))
            assert plain.startswith(b"HTTP/1.1 204")
            assert heads[-1].startswith(b"GET http://deb.debian.org:80/debian/ HTTP/1.1\r\n")
            n = len(heads)
            for target in ("10.1.2.3:443", "localhost:443", "127.1:443"):  # refused here, never forwarded
                assert answer(ask(port, f"CONNECT {target} HTTP/1.1\r\n\r\n".encode())).startswith(b"HTTP/1.1 403")
            assert len(heads) == n


# -- in a real sandbox -----------------------------------------------------------------------

def test_sandbox_reaches_public_indexes_only_through_the_proxy():
    status, _, proxy = curl("https://pypi.org/simple/")
    assert status == 200 and proxy.stats.bytes_in > 1000  # CONNECT
    status, _, _ = curl("http://deb.debian.org/debian/dists/bookworm/Release")
    assert status == 200  # absolute-form, as apt asks


def test_sandbox_nested_userns_listener():
    # The listener is made once the sandbox's init sits in bwrap's nested user namespace,
    # which has no rights over the network namespace: joined through its owner instead.
    status, _, _ = curl("https://pypi.org/simple/pip/", extra=("--disable-userns",), late=True)
    assert status == 200


def test_sandbox_cannot_reach_host_services():
    with tcp_service(echo, host="0.0.0.0") as port:
        status, reason, proxy = curl(f"http://127.0.0.1:{port}/", direct_loopback=False)
        assert status == 403 and reason == f"127.0.0.1:{port}: 127.0.0.1 is loopback (the host's own services)"
        status, reason, _ = curl(f"http://localhost:{port}/", direct_loopback=False)
        assert status == 403 and reason.startswith(f"localhost:{port}: localhost -> ") and "loopback" in reason
        ip = own_address()
        if ip is not None:
            status, reason, _ = curl(f"https://{ip}:{port}/")
            assert status == 403 and reason == f"{ip}:{port}: {ip} is an address of this host"
    status, reason, proxy = curl("http://10.1.2.3/")
    assert status == 403 and "private" in reason and proxy.refusals == [f"10.1.2.3:80: {reason.split(': ', 1)[1]}"]
    status, reason, _ = curl("http://169.254.169.254/latest/meta-data/")
    assert status == 403 and "metadata" in reason


def test_sandbox_modes_none_and_allowlist():
    status, reason, _ = curl("https://pypi.org/simple/pip/", "none")
    assert status == 403 and reason == "pypi.org:443: the build network is 'none'"
    status, _, _ = curl("https://pypi.org/simple/pip/", "allowlist", ["pypi.org"])
    assert status == 200
    status, reason, _ = curl("http://deb.debian.org/debian/dists/bookworm/Release", "allowlist", ["pypi.org"])
    assert status == 403 and reason == "deb.debian.org:80: not in allowed_hosts"
    status, _, _ = curl("http://deb.debian.org/debian/dists/bookworm/Release", "allowlist", ["203.0.113.0/24"])
    assert status == 200  # a name whose address is in a listed network


def test_listener_errors():
    with pytest.raises(SandboxError, match="cannot open the network namespace"):
        open_listener_in(2 ** 22 + 12345)
    with pytest.raises(SandboxError, match="not a sandbox"):
        open_listener_in(os.getpid())
    proc, info, unblock = start_sandbox(["true"], {"PATH": "/usr/bin:/bin"})
    try:
        with pytest.raises(SandboxError, match="pid was reused"):
            open_listener_in(info["child-pid"], net_namespace=info["net-namespace"] + 1)
        first = open_listener_in(info["child-pid"], 0)
        with pytest.raises(SandboxError, match="Address already in use"):
            open_listener_in(info["child-pid"], first.getsockname()[1])
        first.close()
    finally:
        os.close(unblock)
        proc.kill()
        proc.communicate()


UNPRIVILEGED = r'''
import json, os, subprocess, sys
sys.path.insert(0, sys.argv[1])
os.environ["SEQUESTER_BWRAP"] = sys.argv[2]
import proxied_curl as t
out = {"uid": os.getuid()}
out["pypi"] = t.curl("https://pypi.org/simple/pip/")[0]
out["deb"] = t.curl("http://deb.debian.org/debian/dists/bookworm/Release")[0]
out["nested"] = t.curl("https://pypi.org/simple/pip/", extra=("--disable-userns",), late=True)[0]
out["private"] = t.curl("http://10.1.2.3/")[:2]
print(json.dumps(out))
'''


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to the ordinary user needs root")
def test_listener_as_an_ordinary_user():
    try:
        pwd.getpwnam("cloudsdk")
    except KeyError:
        pytest.skip("no user cloudsdk")
    # Debian's Python (the venv's is under /root), with sequester's source, the tests' helpers
    # (proxied_curl) and the venv's pure-Python packages: all world-readable.
    site = Path(pytest.__file__).resolve().parent.parent
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPATH": f"{SRC}:{HELPERS}:{site}"}
    if not Path("/usr/bin/python3").exists():
        pytest.skip("needs /usr/bin/python3")
    argv = ["runuser", "-u", "cloudsdk", "--", "/usr/bin/python3", "-c", UNPRIVILEGED, str(SRC), bwrap_path()]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd="/tmp")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["uid"] == pwd.getpwnam("cloudsdk").pw_uid
    assert (out["pypi"], out["deb"], out["nested"]) == (200, 200, 200)
    assert out["private"][0] == 403 and "private" in out["private"][1]
