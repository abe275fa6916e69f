"""Shared fixtures: real processes, real sockets, no mocks of sequester's own parts."""

from __future__ import annotations

import os
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

HELPERS = Path(__file__).parent / "helpers"
sys.path.insert(0, str(HELPERS))


@pytest.fixture
def tagged_service() -> Iterator:
    """Factory: a loopback TCP service that greets each client with a tag, then echoes."""
    servers = []

    def start(tag: bytes, host: str = "127.0.0.1") -> int:
        server = socket.create_server((host, 0))
        server.settimeout(0.2)
        stop = threading.Event()

        def serve() -> None:
            while not stop.is_set():
                try:
                    client, _ = server.accept()
                except OSError:
                    continue
                with client:
                    client.sendall(tag)
                    client.settimeout(2)
                    try:
                        while data := client.recv(4096):
                            client.sendall(data)
                    except OSError:
                        pass

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        servers.append((server, stop, thread))
        return server.getsockname()[1]

    yield start
    for server, stop, thread in servers:
        stop.set()
        thread.join()
        server.close()


requires_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")
