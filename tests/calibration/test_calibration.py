"""Calibration records (:mod:`sequester.calibration`): the key, the store, the verdict. Pure
or on files of the test's own."""

from __future__ import annotations

import json

import pytest

from sequester.calibration import CalibrationRecord, CalibrationStore, calibration_key, judge_record, state_for

BASE = {"task_checksum": "a" * 64, "system": {"mode": "image", "digest": "sha256:1"}, "version": "0.1.0",
        "settings": {"verifier_env": None, "freeze_agent": False, "reward_range": [0.0, 1.0], "output_bytes": 10,
                     "network": "task", "allowed_hosts": [], "max_processes": 4096, "backend": "local"}}


def _key(**change):
    args = {**BASE, **change}
    return calibration_key(task_checksum=args["task_checksum"], system=args["system"], settings=args["settings"],
                           version=args["version"]).digest


@pytest.mark.parametrize("change", [
    {"task_checksum": "b" * 64},
    {"system": {"mode": "image", "digest": "sha256:2"}},
    {"system": {"mode": "host"}},
    {"system": None},
    {"version": "0.2.0"},
    {"settings": {**BASE["settings"], "network": "none"}},
    {"settings": {**BASE["settings"], "allowed_hosts": ["api.example:443"]}},
    {"settings": {**BASE["settings"], "freeze_agent": True}},
    {"settings": {**BASE["settings"], "verifier_env": "separate"}},
    {"settings": {**BASE["settings"], "max_processes": 64}},
    {"settings": {**BASE["settings"], "backend": "docker"}},
])
def test_every_field_that_changes_the_outcome_changes_the_key(change):
    assert _key(**change) != _key()


def test_what_does_not_change_the_outcome_does_not_change_the_key():
    assert _key(settings={**BASE["settings"], "state_dir": "/elsewhere", "exec_timeout": 5}) == _key()


def _record(oracle, nop, **kw) -> CalibrationRecord:
    return CalibrationRecord(key="ab" * 32, task="t", fields={}, runs={"oracle": oracle, "nop": nop}, repeats=len(oracle),
                             calibrated_at="now", **kw)


@pytest.mark.parametrize("oracle, nop, why", [
    ([1.0, 1.0], [0.0, 0.0], None),
    ([1.0, 0.0], [0.0, 0.0], "oracle scored 1, 0"),
    ([1.0], [0.5], "nop scored 0.5"),
    (["VerifierCouldNotRun: no uv"], [0.0], "oracle ended with an error 1 of 1 times"),
    ([], [0.0], "oracle was not run"),
])
def test_a_record_calibrates_only_full_marks_and_zeros_every_time(oracle, nop, why):
    found = judge_record(_record(oracle, nop))
    assert (found is None) if why is None else (why in (found or "")), found


def test_a_task_without_a_solution_is_uncalibrated_unless_calibration_is_required():
    record = _record(["SequesterError: no solve.sh"], [0.0], no_solution=True)
    assert state_for(record, record.key, mode="auto").state == "uncalibrated"
    assert state_for(record, record.key, mode="required").state == "not-calibrated"
    assert state_for(None, "k", mode="auto").state == "uncalibrated" and state_for(None, "k", mode="off").state == "off"


def test_the_store_keeps_records_whole_and_ignores_what_is_not_one(tmp_path):
    store = CalibrationStore(tmp_path / "calibration")
    record = _record([1.0], [0.0])
    path = store.put(record)
    assert store.get(record.key) == record and not list(path.parent.glob(".record-*"))
    path.write_text(json.dumps({**record.to_dict(), "key": "cd" * 32}))  # a record under the wrong name
    assert store.get(record.key) is None
    path.write_text("{not json")
    assert store.get(record.key) is None
    assert store.get("../../etc/passwd") is None  # a key is a hex digest: never a path
    with pytest.raises(ValueError):
        store.put(_record([1.0], [0.0], jobs=[]).__class__(**{**_record([1.0], [0.0]).__dict__, "key": "../x"}))
