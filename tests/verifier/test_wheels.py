"""The wheels a task's test script pins beyond the runner's own (:mod:`sequester.verifier.wheels`):
reading TB2 scripts, fetching binary wheels once per pin set, and an episode whose tests
import a pinned package, offline, through the real verifier.

The fetching tests need the package index (the host's pip configuration): they skip when
it cannot be reached."""

from __future__ import annotations

import time

import pytest

from sequester.verifier.wheels import (TASK_WHEELS_DIR, VerifierPins, VerifierWheelsError, ensure_task_wheels,
                                    fetch_verifier_wheels, host_platform_tags, verifier_pins)
from sequester.environments.local.episode import Episode
from sequester.environments.settings import default_toolchain_dir
from sequester.tasks import load_task
from sequester.verifier import PINNED, layout
from paths import IMAGE_TASKS
from tasks import make_task

# TB2's canonical test.sh (examples/image-tasks/python313-primes), with one more pin.
CANONICAL = IMAGE_TASKS / "python313-primes" / "tests" / "test.sh"
EXTRA_PIN = "markupsafe==3.0.2"  # a binary wheel (cp313 manylinux), 23 kB


def _runner_has_313() -> bool:
    from sequester.verifier.tree import runner_tree
    tree = runner_tree(default_toolchain_dir())
    return tree is not None and any(p.name.startswith("cpython-3.13.") for p in (tree / "python").iterdir())


# TB2's script asks for Python 3.13: the runner has it where the host has one it can copy
# (root's pyenv here; an ordinary user with Debian's python3 has only 3.11).
needs_313 = pytest.mark.skipif("not _runner_has_313()", reason="the verifier's runner has no Python 3.13 "
                                                                "on this machine for this user")


def _tb2_script(extra: str = f"-w {EXTRA_PIN}") -> str:
    text = CANONICAL.read_text()
    assert "  -w pytest-json-ctrf==0.3.5 \\\n" in text
    return text.replace("  -w pytest-json-ctrf==0.3.5 \\\n", f"  -w pytest-json-ctrf==0.3.5 \\\n  {extra} \\\n")


# -- verifier_pins: pure ---------------------------------------------------------------------


def test_the_canonical_script_pins_only_what_the_runner_has():
    pins = verifier_pins(CANONICAL.read_text())
    assert pins == VerifierPins(requirements=("pytest-json-ctrf==0.3.5", "pytest==8.4.1"), pythons=("3.13",))
    assert pins.python == "3.13" and pins.extra == () and set(pins.requirements) == set(PINNED)


@pytest.mark.parametrize("extra, pinned", [
    ("-w numpy==2.3.1", ["numpy==2.3.1"]),
    ("--with pandas==2.2.3", ["pandas==2.2.3"]),
    ("--with=requests==2.32.3", ["requests==2.32.3"]),
    ("-w 'scipy==1.14.1,Pillow==11.0.0'", ["pillow==11.0.0", "scipy==1.14.1"]),
    ('--with "pandas[Performance]==2.2.3"', ["pandas[performance]==2.2.3"]),
    ("-wnumpy==2.3.1", ["numpy==2.3.1"]),
])
def test_extra_pins_in_a_tb2_script(extra, pinned):
    pins = verifier_pins(_tb2_script(extra))
    assert pins.extra == tuple(pinned) and pins.python == "3.13" and not pins.unpinned


@pytest.mark.parametrize("script, requirements, unpinned, pythons, default", [
    # one line, --python forms, the tool itself pinned
    ("uvx --python=3.12 --with numpy==2.1.0 pytest==8.3.5 /tests -rA", ["numpy==2.1.0", "pytest==8.3.5"], [],
     ["3.12"], False),
    ("uvx --python 3.11 --from pytest==8.4.1 pytest -q", ["pytest==8.4.1"], [], ["3.11"], False),
    ("uvx -p python3.13 pytest@8.4.1", ["pytest==8.4.1"], [], ["3.13"], False),
    ("UV_PYTHON=3.12 uvx -w six==1.17.0 pytest==8.4.1", ["pytest==8.4.1", "six==1.17.0"], [], ["3.12"], False),
    # uv tool run / uv run --with / uv pip install, behind && and timeout
    ("cd /app && timeout -s KILL 900 uv -q tool run -p 3.13 -w attrs==24.2.0 pytest==8.4.1 /tests",
     ["attrs==24.2.0", "pytest==8.4.1"], [], ["3.13"], False),
    ("uv run --with scipy==1.14.1 --with pytest==8.4.1 pytest /tests", ["pytest==8.4.1", "scipy==1.14.1"], [], [],
     True),
    ("uv venv -p 3.12 && uv pip install --python 3.12 numpy==2.0.0 'requests>=2'", ["numpy==2.0.0"], ["requests>=2"],
     ["3.12"], False),
    # unpinned: recorded, never fetched; a version range joined back after the comma split
    ("uvx -p 3.13 -w pandas -w 'numpy>=2,<3' pytest==8.4.1", ["pytest==8.4.1"], ["pandas", "numpy>=2,<3"],
     ["3.13"], False),
    ("uvx -p 3.13 ruff check /app", [], ["ruff"], ["3.13"], False),
    # not installs: text in quotes, uvx python, other programs, a here-document's apostrophe
    ("echo 'uvx -w numpy==1.0 pytest'\ncat <<EOF\nit's not\nEOF\nuvx -p 3.13 python -c 'print(1)'\n"
     "conda install numpy==1.26.4\n", [], [], ["3.13"], False),
])
def test_script_variants(script, requirements, unpinned, pythons, default):
    pins = verifier_pins(script)
    assert list(pins.requirements) == requirements and list(pins.unpinned) == unpinned
    assert list(pins.pythons) == pythons and pins.default_python is default


