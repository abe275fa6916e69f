"""What the verifier's runner is asked to run, and with what: the task's pristine tests as a
tar (staged by the namespace helper in a tmpfs only the verifier's mount namespace has, at
``/tests``), the command (the tree's ``bash /tests/test.sh``, else pinned pytest), and
the scrubbed environment. Pure but for reading the task's files."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

from sequester.tasks import Task
from sequester.verifier import layout
from sequester.verifier.environ import runner_env
from sequester.verifier.image_python import IMAGE_PYTHON_VAR, IMAGE_SITE_VAR, ImagePython
from sequester.verifier.tree import PINNED

__all__ = ["PYTEST_CONFIGS", "RUNNER_FD", "tests_archive", "tests_mention", "verifier_argv", "verifier_env"]

RUNNER_FD = 3  # in the test script: the pipe on which the runner reports that pytest started
# pytest's configuration files, in the order it looks for them in a folder. When the
# task's tests have none, the staged /tests gets an empty .pytest.ini: pytest then takes
# /tests as its root and looks no further up (the view's root folder is the agent's, and
# a pytest.ini + conftest.py there would configure the verifier's pytest).
PYTEST_CONFIGS = ("pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")


def tests_archive(task: Task) -> bytes:
    """An uncompressed tar of the task's tests folder (its real path, read only), plus
    the ``.pytest.ini`` that pins pytest's root to ``/tests`` when the task has none."""
    root = task.tests_dir.resolve(strict=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for current, dirs, files in os.walk(root):
            dirs.sort()
            for name in sorted([*dirs, *files]):
                path = Path(current, name)
                if path.is_symlink() or path.is_dir() or path.is_file():
                    tar.add(path, arcname=str(path.relative_to(root)), recursive=False)
        if not any(_configures_pytest(root / name) for name in PYTEST_CONFIGS):
            data = b"# sequester: pytest's root is /tests (see sequester.verifier.invocation)\n[pytest]\n"
            info = tarfile.TarInfo(".pytest.ini")
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


_MENTION_FILES, _MENTION_BYTES = 2000, 64 << 20


def tests_mention(task: Task, word: bytes) -> bool:
    """Whether any file of the task's pristine tests contains ``word`` (bounded: the first
    2000 files, 64 MiB; links are not followed). Unreadable tests count as mentioning it."""
    try:
        root = task.tests_dir.resolve(strict=True)
    except OSError:
        return True
    seen = read = 0
    for current, _dirs, files in os.walk(root):
        for name in files:
            path = Path(current, name)
            seen += 1
            if seen > _MENTION_FILES or read > _MENTION_BYTES:
                return True
            if path.is_symlink() or not path.is_file():
                continue
            try:
                data = path.read_bytes()[:_MENTION_BYTES]
            except OSError:
                return True
            read += len(data)
            if word in data:
                return True
    return False


def _configures_pytest(path: Path) -> bool:
    """Whether pytest takes ``path`` as its configuration file (its own rules)."""
    if path.name in ("pytest.ini", ".pytest.ini"):
        return path.is_file()
    try:
        text = path.read_text(errors="replace") if path.is_file() else ""
    except OSError:
        return False
    section = {"pyproject.toml": "[tool.pytest.ini_options]", "tox.ini": "[pytest]", "setup.cfg": "[tool:pytest]"}
    return section[path.name] in text


def verifier_argv(task: Task) -> list[str]:
    """The tree's ``bash /tests/test.sh``; without one, pinned pytest on the staged tests."""
    bash = str(layout.BIN / "bash")
    if task.test_script is not None:
        return [bash, "/tests/test.sh"]
    pytest = next(p for p in PINNED if p.startswith("pytest=="))
    script = (
        f"uvx -p python3 -w {pytest} pytest /tests -rA\n"
        "rc=$?\n"
        # 0: passed, 1: some failed. Anything else (no tests, usage or internal error,
        # a failed bootstrap) is not a verdict.
        "case $rc in 0) echo 1 > /logs/verifier/reward.txt;; 1) echo 0 > /logs/verifier/reward.txt;;"
        ' *) echo "sequester: pytest could not run the tests (exit $rc)" >&2;; esac\n'
    )
    return [bash, "-c", script]


def verifier_env(task: Task, *, task_wheels: bool = False, image_python: ImagePython | None = None) -> dict[str, str]:
    """The runner's environment (see :func:`sequester.verifier.environ.runner_env`):
    the image's own variables (Dockerfile ENV), the task's ``[verifier] env``, and the
    runner's; nothing of the agent shell's. ``task_wheels``: uv also finds the task's
    pinned wheels (:data:`~sequester.verifier.layout.TASK_WHEELS`). ``image_python``: the
    image's ``python3`` (:mod:`.image_python`), which the runner's ``python3`` follows."""
    image = task.dockerfile.env_map if task.dockerfile is not None else {}
    env = runner_env(
        image,
        task.config.verifier.env,
        runner_fd=RUNNER_FD,
        find_links=(str(layout.TASK_WHEELS),) if task_wheels else (),
    )
    if image_python is not None:
        env[IMAGE_PYTHON_VAR] = image_python.version
        env[IMAGE_SITE_VAR] = ":".join(image_python.site)
    return env
