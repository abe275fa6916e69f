"""Shared fixtures: real processes, real sockets, no mocks of sequester's own parts."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from sequester import check

HELPERS = Path(__file__).parent / "helpers"
sys.path.insert(0, str(HELPERS))


@pytest.fixture
def tagged_service() -> Iterator:
    """Factory: a loopback TCP service that greets each client with a tag, then echoes."""
    with ExitStack() as stack:
        yield lambda tag, host="127.0.0.1": stack.enter_context(check.tagged_service(tag, host, echo=True))


# A folder sandboxes show (part of the OS for root's rule, not scratch space like /tmp or
# /var/tmp): where tests put host files a sandbox could see unless told otherwise.
VISIBLE_DIR = "/opt"

requires_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")
