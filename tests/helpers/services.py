"""Host services for network tests, and this host's own address."""

import ipaddress
import socket
import socketserver
import threading
from contextlib import contextmanager

import pytest


@contextmanager
def greeter(tag: bytes, port: int = 0):
    """A host service that greets every client at once with ``tag`` and then holds the
    connection open until the client closes (one thread per client)."""

    class Handler(socketserver.BaseRequestHandler):
        def handle(self):
            self.request.sendall(tag)
            try:
                while self.request.recv(4096):
                    pass
            except OSError:
                pass

    class Server(socketserver.ThreadingTCPServer):
        allow_reuse_address = True
        daemon_threads = True

    server = Server(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def free_low_port() -> int:
    """A port below 1024 nothing listens on (binding it needs root: the tests that use it do)."""
    for port in range(700, 1000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    pytest.skip("no free port below 1024")


def own_address() -> str | None:
    """A non-loopback address of this host (the one it would reach the internet from)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("203.0.113.80", 80))
        except OSError:
            return None
        ip = s.getsockname()[0]
    return None if ipaddress.ip_address(ip).is_loopback else ip
