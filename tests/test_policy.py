"""The policy (:mod:`sequester.policy`): endpoints, isolation forms, overrides and their
checks, and a policy as plain hashable data."""

from pathlib import Path

import pytest

from sequester import Endpoint, Isolation, Policy, PolicyError, parse_endpoint
from sequester.config import policy_from_mapping


@pytest.mark.parametrize(
    "text, host, port",
    [
        ("127.0.0.1:8000", "127.0.0.1", 8000),
        ("API.Example.com:443", "api.example.com", 443),
        ("[::1]:9000", "::1", 9000),
        ("https://api.example.com/v1/chat", "api.example.com", 443),
        ("http://localhost:8080/x", "localhost", 8080),
        ("ws://svc.internal", "svc.internal", 80),
    ],
)
def test_parse_endpoint(text, host, port):
    assert parse_endpoint(text) == Endpoint(host, port)


@pytest.mark.parametrize("bad", ["example.com", "host:", ":80", "host:99999", "ftp://x", "::1:80", "bad host:80", ""])
def test_parse_endpoint_rejects_and_names_the_value(bad):
    with pytest.raises(PolicyError) as err:
        parse_endpoint(bad)
    assert repr(bad) in str(err.value) or "is not" in str(err.value)


def test_isolation_forms(tmp_path):
    assert Policy(isolation=True).isolation is Isolation.SANDBOX
    assert Policy(isolation=False).isolation is Isolation.OFF
    assert Policy(isolation="auto").isolation is Isolation.AUTO
    p = Policy(isolation={"hide": [str(tmp_path)]})
    assert p.isolation is Isolation.SANDBOX and p.hide == (tmp_path.resolve(),)
    p = Policy(isolation={"mode": "auto", "hide": [str(tmp_path)]})
    assert p.isolation is Isolation.AUTO
    with pytest.raises(PolicyError, match="isolation"):
        Policy(isolation="sometimes")
    with pytest.raises(PolicyError, match="mode is false"):
        Policy(isolation={"mode": False, "hide": [str(tmp_path)]})


def test_overrides_add_and_validate(tmp_path):
    policy = Policy().with_overrides(allow=["127.0.0.1:1"], readonly=[str(tmp_path)], isolation="auto")
    assert policy.allow == (Endpoint("127.0.0.1", 1),)
    assert policy.readonly == (tmp_path.resolve(),)
    assert policy.isolation is Isolation.AUTO
    with pytest.raises(PolicyError, match="--readonly"):
        Policy().with_overrides(readonly=["/no/such"])


def test_same_path_hidden_and_readonly_is_an_error(tmp_path):
    with pytest.raises(PolicyError, match="both hidden and read-only"):
        Policy(hide=(tmp_path,), readonly=(tmp_path,))


def test_policy_is_plain_hashable_data():
    assert hash(Policy()) == hash(Policy())
    assert policy_from_mapping({}, Path("/")) == Policy()


