"""The verifier: what runs, with what environment, and how its verdict is read.

Staging and running happen in the namespace helper (see :mod:`._nsexec_server`): the
pristine ``tests/`` of the source task, streamed from the host, unpacked in a tmpfs at
``/tests`` that only the verifier's private mount namespace has, next to a fresh
``/logs/verifier``. Here: the pure parts (the command, the scrubbed environment, the
strict reading of ``reward.json``/``reward.txt``) and the errors that tell "the tests ran
and failed" (a reward of 0) from "the verifier could not run" (an exception).
"""

from __future__ import annotations

import io
import json
import math
import os
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sequester.errors import SequesterError
from sequester.tasks import Task
from sequester.verifier import layout
from sequester.verifier.environ import runner_env
from sequester.verifier.tree import PINNED

__all__ = [
    "VerifierError", "VerifierCouldNotRun", "VerifierTimeout", "RewardFileMissing", "RewardInvalid",
    "VerifierResult", "tests_archive", "tests_mention", "verifier_argv", "verifier_env", "parse_rewards", "primary_reward",
]

RUNNER_FD = 3  # in the test script: the pipe on which the runner reports that pytest started
# pytest's configuration files, in the order it looks for them in a folder. When the
# task's tests have none, the staged /tests gets an empty .pytest.ini: pytest then takes
# /tests as its root and looks no further up (the view's root folder is the agent's, and
# a pytest.ini + conftest.py there would configure the verifier's pytest).
PYTEST_CONFIGS = ("pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")


class VerifierError(SequesterError):
    """The verifier produced no verdict. What it did produce is kept for the host: what it
    printed (``output``), the files it left (``files``), and the tampering found before it
    ran (``tampering``)."""

    def __init__(self, message: str, *, output: str = "", exit_code: int | None = None, duration: float = 0.0,
                 files: dict[str, bytes] | None = None, tampering: tuple[str, ...] = ()):
        super().__init__(message)
        self.output, self.exit_code, self.duration = output, exit_code, duration
        self.files, self.tampering = dict(files or {}), tuple(tampering)


class VerifierCouldNotRun(VerifierError):
    """The tests did not run: staging failed, the script could not start, or its bootstrap
    (a download, a Python or package it needs) failed."""


class VerifierTimeout(VerifierError):
    """The verifier ran over ``[verifier] timeout_sec`` and was killed."""


class RewardFileMissing(VerifierError):
    """The script finished but wrote neither reward.json nor reward.txt."""


class RewardInvalid(VerifierError):
    """A reward file is unparseable, not finite, or outside [0, 1]."""


@dataclass(frozen=True)
class VerifierResult:
    rewards: dict[str, float]
    output: str
    exit_code: int | None
    duration: float
    files: dict[str, bytes] = field(default_factory=dict)
    tampering: tuple[str, ...] = ()
    frozen: str | None = None  # how the agent was frozen during the run, if it was
    # Why the reward is 0 without the tests saying so: the agent caused the verifier to
    # end without a valid verdict (a timeout, no reward file, an invalid one). Trainers
    # drop errored trials, so such an end is the agent's 0, never an error.
    zero_reason: str | None = None
    notes: tuple[str, ...] = ()

    @property
    def reward(self) -> float:
        return primary_reward(self.rewards)


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
            data = b"# sequester: pytest's root is /tests (see sequester.environments.verdict)\n[pytest]\n"
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
    for current, dirs, files in os.walk(root):
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
        'case $rc in 0) echo 1 > /logs/verifier/reward.txt;; 1) echo 0 > /logs/verifier/reward.txt;;'
        ' *) echo "sequester: pytest could not run the tests (exit $rc)" >&2;; esac\n'
    )
    return [bash, "-c", script]


def verifier_env(task: Task, *, task_wheels: bool = False) -> dict[str, str]:
    """The runner's environment (see :func:`sequester.verifier.environ.runner_env`):
    the image's own variables (Dockerfile ENV), the task's ``[verifier] env``, and the
    runner's; nothing of the agent shell's. ``task_wheels``: uv also finds the task's
    pinned wheels (:data:`~sequester.verifier.layout.TASK_WHEELS`)."""
    image = task.dockerfile.env_map if task.dockerfile is not None else {}
    return runner_env(image, task.config.verifier.env, runner_fd=RUNNER_FD,
                      find_links=(str(layout.TASK_WHEELS),) if task_wheels else ())


DEFAULT_REWARD_RANGE = (0.0, 1.0)


def _number(value: Any, where: str, reward_range: tuple[float, float] | None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RewardInvalid(f"{where}: {value!r} is not a number")
    number = float(value)
    if not math.isfinite(number):
        raise RewardInvalid(f"{where}: {value!r} is not finite")
    if reward_range is not None and not reward_range[0] <= number <= reward_range[1]:
        raise RewardInvalid(f"{where}: {value!r} is outside [{reward_range[0]:g}, {reward_range[1]:g}]")
    return number


def parse_rewards(files: dict[str, bytes],
                  reward_range: tuple[float, float] | None = DEFAULT_REWARD_RANGE) -> dict[str, float]:
    """The verdict: ``reward.json`` (a flat object of numbers) if present, else
    ``reward.txt`` (one number). Strict: anything else is :class:`RewardInvalid`. Every
    number must be finite, and within ``reward_range`` unless that is ``None`` (Harbor
    accepts any finite number)."""
    if "reward.json" in files:
        try:
            data = json.loads(files["reward.json"].decode("utf-8"), parse_constant=_reject_constant)
        except (UnicodeDecodeError, ValueError) as exc:
            raise RewardInvalid(f"reward.json is not valid JSON: {exc}") from None
        if not isinstance(data, dict) or not data:
            raise RewardInvalid("reward.json is not a non-empty flat object")
        rewards = {str(k): _number(v, f"reward.json[{k!r}]", reward_range) for k, v in data.items()}
        primary_reward(rewards)
        return rewards
    if "reward.txt" in files:
        text = files["reward.txt"].decode("utf-8", "replace").strip()
        try:
            value = float(text)
        except ValueError:
            raise RewardInvalid(f"reward.txt: {text[:50]!r} is not a number") from None
        return {"reward": _number(value, "reward.txt", reward_range)}
    raise RewardFileMissing("the verifier wrote neither /logs/verifier/reward.json nor reward.txt")


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a valid reward")


def primary_reward(rewards: dict[str, float]) -> float:
    if "reward" in rewards:
        return rewards["reward"]
    if len(rewards) == 1:
        return next(iter(rewards.values()))
    raise RewardInvalid(f"reward.json has several values ({', '.join(sorted(rewards))}) and no 'reward'")
