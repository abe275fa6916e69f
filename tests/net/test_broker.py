"""The host-side broker (:mod:`sequester.net.broker`), driven over its real control socket as the bridge drives it."""

import socket

import pytest

from sequester import Endpoint
from sequester.net.broker import Broker


@pytest.fixture
def broker_factory():
    brokers = []

    def make(*allow, **options):
        broker = Broker(allow, connect_timeout=3, **options)
        control = broker.start()
        brokers.append((broker, control))
        return broker, control

    yield make
    for broker, control in brokers:
        control.close()
        broker.close()


def channel(control: socket.socket) -> socket.socket:
    control.sendall(b"+")
    _, fds, _, _ = socket.recv_fds(control, 1, 1)
    sock = socket.socket(fileno=fds[0])
    sock.settimeout(5)
    return sock


def read_head(sock, rest=None):
    """The response head; bytes that came after it go to ``rest``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    head, _, after = data.partition(b"\r\n\r\n")
    if rest is not None:
        rest.append(after)
    return head + b"\r\n\r\n"


def test_connect_allowed_and_refused(broker_factory, tagged_service):
    a, b = tagged_service(b"A"), tagged_service(b"B")
    broker, control = broker_factory(Endpoint("127.0.0.1", a))
    ok = channel(control)
    ok.sendall(f"CONNECT 127.0.0.1:{a} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    rest = []
    assert read_head(ok, rest).startswith(b"HTTP/1.1 200")
    assert (rest[0] or ok.recv(1)) == b"A"
    ok.sendall(b"ping")
    assert ok.recv(4) == b"ping"
    no = channel(control)
    no.sendall(f"CONNECT 127.0.0.1:{b} HTTP/1.1\r\n\r\n".encode())
    head = read_head(no)
    assert head.startswith(b"HTTP/1.1 403")
    assert f"X-Sequester-Reason: 127.0.0.1:{b} is not in".encode() in head
    assert broker.stats.denied == [f"127.0.0.1:{b}"]


def test_direct_channel(broker_factory, tagged_service):
    a, b = tagged_service(b"A"), tagged_service(b"B")
    _, control = broker_factory(Endpoint("127.0.0.1", a))
    ok = channel(control)
    ok.sendall(f"DIRECT 127.0.0.1 {a}\r\n".encode())
    assert ok.recv(1) == b"A"
    no = channel(control)
    no.sendall(f"DIRECT 127.0.0.1 {b}\r\n".encode())
    assert no.recv(1) == b""  # refused: closed without a byte of the service


def test_absolute_form_http(broker_factory):
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = f"path={self.path} proxy-auth={self.headers.get('Proxy-Authorization')}".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        _, control = broker_factory(Endpoint("127.0.0.1", port))
        ch = channel(control)
        ch.sendall(f"GET http://127.0.0.1:{port}/a?b=1 HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                   "Proxy-Authorization: secret\r\n\r\n".encode())
        data = b""
        while chunk := ch.recv(4096):
            data += chunk
        assert data.startswith(b"HTTP/1.0 200") and data.endswith(b"path=/a?b=1 proxy-auth=None")
    finally:
        server.shutdown()
        server.server_close()


def test_a_refused_name_is_never_resolved(broker_factory, monkeypatch):
    """The allowlist is checked before any name lookup (no DNS leak of the name)."""
    looked_up = []
    real = socket.getaddrinfo

    def spy(host, *args, **kwargs):
        looked_up.append(host)
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", spy)
    _, control = broker_factory(Endpoint("allowed.invalid", 443))
    ch = channel(control)
    ch.sendall(b"CONNECT secret-name.invalid:443 HTTP/1.1\r\n\r\n")
    assert read_head(ch).startswith(b"HTTP/1.1 403")
    ch2 = channel(control)
    ch2.sendall(b"CONNECT allowed.invalid:443 HTTP/1.1\r\n\r\n")
    assert read_head(ch2).startswith(b"HTTP/1.1 502")  # allowed, looked up, does not exist
    assert "secret-name.invalid" not in looked_up
    assert "allowed.invalid" in looked_up


def test_malformed_requests(broker_factory):
    _, control = broker_factory()
    ch = channel(control)
    ch.sendall(b"NONSENSE\r\n\r\n")
    assert read_head(ch).startswith(b"HTTP/1.1 400")
    ch = channel(control)
    ch.sendall(b"GET ftp://x/ HTTP/1.1\r\n\r\n")
    assert read_head(ch).startswith(b"HTTP/1.1 400")


def test_close_ends_open_channels(broker_factory, tagged_service):
    a = tagged_service(b"A")
    broker, control = broker_factory(Endpoint("127.0.0.1", a))
    ch = channel(control)
    ch.sendall(f"DIRECT 127.0.0.1 {a}\r\n".encode())
    assert ch.recv(1) == b"A"
    broker.close()
    assert ch.recv(10) == b""


# -- what a hostile sandbox cannot do to the host -------------------------------------------


@pytest.mark.slow
def test_the_request_head_has_one_deadline_not_one_per_line(broker_factory):
    import time

    _, control = broker_factory(head_timeout=1.5)
    ch = channel(control)
    ch.sendall(b"CONNECT 127.0.0.1:1 HTTP/1.1\r\n")
    started = time.monotonic()
    answer = b""
    try:
        for _ in range(20):  # slowloris: one header byte every 0.4 s, each well inside 1.5 s
            ch.sendall(b"X")
            time.sleep(0.4)
            ch.setblocking(False)
            try:
                answer += ch.recv(4096)
            except BlockingIOError:
                pass
            finally:
                ch.setblocking(True)
            if answer:
                break
    except (BrokenPipeError, ConnectionResetError):
        pass
    ch.settimeout(5)
    try:
        answer += ch.recv(4096)
    except OSError:
        pass
    assert answer.startswith(b"HTTP/1.1 408") and b"within 1.5 s" in answer
    assert time.monotonic() - started < 3


def test_control_a_complete_head_inside_the_deadline_is_served(broker_factory, tagged_service):
    import time

    a = tagged_service(b"A")
    _, control = broker_factory(Endpoint("127.0.0.1", a), head_timeout=1.5)
    ch = channel(control)
    for byte in f"CONNECT 127.0.0.1:{a} HTTP/1.1\r\n\r\n".encode():
        ch.sendall(bytes([byte]))
        time.sleep(0.02)
    assert read_head(ch).startswith(b"HTTP/1.1 200")


@pytest.mark.slow
def test_refused_targets_are_remembered_in_bounded_space(broker_factory):
    import tracemalloc

    from sequester.net.stats import RECENT

    broker, control = broker_factory()
    long_name = ("n" * 60 + ".") * 1000  # 61 KB of valid labels
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        for i in range(2000):
            ch = channel(control)
            ch.sendall(f"CONNECT {long_name}{i}.test:443 HTTP/1.1\r\n\r\n".encode())
            assert read_head(ch).startswith(b"HTTP/1.1 403")
            ch.close()
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert broker.stats.n_denied == 2000
    assert len(broker.stats.denied) == RECENT and all(len(t) < 300 for t in broker.stats.denied)
    assert grown < 2 * 1024 * 1024, grown  # 2000 x 60 KB would be 120 MB


def test_channels_over_the_limit_get_no_fd_and_freed_slots_are_reused(broker_factory, tagged_service):
    a = tagged_service(b"A")
    broker, control = broker_factory(Endpoint("127.0.0.1", a), max_channels=3)
    held = [channel(control) for _ in range(3)]
    control.sendall(b"+")
    msg, fds, _, _ = socket.recv_fds(control, 1, 1)
    assert (msg, fds) == (b"-", [])
    assert broker.stats.n_over_limit == 1
    held[0].close()
    import time

    deadline = time.monotonic() + 5
    while len(broker._tasks) >= 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    ok = channel(control)
    ok.sendall(f"DIRECT 127.0.0.1 {a}\r\n".encode())
    assert ok.recv(1) == b"A"


@pytest.mark.parametrize("request_line,status,reason", [
    (b"CONNECT 127.0.0.1:99999 HTTP/1.1", 400, b"the port is not in 1..65535"),
    (b"GET http://127.0.0.1:99999/ HTTP/1.1", 400, b"is not a valid URL"),
    (b"CONNECT 127.0.0.1:0 HTTP/1.1", 400, b"the port is not in 1..65535"),
    (b"GET http://[::1/ HTTP/1.1", 400, b"is not a valid URL"),
    (b"GET http://a..b/ HTTP/1.1", 400, b"not a valid domain name"),
    ("CONNECT xn--b\u00fccher-.de:443 HTTP/1.1".encode("latin-1"), 400, b"not a valid domain name"),
    (b"CONNECT :443 HTTP/1.1", 400, b"names no host"),
    (b"CONNECT other.test:443 HTTP/1.1", 403, b"other.test:443 is not in the sandbox policy's allowlist"),
])
def test_bad_targets_get_a_reason_and_no_traceback(broker_factory, capfd, caplog, request_line, status, reason):
    _, control = broker_factory(Endpoint("allowed.test", 443))
    ch = channel(control)
    ch.sendall(request_line + b"\r\n\r\n")
    data = b""
    while chunk := ch.recv(4096):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status}".encode()), data
    assert reason in head and reason in body  # the header, and the body too
    assert "Traceback" not in capfd.readouterr().err and "Traceback" not in caplog.text
