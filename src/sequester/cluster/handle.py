"""What a trainer holds of an :class:`~.pool.EpisodePool`: an episode's handle (its calls
go to the pool, which routes them to the actor holding the episode) and an actor's facts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sequester.cluster.actor import ExecOutput, FileContent, Verdict

if TYPE_CHECKING:
    from sequester.cluster.pool import EpisodePool

__all__ = ["ActorInfo", "EpisodeHandle"]


@dataclass(frozen=True)
class ActorInfo:
    """One actor of the pool: where it runs and how many episodes it holds (diagnostics)."""

    index: int
    node_id: str
    pid: int
    hostname: str
    alive: bool
    episodes: int


@dataclass(frozen=True)
class EpisodeHandle:
    """An episode of a pool; its calls delegate to the pool (sync, and ``a``-prefixed async)."""

    episode_id: str
    task: str
    instruction: str
    workdir: str
    node_id: str
    actor: int
    pool: EpisodePool = field(repr=False, compare=False)

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
