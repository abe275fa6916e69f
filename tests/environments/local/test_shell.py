"""The agent's shell (:mod:`sequester.environments.local.shell`): ``[episodes] output_bytes``
is an exact cap on each stream of an agent's command: whole output when it fits, else head + marker + tail, ``output_bytes`` in all."""

from __future__ import annotations

from pathlib import Path

import pytest
from paths import EXAMPLES

from sequester.environments.local.episode import Episode
from sequester.environments.settings import EpisodeSettings
from sequester.environments.local.shell import DROPPED, _Capture

TASK = EXAMPLES / "python-csv-stats"
MARK = b"\x1eSEQ0123456789abcdef "


def seq(n: int) -> bytes:
    """What ``seq 1 n`` prints."""
    return b"".join(b"%d\n" % i for i in range(1, n + 1))


def capped(data: bytes, limit: int) -> bytes:
    """The specification: the whole output, or head + DROPPED + tail, ``limit`` bytes in all."""
    if len(data) <= limit:
        return data
    room = limit - len(DROPPED)
    if room < 2:
        return data[:limit]
    head = (room + 1) // 2
    return data[:head] + DROPPED + data[len(data) - (room - head):]


def feed(limit: int, data: bytes, chunk: int) -> tuple[bytes, int]:
    capture = _Capture(limit)
    stream = data + MARK + b"0\x1e"  # what the shell writes after the command's output
    for i in range(0, len(stream), chunk):
        capture.add(stream[i:i + chunk])
    assert capture.after(MARK) == b"0\x1e"
    return capture.content(MARK)


@pytest.mark.parametrize("limit", [1, 10, len(DROPPED) + 1, len(DROPPED) + 2, 100, 101, 3892, 3893, 4096, 1 << 20])
@pytest.mark.parametrize("n", [0, 1000, 100_000])
def test_capture_keeps_exactly_the_cap(limit, n):
    data = seq(n)
    for chunk in (1 << 16, 4093):
        kept, size = feed(limit, data, chunk)
        assert size == len(data)
        assert kept == capped(data, limit)
        assert len(kept) == min(len(data), limit)


def test_the_numbers_of_the_issue():
    """output_bytes = 100: 3,893 bytes were kept whole with a marker, 588,895 kept 4,199."""
    for data in (seq(1000), seq(100_000)):
        kept, size = feed(100, data, 1 << 16)
        assert (len(data), len(kept)) in ((3893, 100), (588_895, 100))
        assert kept.startswith(data[:37]) and kept.endswith(data[-37:]) and DROPPED in kept


def test_memory_stays_near_the_cap():
    capture = _Capture(1000)
    for _ in range(2000):
        capture.add(b"x" * 65536)
    assert len(capture.window) + len(capture.head) <= 2 * (1000 + _Capture._SLACK)


needs_namespaces = pytest.mark.skipif(not Path("/proc/self/ns/user").exists(), reason="needs namespaces")


@needs_namespaces
@pytest.mark.parametrize("limit", [100, 3892, 3893])
def test_exec_output_is_capped_exactly_per_stream(tmp_path, limit):
    settings = EpisodeSettings(output_bytes=limit)
    with Episode(settings) as ep:
        ep.reset(TASK)
        r = ep.exec("seq 1 1000; seq 1 100000 >&2")
    out, err = seq(1000), seq(100_000)
    assert r.exit_code == 0 and not r.timed_out
    assert r.stdout.encode() == capped(out, limit) and len(r.stdout) == min(len(out), limit)
    assert r.stderr.encode() == capped(err, limit) and len(r.stderr) == limit
    assert "stderr was 588895 bytes" in r.note and (("stdout was 3893 bytes" in r.note) == (limit < len(out)))


@needs_namespaces
def test_output_within_the_cap_has_no_note():
    with Episode(EpisodeSettings(output_bytes=10_000)) as ep:
        ep.reset(TASK)
        r = ep.exec("seq 1 1000")
    assert (r.stdout.encode(), r.stderr, r.note) == (seq(1000), "", "")



@pytest.mark.parametrize("limit", [1, 10, 27, 28, 100, 1000])
@pytest.mark.parametrize("total", [0, 99, 100, 101, 5000])
@pytest.mark.parametrize("step", [1, 7, 10000])
def test_the_verifiers_output_buffer_is_an_exact_cap(limit, total, step):
    """What the verifier printed (verifier/test-stdout.txt) is kept whole while it fits,
    else head + marker + tail in exactly ``output_bytes``, however it arrives."""
    from sequester.sandbox.nsexec.client import HeadTail

    data = (bytes(range(256)) * 40)[:total]
    kept = HeadTail(limit)
    for i in range(0, total, step):
        kept += data[i:i + step]
    out = kept.bytes()
    assert len(out) <= limit
    if total <= limit:
        assert out == data
    else:
        assert out.startswith(data[:kept._head_size]) and len(out) == limit
        assert not kept._tail_size or out.endswith(data[total - kept._tail_size:])
