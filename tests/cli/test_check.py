"""``sequester check`` (:mod:`sequester.cli.check`), run as a real process: its findings, as a table and as JSON, and its
exit status when isolation fails."""

import json
import os
import shutil

from command import sequester


def test_check_passes_here_and_reports_json():
    r = sequester("check", "--json", "--isolation", "true")
    report = json.loads(r.stdout)
    assert r.returncode == 0, r.stdout
    names = {f["name"] for f in report["findings"]}
    assert {"user namespaces available", "files hidden", "source read-only", "workspace writable",
            "network allowlist", "processes blocked", "processes invisible", "capabilities zero",
            "own memory unwritable", "kernels apart"} <= names
    assert report["mode"] == "sandbox" and report["passed"]
    # Which first stage confined the probe kernel: the native one wherever a C compiler is.
    compiler = shutil.which("cc") or shutil.which("gcc")
    native = compiler and os.environ.get("SEQUESTER_NATIVE_STAGE") != "0"
    assert report["first_stage"] == ("native" if native else "python")
    # ... and, through it, the view its policy's template keeps.
    assert report["view"] == ("template" if native and os.environ.get("SEQUESTER_VIEW_TEMPLATE") != "0" else "bwrap")


def test_check_table():
    r = sequester("check")
    assert r.returncode == 0 and "processes blocked" in r.stdout and "FAIL" not in r.stdout


def test_check_fails_loudly_without_isolation():
    r = sequester("check", "--json", "--isolation", "false")
    report = json.loads(r.stdout)
    assert r.returncode == 1 and not report["passed"]
    failed = {f["name"] for f in report["findings"] if not f["passed"]}
    assert {"processes blocked", "processes invisible", "files hidden"} <= failed