def test_requirement_files_are_recorded():
    pins = verifier_pins("uvx -p 3.13 --with-requirements /tests/requirements.txt pytest==8.4.1 /tests\n")
    assert pins.requirement_files == ("/tests/requirements.txt",) and pins.requirements == ("pytest==8.4.1",)


def test_host_platform_tags_are_this_hosts():
    tags = host_platform_tags()
    assert tags[-1].startswith("linux_") and all("_" in t for t in tags)
    assert any(t.startswith("manylinux_2_17_") for t in tags)  # any glibc new enough to run the runner


# -- fetching: real downloads -------------------------------------------------------------------


@pytest.fixture(scope="module")
def fetched(tmp_path_factory):
    dest = tmp_path_factory.mktemp("wheels")
    try:
        return dest, fetch_verifier_wheels([EXTRA_PIN, "six==1.17.0"], dest, python="3.13")
    except VerifierWheelsError as exc:
        pytest.skip(f"needs the package index: {exc}")


def test_a_pure_and_a_binary_wheel_for_cp313(fetched):
    dest, result = fetched
    assert result.folder.parent == dest and not result.cached
    assert any(w.startswith("six-1.17.0-") and w.endswith("-none-any.whl") for w in result.wheels)
    binary = [w for w in result.wheels if w.lower().startswith("markupsafe-3.0.2-cp313-cp313-manylinux")]
    assert binary, result.wheels
    assert sorted(p.name for p in result.folder.iterdir() if not p.name.startswith(".")) == list(result.wheels)
    assert not list(dest.glob(".fetch-*"))  # made aside, renamed into place


def test_a_second_fetch_is_a_no_op(fetched):
    dest, first = fetched
    started = time.monotonic()
    again = fetch_verifier_wheels(["six==1.17.0", EXTRA_PIN], dest, python="3.13", pip=["/nonexistent/pip"])
    assert again.cached and again.folder == first.folder and again.wheels == first.wheels  # no pip ran
    assert time.monotonic() - started < 0.5


def test_another_python_is_another_folder(fetched):
    dest, first = fetched
    from sequester.verifier.wheels import cache_key
    assert cache_key(first.requirements, ["3.12"], first.platform_tags) != first.key


def test_a_pin_that_does_not_exist_names_itself(fetched, tmp_path):
    with pytest.raises(VerifierWheelsError, match=r"six==99\.0\.0") as err:
        fetch_verifier_wheels(["six==99.0.0"], tmp_path, python="3.13")
    assert "pip exited" in str(err.value) and not list(tmp_path.glob("[!.]*"))  # nothing half-made


def test_ensure_task_wheels_only_for_pins_beyond_the_runners(fetched, tmp_path):
    plain = load_task(make_task(tmp_path, "plain", test_sh=CANONICAL.read_text()))
    assert ensure_task_wheels(plain, tmp_path / "toolchain") is None  # no network either
    task = load_task(make_task(tmp_path, "extra", test_sh=_tb2_script()))
    folder = ensure_task_wheels(task, tmp_path / "toolchain")
    assert folder is not None and folder.parent == tmp_path / "toolchain" / TASK_WHEELS_DIR
    assert any(p.name.lower().startswith("markupsafe-3.0.2-cp313") for p in folder.iterdir())
    assert any(p.name.startswith("pytest-8.4.1-") for p in folder.iterdir())  # resolved together with the pins
    started = time.monotonic()
    assert ensure_task_wheels(task, tmp_path / "toolchain") == folder
    assert time.monotonic() - started < 0.2


# -- end to end: an episode's verifier, offline --------------------------------------------------

