"""Helpers for tests that ask a kernel what it sees."""

import json

from sequester import Kernel


def probe(kernel: Kernel, code: str):
    """Run ``code`` (which must print one JSON value last) and return that value."""
    result = kernel.run(code, timeout=30)
    assert result.error is None, f"probe failed: {result.error}\n{result.error.traceback if result.error else ''}"
    return json.loads(result.stdout.strip().splitlines()[-1])
