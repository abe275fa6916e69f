"""Shared fixtures: real processes, real sockets, no mocks of sequester's own parts."""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from sequester.kernel import check

HELPERS = Path(__file__).parent / "helpers"
sys.path.insert(0, str(HELPERS))

import conditions  # noqa: E402 - a helper: importable once HELPERS is on sys.path


@pytest.hookimpl(trylast=True)  # after the tmpdir plugin's: its factory is set up
def pytest_configure(config: pytest.Config) -> None:
    """Folders the whole session shares, in pytest's base folder (removed with it; nothing
    in /tmp outlives even a killed run).

    The tests' own skopeo runs (tests/helpers/registry.py) look for credentials in
    $XDG_RUNTIME_DIR/containers/auth.json, else /run/containers/UID/auth.json, and fail
    when root's podman made /run/containers 0700 (a root run before an ordinary user's):
    a private runtime folder for the session. (sequester itself always hands skopeo a
    credentials file of its choosing: sequester.images.credentials.)

    Ray reads its authentication settings once, when it is first imported: the test
    clusters' token (tests/helpers/ray_cluster.py) is fixed for the session before any
    test module imports Ray.

    Folders a killed run left where sandboxes see them (tests/helpers/conditions.py) are
    removed first: a task's solution among them is an oracle every thief test finds."""
    factory = config._tmp_path_factory  # type: ignore[attr-defined]
    from conditions import sweep_visible_leftovers

    sweep_visible_leftovers()  # a killed run's folders where episodes see them
    if not os.environ.get("XDG_RUNTIME_DIR"):
        runtime = factory.mktemp("runtime", numbered=False)
        runtime.chmod(0o700)
        os.environ["XDG_RUNTIME_DIR"] = str(runtime)
    if not os.environ.get("RAY_AUTH_TOKEN_PATH"):
        import secrets

        token = factory.mktemp("ray-auth", numbered=False) / "token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))


@pytest.fixture
def templates(monkeypatch):
    """Kernels of this test start from view templates (sequester.kernel.template), and
    none is kept before or after it: the module, for its cache and its knobs."""
    from sequester.kernel import template
    from stages import use_stage

    use_stage(monkeypatch, "template")
    template.close_templates()
    yield template
    template.close_templates()


@pytest.fixture
def tagged_service() -> Iterator:
    """Factory: a loopback TCP service that greets each client with a tag, then echoes."""
    with ExitStack() as stack:
        yield lambda tag, host="127.0.0.1": stack.enter_context(check.tagged_service(tag, host, echo=True))


