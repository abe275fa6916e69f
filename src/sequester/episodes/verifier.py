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

from ..errors import SequesterError
from ..tasks import Task
from .toolchain import PINNED, verifier_tool_env
from .view import TOOLCHAIN_MOUNT

__all__ = [
    "VerifierError", "VerifierCouldNotRun", "VerifierTimeout", "RewardFileMissing", "RewardInvalid",
    "VerifierResult", "tests_archive", "verifier_argv", "verifier_env", "parse_rewards", "primary_reward",
]

VERIFIER_PATH = f"{TOOLCHAIN_MOUNT}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


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
    reward_zeroed: bool = False  # on_tamper = "zero" applied

    @property
    def reward(self) -> float:
        return primary_reward(self.rewards)


def tests_archive(task: Task) -> bytes:
    """An uncompressed tar of the task's tests folder (its real path, read only)."""
    root = task.tests_dir.resolve(strict=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for current, dirs, files in os.walk(root):
            dirs.sort()
            for name in sorted([*dirs, *files]):
                path = Path(current, name)
                if path.is_symlink() or path.is_dir() or path.is_file():
                    tar.add(path, arcname=str(path.relative_to(root)), recursive=False)
    return buf.getvalue()


def verifier_argv(task: Task) -> list[str]:
    """``bash /tests/test.sh``; without one, pytest (pinned) on the staged tests."""
    if task.test_script is not None:
        return ["bash", "/tests/test.sh"]
    pytest = next(p for p in PINNED if p.startswith("pytest=="))
    script = (
        f"uvx -p python3 -w {pytest} pytest /tests -rA\n"
        "rc=$?\n"
        # 0: passed, 1: some failed. Anything else (no tests, usage or internal error,
        # a failed bootstrap) is not a verdict.
        'case $rc in 0) echo 1 > /logs/verifier/reward.txt;; 1) echo 0 > /logs/verifier/reward.txt;;'
        ' *) echo "sequester: pytest could not run the tests (exit $rc)" >&2;; esac\n'
    )
    return ["bash", "-c", script]


def verifier_env(task: Task) -> dict[str, str]:
    """A scrubbed environment: none of the agent shell's variables (PYTHONPATH,
    PYTEST_ADDOPTS, LD_PRELOAD, BASH_ENV, ...), only the image's own (Dockerfile ENV), the
    task's ``[verifier] env``, and what the toolchain needs."""
    env = {"PATH": VERIFIER_PATH, "HOME": "/root", "LANG": "C.UTF-8", "TERM": "dumb"}
    if task.dockerfile is not None:
        env.update(task.dockerfile.env_map)
        env["PATH"] = _with_toolchain(env.get("PATH", VERIFIER_PATH))
    env.update(task.config.verifier.env)
    env.update(verifier_tool_env(str(TOOLCHAIN_MOUNT)))
    for name in ("BASH_ENV", "ENV", "LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONSTARTUP", "PYTEST_ADDOPTS",
                 "PYTEST_PLUGINS", "PYTHONHOME"):
        if name not in task.config.verifier.env:  # only the task itself may set these
            env.pop(name, None)
    return env


def _with_toolchain(path: str) -> str:
    entries = [p for p in path.split(":") if p and p != f"{TOOLCHAIN_MOUNT}/bin"]
    return ":".join([f"{TOOLCHAIN_MOUNT}/bin", *entries])


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RewardInvalid(f"{where}: {value!r} is not a number")
    number = float(value)
    if not math.isfinite(number):
        raise RewardInvalid(f"{where}: {value!r} is not finite")
    if not 0.0 <= number <= 1.0:
        raise RewardInvalid(f"{where}: {value!r} is outside [0, 1]")
    return number


def parse_rewards(files: dict[str, bytes]) -> dict[str, float]:
    """The verdict: ``reward.json`` (a flat object of numbers) if present, else
    ``reward.txt`` (one number). Strict: anything else is :class:`RewardInvalid`."""
    if "reward.json" in files:
        try:
            data = json.loads(files["reward.json"].decode("utf-8"), parse_constant=_reject_constant)
        except (UnicodeDecodeError, ValueError) as exc:
            raise RewardInvalid(f"reward.json is not valid JSON: {exc}") from None
        if not isinstance(data, dict) or not data:
            raise RewardInvalid("reward.json is not a non-empty flat object")
        rewards = {str(k): _number(v, f"reward.json[{k!r}]") for k, v in data.items()}
        primary_reward(rewards)
        return rewards
    if "reward.txt" in files:
        text = files["reward.txt"].decode("utf-8", "replace").strip()
        try:
            value = float(text)
        except ValueError:
            raise RewardInvalid(f"reward.txt: {text[:50]!r} is not a number") from None
        return {"reward": _number(value, "reward.txt")}
    raise RewardFileMissing("the verifier wrote neither /logs/verifier/reward.json nor reward.txt")


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a valid reward")


def primary_reward(rewards: dict[str, float]) -> float:
    if "reward" in rewards:
        return rewards["reward"]
    if len(rewards) == 1:
        return next(iter(rewards.values()))
    raise RewardInvalid(f"reward.json has several values ({', '.join(sorted(rewards))}) and no 'reward'")