TESTS = '''"""The agent's /app/escape.py must escape HTML the way markupsafe does."""
import subprocess
import markupsafe

def test_escape_matches_markupsafe():
    text = '<a href="x">Tom & Jerry</a>'
    out = subprocess.run(["python3", "/app/escape.py", text], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == str(markupsafe.escape(text))
'''
SOLUTION = "import html, sys\nprint(html.escape(sys.argv[1]).replace('&quot;', '&#34;').replace('&#x27;', '&#39;'))\n"


@pytest.fixture
def task_with_a_pin(fetched, tmp_path):
    script = _tb2_script().replace("apt-get install -y curl", "apt-get install -y curl\n"
                                   f"ls -ld {layout.TASK_WHEELS} > /logs/verifier/wheels.txt 2>&1\n"
                                   f"touch {layout.TASK_WHEELS}/x 2>> /logs/verifier/wheels.txt")
    return make_task(tmp_path, "escape", test_sh=script, files={"tests/test_outputs.py": TESTS},
                     verifier_timeout=180)


@pytest.mark.slow
@needs_313
def test_a_pinned_package_the_tests_import_offline(task_with_a_pin):
    """Host mode, no network in the episode: uv finds markupsafe (cp313) in the task's
    folder, copied read-only into the verifier's namespace; the agent never sees it."""
    with Episode() as ep:
        ep.reset(task_with_a_pin, image_source="host")
        # Neither at the runner's mount nor in the host's toolchain folder (root's is in /var).
        places = f"{layout.RUNNER_MOUNT} {default_toolchain_dir()}"
        seen = ep.exec(f"ls {layout.TASK_WHEELS} 2>&1; find {places} -iname 'markupsafe*' 2>/dev/null | head -3; "
                       f"ls -A {default_toolchain_dir() / TASK_WHEELS_DIR} 2>&1", timeout=120)
        assert "markupsafe" not in seen.stdout.lower() and "No such file" in seen.stdout, seen.stdout
        wrong = ep.evaluate()
        assert wrong.reward == 0.0 and wrong.zero_reason is None and "ModuleNotFoundError" not in wrong.output
        assert "python3: can't open file '/app/escape.py'" in wrong.output or "FAILED" in wrong.output
        ep.write_file("/app/escape.py", SOLUTION)
        right = ep.evaluate()
    assert right.reward == 1.0, right.output[-3000:]
    said = right.files["wheels.txt"].decode()
    assert said.startswith("dr") and "Read-only file system" in said  # the verifier's copy is read-only


@needs_313
def test_a_task_without_extra_pins_mounts_nothing(tmp_path):
    script = CANONICAL.read_text().replace("apt-get update\n", f"ls {layout.TASK_WHEELS} > /logs/verifier/ls.txt 2>&1\n")
    task = make_task(tmp_path, "plain", test_sh=script, files={"tests/test_outputs.py": "def test_ok():\n    pass\n"})
    with Episode() as ep:
        ep.reset(task, image_source="host")
        result = ep.evaluate()
    assert result.reward == 1.0, result.output[-2000:]
    assert "No such file" in result.files["ls.txt"].decode()


def test_the_trial_fetches_before_the_agent_runs(fetched, tmp_path):
    """A pin that cannot be had fails the trial's environment set-up, before any agent
    run (which it would waste): the harness's error, not the agent's 0."""
    from sequester.environments.settings import EpisodeSettings
    from sequester.jobs import run_trial

    task = load_task(make_task(tmp_path, "nopin", test_sh=_tb2_script("-w six==99.0.0")))
    (tmp_path / "trials").mkdir()
    result = run_trial(task, "nop", tmp_path / "trials" / "nopin__x", settings=EpisodeSettings(), hide=[])
    assert result.exception_info is not None and "six==99.0.0" in result.exception_info.exception_message
    assert result.agent_execution.started_at is None and result.verifier_result is None


@pytest.mark.parametrize("script, pins", [
    ("pip install pytest==8.4.1 requests==2.32.5 psutil==7.0.0 pytest-json-ctrf==0.3.5 --break-system-packages\n",
     ("psutil==7.0.0", "pytest-json-ctrf==0.3.5", "pytest==8.4.1", "requests==2.32.5")),
    ("pip3 install -q pytest==8.4.2\n", ("pytest==8.4.2",)),
    ("python3 -m pip install --no-cache-dir pytest==8.4.1 numpy==2.3.1\n", ("numpy==2.3.1", "pytest==8.4.1")),
    ("pip list\npip show pytest\n", ()),
])
def test_pip_installs_are_pinned_for_the_runners_default_python(script, pins):
    """The runner's pip (a shim over its uv) installs offline: the script's pip pins are
    fetched when the episode starts, for the runner's default Python."""
    found = verifier_pins(script)
    assert found.requirements == pins and found.default_python == bool(pins), found


