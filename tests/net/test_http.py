"""The HTTP parsing of the broker (:mod:`sequester.net.http`, pure): request lines parsed or
refused, and refusals that carry their reason without splitting the header."""

import pytest

from sequester.net.http import Refused, parse_direct, parse_request_line, refusal


def test_request_lines_parse_or_refuse():
    assert parse_request_line(b"CONNECT api.test:443 HTTP/1.1").host == "api.test"
    r = parse_request_line(b"GET http://svc:8080/a?b=1 HTTP/1.1")
    assert (r.host, r.port, r.tunnel, r.line) == ("svc", 8080, False, b"GET /a?b=1 HTTP/1.1\r\n")
    for bad in (b"CONNECT x:99999 HTTP/1.1", b"GET http://x:99999/ HTTP/1.1", b"NONSENSE", b"GET ftp://x/ HTTP/1.1"):
        with pytest.raises(Refused) as info:
            parse_request_line(bad)
        assert info.value.status == 400
    assert parse_direct(b"DIRECT h 443\r\n") == ("h", 443) and parse_direct(b"DIRECT h 99999\r\n") is None


def test_a_refusal_carries_its_reason_in_header_and_body_and_cannot_split_the_header():
    data = refusal(403, "x:1 is not allowed\r\nSet-Cookie: a")
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"\r\nSet-Cookie" not in head and b"X-Sequester-Reason: x:1 is not allowed??Set-Cookie: a" in head
    assert body.startswith(b"x:1 is not allowed")
