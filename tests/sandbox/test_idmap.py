"""The ids an episode maps (:mod:`sequester.sandbox.idmap`): the plans are pure; the
setuid helpers and ``sequester setup ids`` are run for real in tests/environments/local/test_users.py."""

from __future__ import annotations

import os

import pytest

from sequester.errors import PolicyError
from sequester.sandbox.idmap import (
    IDS,
    IdMap,
    caller_id_map,
    covered,
    free_range,
    parse_id_range,
    parse_proc_map,
    parse_subid_file,
    root_range_argv,
)


def test_the_map_puts_the_caller_at_zero_and_the_range_after_it():
    ids = IdMap(uid=1002, gid=1003, sub_uid=165536, sub_gid=200000)
    assert ids.uid_map() == "0 1002 1\n1 165536 65535\n"
    assert ids.gid_map() == "0 1003 1\n1 200000 65535\n"
    assert (ids.host_uid(0), ids.host_uid(1), ids.host_uid(65535)) == (1002, 165536, 165536 + 65534)
    assert (ids.host_gid(0), ids.host_gid(42)) == (1003, 200041)
    # and back; what the map does not hold shows as nobody inside (None)
    assert [ids.inside_uid(h) for h in (1002, 165536, 165536 + 65534, 165536 + 65535, 0, 165535)] == [
        0, 1, 65535, None, None, None]
    assert ids.inside_gid(200041) == 42 and ids.inside_gid(1002) is None


def test_subordinate_files_are_read_as_the_setuid_helpers_read_them():
    text = "alice:100000:65536\n# comment\nbob:x:1\n1002:300000:70000\nbob:400000:0\nbob:500000:65536\n"
    assert parse_subid_file(text, "alice", 1001) == [(100000, 65536)]
    assert parse_subid_file(text, "sequser", 1002) == [(300000, 70000)]  # by uid
    assert parse_subid_file(text, "bob", 1003) == [(500000, 65536)]  # malformed and empty ranges skipped
    assert parse_subid_file(text, "carol", 1004) == []


@pytest.mark.parametrize("text, expected", [("100000:65536", (100000, 65536)), ("300000", (300000, IDS)),
                                            ("4000000:100000", (4000000, 100000))])
def test_a_configured_range_is_base_and_count(text, expected):
    assert parse_id_range(text) == expected


@pytest.mark.parametrize("text, words", [("abc", "BASE:COUNT"), ("100000:100", "has 100 ids"),
                                         ("0:65536", "unused ids"), ("1000:65536", "unused ids"),
                                         (f"{2**32 - 100}:65536", "unused ids"), ("100000:x", "BASE:COUNT")])
def test_a_bad_configured_range_is_refused_naming_the_setting(text, words):
    with pytest.raises(PolicyError, match="episodes.id_range") as raised:
        parse_id_range(text)
    assert words in str(raised.value)


def test_coverage_of_a_range_is_read_from_a_namespaces_map():
    full = parse_proc_map("         0          0 4294967295\n")
    assert covered(full, 262144, 65535)
    one = parse_proc_map("0 0 1\n")
    assert covered(one, 0, 1) and not covered(one, 262144, 65535)
    split = parse_proc_map("0 1000 1\n1 100000 100\n101 200000 65435\n")
    assert covered(split, 1, 65535) and not covered(split, 1, 65536)
    assert parse_proc_map("garbage\n0 0\n1 2 3\n") == [(1, 2, 3)]


def test_roots_range_goes_after_every_range_handed_out():
    assert free_range("", "") == 131072  # the first multiple of 65,536 at or above 100,000
    subuid = "alice:100000:65536\nbob:165536:65536\n"
    assert free_range(subuid, "") == 262144
    assert free_range(subuid, "carol:300000:1000\n") == 327680  # both files count
    assert free_range("x:131072:10\n", "") == 196608
    assert root_range_argv(262144) == ["usermod", "--add-subuids", "262144-327679", "--add-subgids",
                                       "262144-327679", "root"]


def test_a_configured_range_is_roots_alone():
    if os.getuid() == 0:
        pytest.skip("an ordinary caller's refusal")
    ids, why = caller_id_map((300000, IDS))
    assert ids is None and "root" in (why or "")


def test_a_configured_range_that_gives_away_someone_elses_ids_is_refused():
    """Red team: ``id_range = "1001:65536"`` made inside uid 2 a real host user; a range
    over another user's subordinate ids would hand an agent that user's containers' files."""
    import pwd

    from sequester.sandbox.idmap import check_unused, used_ids

    someone = next(p for p in pwd.getpwall() if p.pw_uid > 1000 and p.pw_uid < 2**31) if any(
        p.pw_uid > 1000 and p.pw_uid < 2**31 for p in pwd.getpwall()) else None
    if someone is not None:
        with pytest.raises(PolicyError, match=f"episodes.id_range.*user {someone.pw_name}"):
            check_unused(someone.pw_uid - 5, IDS)
    used = used_ids("alice:300000:65536\nroot:500000:65536\n", "")
    assert (300000, 365536, "alice's range in /etc/subuid") in used
    assert not any(who.startswith("root's") for _, _, who in used)  # root's own range is root's to use