# -- pins published only as source distributions -----------------------------------------------


def _sdist(folder, name: str, version: str, pyproject: str, requires: list[str]):
    import io
    import tarfile

    path = folder / f"{name}-{version}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for member, text in ((f"{name}-{version}/pyproject.toml", pyproject),
                             (f"{name}-{version}/PKG-INFO", "Metadata-Version: 2.1\nName: demo\n"
                              + "".join(f"Requires-Dist: {r}\n" for r in requires))):
            data = text.encode()
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """A PEP 691 index on loopback serving one project, demo 1.0, as a source distribution."""
    import hashlib
    import http.server
    import json
    import threading

    files = tmp_path / "files"
    files.mkdir()
    sdist = _sdist(files, "demo", "1.0", '[build-system]\nrequires = ["flit_core>=3.2"]\n', ["idna>=3", "six; extra == 'x'"])
    digest = {"sha256": hashlib.sha256(sdist.read_bytes()).hexdigest()}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            port = self.server.server_address[1]
            if self.path == "/simple/demo/":
                body = json.dumps({"meta": {"api-version": "1.0"}, "name": "demo", "files": [
                    {"filename": sdist.name, "url": f"http://127.0.0.1:{port}/files/{sdist.name}", "hashes": digest}]})
                data, kind = body.encode(), "application/vnd.pypi.simple.v1+json"
            elif self.path == f"/files/{sdist.name}":
                data, kind = sdist.read_bytes(), "application/octet-stream"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{server.server_address[1]}/simple")
    yield sdist, digest
    server.shutdown()
    server.server_close()


def test_a_source_distribution_is_fetched_with_its_hash_checked_and_its_needs_read(local_index, tmp_path):
    from sequester.verifier.wheels import fetch_sdist

    name, needs = fetch_sdist(["/nonexistent/pip"], "demo==1.0", tmp_path, 60)
    assert name == "demo-1.0.tar.gz" and (tmp_path / name).read_bytes() == local_index[0].read_bytes()
    assert needs == ["flit_core>=3.2", "idna>=3", "six; extra == 'x'"]  # (pip evaluates the markers)
    assert fetch_sdist(["/nonexistent/pip"], "demo==2.0", tmp_path / "none", 60) == (None, [])


def test_a_source_distribution_whose_bytes_are_not_the_indexs_is_refused(local_index, tmp_path):
    from sequester.verifier.wheels import fetch_sdist

    local_index[0].write_bytes(local_index[0].read_bytes() + b"tampered")
    with pytest.raises(VerifierWheelsError, match="sha256"):
        fetch_sdist(["/nonexistent/pip"], "demo==1.0", tmp_path, 60)
    assert not (tmp_path / "demo-1.0.tar.gz").exists()


@pytest.fixture(scope="module")
def sdist_fetched(tmp_path_factory):
    dest = tmp_path_factory.mktemp("sdist-wheels")
    try:
        return fetch_verifier_wheels(["pytest==8.4.1", "chess==1.11.2"], dest, python="3.13")
    except VerifierWheelsError as exc:
        pytest.skip(f"needs the package index: {exc}")


def test_a_pin_published_only_as_a_source_distribution_is_fetched_as_one(sdist_fetched):
    """chess 1.11.2 has no wheel on PyPI (regex-chess pins it): its sdist, and wheels of
    what building it needs, are in the folder; nothing was built on the host."""
    import json

    names = sorted(p.name for p in sdist_fetched.folder.iterdir())
    assert "chess-1.11.2.tar.gz" in names and any(n.startswith("setuptools-") for n in names), names
    manifest = json.loads((sdist_fetched.folder / ".sequester-pins.json").read_text())
    assert manifest["source_distributions"] == {"chess==1.11.2": "chess-1.11.2.tar.gz"}
    assert not any(n.startswith("chess-") and n.endswith(".whl") for n in names)


@pytest.mark.slow
@needs_313
def test_the_verifier_builds_a_source_distribution_pin_offline(sdist_fetched, tmp_path):
    """uvx -w chess==1.11.2 in the verifier: uv builds it there, offline, from the task's
    folder (as under Docker, as the tests' own process), and the tests import it."""
    script = ('uvx -p 3.13 -w chess==1.11.2 python -c "import chess; print(chess.__version__)" '
              "> /logs/verifier/chess.txt 2> /logs/verifier/uv.txt\n"
              'if [ "$(cat /logs/verifier/chess.txt)" = 1.11.2 ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n')
    with Episode() as ep:
        ep.reset(make_task(tmp_path, "sdist", test_sh=script, verifier_timeout=300))
        result = ep.evaluate()
    assert result.reward == 1.0, (result.files.get("chess.txt"), result.output[-2000:])
