"""Stopping a job's running trials from another thread (the job's, on Ctrl-C)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from sequester.errors import SequesterError

if TYPE_CHECKING:
    from sequester.environments import Environment

__all__ = ["Cancellation", "TrialCancelled"]


class TrialCancelled(SequesterError):
    """The trial was stopped from outside (the job was interrupted) before it had a verdict."""


class Cancellation:
    """Stops running trials from another thread (the job's, on Ctrl-C): the agents' next
    ``exec`` is refused, and each running episode is aborted, which ends the command in
    flight at once instead of after its timeout."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._episodes: set[Environment] = set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def cancel(self) -> None:
        with self._lock:
            self._event.set()
            for episode in self._episodes:
                episode.abort()

    def check(self) -> None:
        if self.cancelled:
            raise TrialCancelled("the job was interrupted")

    @contextlib.contextmanager
    def watching(self, episode: Environment) -> Iterator[None]:
        """While inside, :meth:`cancel` aborts ``episode``."""
        with self._lock:
            self._episodes.add(episode)
            if self.cancelled:
                episode.abort()
        try:
            yield
        finally:
            with self._lock:
                self._episodes.discard(episode)
