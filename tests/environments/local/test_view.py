"""An episode's view (:mod:`sequester.environments.local.view`): what an agent finds in the
folders the README calls fresh is nothing but the way to the Python installation running sequester, mounted back read-only at its own path
(and, in /var/tmp, the empty mount point hiding the episodes' state folder when it is there)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from paths import EXAMPLES

from sequester.environments.local.episode import Episode
from sequester.environments.settings import EpisodeSettings
from sequester.sandbox.host import gather_host_facts
from sequester.sandbox.mounts import SYSTEM_DIRS

TASK = EXAMPLES / "python-csv-stats"
SCRATCH = (Path("/tmp"), Path("/var/tmp"), Path("/run"))

pytestmark = pytest.mark.skipif(not Path("/proc/self/ns/user").exists(), reason="needs namespaces")

LIST = r'''
import json, os, sys
out = {}
for top in sys.argv[1:]:
    for root, dirs, files in os.walk(top):
        if root in PYTHON_ROOTS:
            dirs[:] = []  # the installation itself: not listed
            continue
        out[root] = sorted(dirs + files)
print(json.dumps(out))
'''


def expected_listing(tops: list[Path], python_roots: tuple[Path, ...], state_dir: Path) -> dict[str, list[str]]:
    """Each folder on the way to a Python root lists the next step only; the rest is empty."""
    out: dict[str, set[str]] = {str(t): set() for t in tops}
    for path in (*python_roots, *([state_dir] if state_dir.is_relative_to("/var/tmp") else [])):
        for top in tops:
            if path.is_relative_to(top) and path != top:
                parts = path.relative_to(top).parts
                for i, part in enumerate(parts):
                    out.setdefault(str(top.joinpath(*parts[:i])), set()).add(part)
                if path == state_dir:
                    out.setdefault(str(path), set())  # an empty read-only mount point
    return {k: sorted(v) for k, v in out.items()}


@pytest.mark.slow
def test_fresh_folders_hold_only_the_python_installation(tmp_path):
    facts = gather_host_facts()
    fresh_tops = [e.path for e in facts.entries if e.path.parent == Path("/") and e.is_dir and not e.is_symlink
                  and e.path.name not in SYSTEM_DIRS | {"dev", "proc", "sys", "tmp", "run", "app", "tests", "logs"}]
    tops = sorted({*fresh_tops, *SCRATCH})  # /root, /home, /srv, ... whoever the caller
    settings = EpisodeSettings()
    with Episode(settings) as ep:
        ep.reset(TASK)
        script = f"PYTHON_ROOTS = {[str(r) for r in facts.python_roots]!r}\n{LIST}"
        ep.write_file("/app/list.py", script.encode())
        r = ep.exec("python3 /app/list.py " + " ".join(str(t) for t in tops))
        assert r.exit_code == 0, r.stderr
        seen = json.loads(r.stdout)
        # The installation is read-only; the fresh folders are writable.
        probe = ep.exec(f"touch {facts.python_roots[0]}/planted; echo rc=$?; touch /tmp/x /var/tmp/x && echo ok")
    expected = expected_listing(tops, facts.python_roots, settings.state_dir.resolve())
    for top in tops:
        assert {k: v for k, v in seen.items() if Path(k).is_relative_to(top)} == \
            {k: v for k, v in expected.items() if Path(k).is_relative_to(top)}, top
    assert "rc=1" in probe.stdout and probe.stdout.strip().endswith("ok"), probe.stdout + probe.stderr
    assert not (facts.python_roots[0] / "planted").exists()


def test_read_file_returns_bytes():
    with Episode() as ep:
        ep.reset(TASK)
        ep.write_file("/app/x.bin", b"\x00\xff")
        assert ep.read_file("/app/x.bin") == b"\x00\xff"
