"""A fake backend for unit tests of what drives environments (the job runner, the server).

Nothing runs: files live in a dict, ``exec`` answers from a handler the test gives, and
``evaluate`` scores with a function of the files. Each call can be made to fail
(``fail={"close": SandboxError("...")}``) and the capabilities declared freely, so the
runner's failure paths (a start that fails, scoring that raises, a cleanup that fails, a
backend that lacks what the trial needs) are tested without an engine. Never a backend a
user can pick: ``open_environment`` does not know it.
"""

from __future__ import annotations

import io
import os
import tarfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from sequester.environments.archive import DIR_LIMIT
from sequester.environments.base import Capabilities, ExecResult
from sequester.environments.settings import EpisodeSettings
from sequester.environments.verdict import VerifierResult
from sequester.errors import EpisodeError
from sequester.tasks import Task, load_task

__all__ = ["FakeEnvironment", "FAKE_CAPABILITIES"]

FAKE_CAPABILITIES = Capabilities(
    backend="fake", separate_verifier=True, shared_verifier=True, freeze=True, trusted_runner=True
)
Handler = Callable[[str, dict[str, bytes]], tuple[str, int]]  # (command, files) -> (stdout, exit code)
Scorer = Callable[[dict[str, bytes]], float]


class FakeEnvironment:
    """See module doc. ``calls`` records every call by name, in order."""

    def __init__(
        self,
        settings: EpisodeSettings | None = None,
        *,
        capabilities: Capabilities = FAKE_CAPABILITIES,
        handler: Handler | None = None,
        scorer: Scorer | None = None,
        fail: Mapping[str, BaseException] | None = None,
    ):
        self.settings = settings or EpisodeSettings()
        self._capabilities = capabilities
        self.handler = handler or (lambda command, files: ("", 0))
        self.scorer = scorer or (lambda files: 1.0 if files.get("/app/done") == b"yes" else 0.0)
        self.fail = dict(fail or {})
        self.files: dict[str, bytes] = {}
        self.calls: list[str] = []
        self._task: Task | None = None
        self.closed = self.aborted = False

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.fail:
            raise self.fail[name]
        if name not in ("close", "abort") and (self.closed or self.aborted):
            raise EpisodeError("the episode is closed" if self.closed else "the episode was aborted")

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    def start(self, task: Task | str | os.PathLike[str]) -> FakeEnvironment:
        self._call("start")
        self._task = task if isinstance(task, Task) else load_task(task)
        return self

    @property
    def task(self) -> Task:
        if self._task is None:
            raise EpisodeError("the episode is not running: call start(task) first")
        return self._task

    @property
    def instruction(self) -> str:
        return self.task.instruction

    @property
    def workdir(self) -> str:
        return "/app"

    @property
    def notes(self) -> list[str]:
        return []

    @property
    def system(self) -> dict[str, object]:
        return {"mode": "fake"}

    def exec(self, command: str, timeout: float | None = None) -> ExecResult:
        self._call("exec")
        started = time.monotonic()
        out, code = self.handler(command, self.files)
        return ExecResult(out, "", code, False, time.monotonic() - started)

    def write_file(self, path: str, content: bytes | str, mode: int = 0o644) -> None:
        self._call("write_file")
        self.files[path] = content.encode() if isinstance(content, str) else content

    def read_file(self, path: str) -> bytes:
        self._call("read_file")
        if path not in self.files:
            raise EpisodeError(f"{path}: no such file")
        return self.files[path]

    def upload_dir(self, source: str | os.PathLike[str], dest: str) -> None:
        self._call("upload_dir")
        root = Path(source)
        for path in sorted(root.rglob("*")):
            if path.is_file():
                self.files[f"{dest.rstrip('/')}/{path.relative_to(root)}"] = path.read_bytes()

    def read_dir(self, path: str, limit: int = DIR_LIMIT) -> bytes:
        self._call("read_dir")
        prefix = path.rstrip("/") + "/"
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w") as tar:
            for name, data in sorted(self.files.items()):
                if name.startswith(prefix):
                    info = tarfile.TarInfo(name[len(prefix) :])
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        if len(out.getvalue()) > limit:
            raise EpisodeError(f"{path}: larger than {limit} bytes")
        return out.getvalue()

    def evaluate(self, *, freeze: bool | None = None, verifier_env: str | None = None) -> VerifierResult:
        self._call("evaluate")
        reward = self.scorer(self.files)
        return VerifierResult(rewards={"reward": reward}, output="", exit_code=0, duration=0.0)

    def abort(self) -> None:
        self.calls.append("abort")
        self.aborted = True

    def close(self) -> None:
        self._call("close")
        self.closed = True
