"""The task is solved on its own image: Python 3.13 (the host's Python may be another)."""

import subprocess
from pathlib import Path

PRIMES = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29]


def test_version_is_the_images():
    assert Path("/app/version.txt").read_text().strip() == "3.13"


def test_primes_file():
    assert [int(x) for x in Path("/app/primes.txt").read_text().split()] == PRIMES


def test_program_prints_primes():
    out = subprocess.run(["python3", "/app/primes.py"], capture_output=True, text=True, timeout=30)
    assert [int(x) for x in out.stdout.split()] == PRIMES
