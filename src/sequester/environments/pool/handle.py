"""What a caller holds of an :class:`~.core.EpisodePool`: an episode's handle. Its calls go
to the pool, which routes them to the episode (a thread here, or the Ray actor holding it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sequester.environments.pool.held import ExecOutput, FileContent, Verdict

if TYPE_CHECKING:
    from sequester.environments.pool.core import CheckpointInfo, EpisodePool

__all__ = ["EpisodeHandle"]


@dataclass(frozen=True)
class EpisodeHandle:
    """An episode of a pool, started; its calls delegate to the pool (sync, and
    ``a``-prefixed async). ``node_id`` and ``actor``: where it runs (the Ray backend's node
    and actor index; ``"local"`` and -1 for the local backend). ``calibration``: the task's
    calibration state, as the server's reset observation carries it."""

    episode_id: str
    task: str
    instruction: str
    workdir: str
    node_id: str
    actor: int
    pool: EpisodePool = field(repr=False, compare=False)
    calibration: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def exec(self, command: str, timeout: float | None = None) -> ExecOutput:
        return self.pool.exec(self, command, timeout)

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> int:
        return self.pool.write_file(self, path, data, mode)

    def read_file(self, path: str) -> FileContent:
        return self.pool.read_file(self, path)

    def evaluate(self) -> Verdict:
        return self.pool.evaluate(self)

    def close(self) -> None:
        self.pool.close(self)

    def checkpoint(self) -> CheckpointInfo:
        return self.pool.checkpoint(self)

    def rollback(self, checkpoint: CheckpointInfo | str) -> None:
        self.pool.rollback(self, checkpoint)

    async def acheckpoint(self) -> CheckpointInfo:
        return await self.pool.acheckpoint(self)

    async def arollback(self, checkpoint: CheckpointInfo | str) -> None:
        await self.pool.arollback(self, checkpoint)

    async def aexec(self, command: str, timeout: float | None = None) -> ExecOutput:
        return await self.pool.aexec(self, command, timeout)

    async def awrite_file(self, path: str, data: bytes | str, mode: int = 0o644) -> int:
        return await self.pool.awrite_file(self, path, data, mode)

    async def aread_file(self, path: str) -> FileContent:
        return await self.pool.aread_file(self, path)

    async def aevaluate(self) -> Verdict:
        return await self.pool.aevaluate(self)

    async def aclose(self) -> None:
        await self.pool.aclose(self)

    def __enter__(self) -> EpisodeHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> EpisodeHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