VISIBLE_DIR = conditions.VISIBLE_DIR


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests whose fixtures put files in :data:`VISIBLE_DIR` skip when there is none."""
    if VISIBLE_DIR is not None:
        return
    for item in items:
        if "secret_dir" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.skip(reason=conditions.NO_VISIBLE_DIR))


@pytest.fixture(scope="session")
def seqtest_user():
    """The ordinary user ``seqtest`` (with a home), for tests run as an ordinary caller.

    Made for the session and removed at its end with its home and anything it still runs;
    a ``seqtest`` an earlier run left behind (its home holds the tests' ``secret.txt``) is
    taken over and removed too.
    """
    if os.geteuid() != 0:
        pytest.skip("creating a user needs root (CI runs as root)")
    from users import SEQTEST_USER, temporary_user

    def left_by_the_tests(entry) -> bool:
        try:
            return Path(entry.pw_dir, "secret.txt").read_text() == "home secret"
        except OSError:
            return False

    with temporary_user(SEQTEST_USER, leftover=left_by_the_tests) as entry:
        yield entry


@pytest.fixture
def episode():
    """A fresh episode, closed after the test."""
    from sequester.environments.local.episode import Episode

    ep = Episode()
    yield ep
    ep.close()



@pytest.fixture(scope="module")
def user_site(seqtest_user):
    """``(entry, home, data, site)``: the user ``seqtest`` with secrets in its home and in a
    top-level folder of its own (``/seqtest-data``), and a world-readable site holding a copy
    of sequester, its runtime dependencies and the example task ``python-csv-stats`` (in
    ``site/task``), where a harness written there runs as the user
    (:func:`nobody_site.run_as_user`). The site and the data folder are removed afterwards;
    the user and its home at the end of the session (``seqtest_user``).

    The site is in /var/tmp, not under pytest's base folder: the user could not traverse
    root's private ``/tmp/pytest-of-root``."""
    import shutil
    import tempfile

    from nobody_site import copy_packages
    from paths import EXAMPLES

    entry = seqtest_user
    home = Path(entry.pw_dir)
    (home / "secret.txt").write_text("home secret")
    data = Path(f"/{entry.pw_name}-data")
    data.mkdir(exist_ok=True)
    (data / "secret.txt").write_text("data secret")
    for path in (home / "secret.txt", data, data / "secret.txt"):
        os.chown(path, entry.pw_uid, entry.pw_gid)
    site = Path(tempfile.mkdtemp(prefix="seq-site-", dir="/var/tmp"))
    try:
        copy_packages(site)
        shutil.copytree(EXAMPLES / "python-csv-stats", site / "task")
        for root, _dirs, files in os.walk(site):
            os.chmod(root, 0o755)
            for f in files:
                os.chmod(Path(root, f), 0o755 if f in ("bwrap", "uv", "uvx", "patchelf") or f.endswith(".sh") else 0o644)
        yield entry, home, data, site
    finally:
        shutil.rmtree(site, ignore_errors=True)
        shutil.rmtree(data, ignore_errors=True)


# -- leaving nothing behind --------------------------------------------------------------------


def make_removable(top: Path) -> None:
    """Every folder under ``top`` (itself included) made u+rwx again, so that pytest can
    remove its base folder as an ordinary user: tests leave folders of mode 000, 500 or 555
    there (an agent's view, a hostile layer, a read-only tree). Walked top-down, each folder
    changed before it is entered; symbolic links are never followed, and folders this
    process cannot change (another user's) are left as they are."""

    def fix(path: str) -> None:
        try:
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode) and st.st_mode & 0o700 != 0o700:
                os.chmod(path, stat.S_IMODE(st.st_mode) | 0o700)
        except OSError:
            pass

    fix(str(top))
    for folder, dirs, _files in os.walk(top, topdown=True, followlinks=False):
        for name in dirs:
            fix(os.path.join(folder, name))


@pytest.fixture(autouse=True)
def _removable_tmp_path(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test that has a ``tmp_path`` (itself or through a fixture), its folders are
    made removable again (:func:`make_removable`), before pytest's own teardown of it."""
    tmp = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if tmp is not None:
        make_removable(tmp)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """At the end of the session, the same for the whole base folder: the folders of
    ``tmp_path_factory`` (module and session fixtures) too."""
    factory = getattr(session.config, "_tmp_path_factory", None)
    basetemp = getattr(factory, "_basetemp", None) if factory is not None else None
    if basetemp is not None and Path(basetemp).is_dir():
        make_removable(Path(basetemp))


# -- slow tests --------------------------------------------------------------------------------

SLOW_SECONDS = 2.0
_durations: dict[str, float] = {}  # node id -> seconds: set-up, call and teardown
_marked_slow: set[str] = set()


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    _marked_slow.update(item.nodeid for item in session.items if item.get_closest_marker("slow"))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each test's time, its three phases together (a module fixture's set-up counts for
    the first test that needs it, as in the JUnit report)."""
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """A report, not a failure: the tests that took longer than :data:`SLOW_SECONDS` and
    are not marked ``slow`` (``pytest -m "not slow"`` is meant as a quick loop)."""
    unmarked = sorted(((seconds, nodeid) for nodeid, seconds in _durations.items()
                       if seconds > SLOW_SECONDS and nodeid not in _marked_slow), reverse=True)
    if unmarked:
        terminalreporter.write_sep("=", f"{len(unmarked)} tests took over {SLOW_SECONDS:g} s and are not marked slow")
        for seconds, nodeid in unmarked:
            terminalreporter.write_line(f"{seconds:7.2f}s {nodeid}")
