"""Shared fixtures: real processes, real sockets, no mocks of sequester's own parts."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from sequester.kernel import check

HELPERS = Path(__file__).parent / "helpers"
sys.path.insert(0, str(HELPERS))

# The tests' own skopeo runs (tests/helpers/registry.py) look for credentials in
# $XDG_RUNTIME_DIR/containers/auth.json, else /run/containers/UID/auth.json, and fail
# when root's podman made /run/containers 0700 (a root run before an ordinary user's).
# A private runtime folder for the session, removed at its end. (sequester itself always
# hands skopeo a credentials file of its choosing: sequester.images.credentials.)
if not os.environ.get("XDG_RUNTIME_DIR"):
    import atexit
    import shutil
    import tempfile

    _runtime = tempfile.mkdtemp(prefix="seqtest-runtime-")
    os.environ["XDG_RUNTIME_DIR"] = _runtime
    atexit.register(shutil.rmtree, _runtime, True)

# Ray reads its authentication settings once, when it is first imported: the test
# clusters' token (tests/helpers/ray_cluster.py) is fixed for the session before any
# test module imports Ray.
if not os.environ.get("RAY_AUTH_TOKEN_PATH"):
    import atexit
    import secrets
    import shutil
    import tempfile

    _ray_auth = tempfile.mkdtemp(prefix="seqtest-ray-")
    Path(_ray_auth, "token").write_text(secrets.token_hex(32))
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(Path(_ray_auth, "token")))
    atexit.register(shutil.rmtree, _ray_auth, True)


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


def _visible_dir() -> str | None:
    """A folder sandboxes show and the tests may write in: where tests put host files a
    sandbox could see unless told otherwise (not scratch space like /tmp or /var/tmp, which
    sandboxes replace).

    Root: ``/opt`` (part of the OS for root's rule). An ordinary user owns no folder the
    sandbox shows as it is (its home and its top-level folders are hidden), except what is
    mounted back read-only: sequester's own source folder (an editable install) or the
    Python installation (a virtual environment), when the user can write there. None: no
    such folder, and the tests that need one are skipped.
    """
    if os.geteuid() == 0:
        return "/opt"
    import sequester

    for candidate in (Path(sequester.__file__).resolve().parent.parent, Path(sys.prefix).resolve()):
        if os.access(candidate, os.W_OK | os.X_OK):
            return str(candidate)
    return None


VISIBLE_DIR = _visible_dir()
NO_VISIBLE_DIR = ("as an ordinary user, no folder the sandbox shows is writable here (neither sequester's "
                  "source nor the Python installation): nowhere to put a file a kernel would see")

requires_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests whose fixtures put files in :data:`VISIBLE_DIR` skip when there is none."""
    if VISIBLE_DIR is not None:
        return
    for item in items:
        if "secret_dir" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.skip(reason=NO_VISIBLE_DIR))


SEQTEST_USER = "seqtest"


@pytest.fixture(scope="session")
def seqtest_user():
    """The ordinary user ``seqtest`` (with a home), for tests run as an ordinary caller.

    Made for the session and removed at its end with its home and anything it still runs;
    a ``seqtest`` an earlier run left behind (its home holds the tests' ``secret.txt``) is
    taken over and removed too.
    """
    if os.geteuid() != 0:
        pytest.skip("creating a user needs root (CI runs as root)")
    from users import temporary_user

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

