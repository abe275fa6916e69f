"""Verifier for pinned-pytest: run by pytest 8.4.1 through uvx (see test.sh)."""
import os
import random
import sys

import pytest

sys.path.insert(0, "/app")
sys.dont_write_bytecode = True

from solution import format_duration, parse_duration  # noqa: E402


def test_solution_location():
    import solution

    assert os.path.realpath(solution.__file__) == "/app/solution.py"


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("45s", 45),
        ("1h30m", 5400),
        ("2d3s", 172803),
        ("0s", 0),
        ("90m", 5400),
        ("1d", 86400),
        ("1d2h3m4s", 93784),
        ("007m", 420),
        ("0d0h0m0s", 0),
        ("100000d", 8640000000),
        ("12h59s", 43259),
    ],
)
def test_parse_valid(text, seconds):
    result = parse_duration(text)
    assert type(result) is int
    assert result == seconds


@pytest.mark.parametrize(
    "text",
    ["", "5", "h", "1x", "1H", "1h 30m", " 1h", "1h ", "30m1h", "1h1h", "1s1m", "-1h", "+1h",
     "1.5h", "1_0s", "\u0661h", "1d\n", "1hh", "d1", "1dh", "0x10s"],
)
def test_parse_invalid(text):
    with pytest.raises(ValueError):
        parse_duration(text)


@pytest.mark.parametrize("value", [None, 5, b"1h", ["1h"]])
def test_parse_type_error(value):
    with pytest.raises(TypeError):
        parse_duration(value)


@pytest.mark.parametrize(
    "seconds, text",
    [
        (0, "0s"),
        (1, "1s"),
        (59, "59s"),
        (60, "1m"),
        (61, "1m1s"),
        (3600, "1h"),
        (5400, "1h30m"),
        (86399, "23h59m59s"),
        (86400, "1d"),
        (90061, "1d1h1m1s"),
        (172803, "2d3s"),
        (8640000000, "100000d"),
    ],
)
def test_format(seconds, text):
    assert format_duration(seconds) == text


def test_format_errors():
    with pytest.raises(ValueError):
        format_duration(-1)
    for bad in (True, False, 1.0, "60", None):
        with pytest.raises(TypeError):
            format_duration(bad)


def test_round_trip():
    rng = random.Random(1234)
    values = list(range(0, 4000)) + [rng.randrange(0, 10**9) for _ in range(2000)]
    for n in values:
        assert parse_duration(format_duration(n)) == n
