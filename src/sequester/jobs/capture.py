"""What an agent prints goes to its trial's log, not to the terminal.

Agents run in the job's threads, in this process: their ``print()`` writes to the
process's ``sys.stdout``, where it would land above the table (or inside rich's progress
display). While any trial runs, ``sys.stdout`` and ``sys.stderr`` are replaced by a proxy
that sends what a trial's thread writes to that trial's sink (its ``trial.log``) and
everything else (the progress bar, the main thread) to the stream that was there before.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TextIO

__all__ = ["capture_thread_output"]

Sink = Callable[[str, str], None]  # (stream name, text)


class _Router:
    """A text stream that sends each write to the sink of the writing thread, if it has
    one, else to the stream it replaced."""

    def __init__(self, name: str, fallback: TextIO, sinks: dict[int, Sink]):
        self._name, self._fallback, self._sinks = name, fallback, sinks

    def write(self, text: str) -> int:
        sink = self._sinks.get(threading.get_ident())
        if sink is None:
            return self._fallback.write(text)
        if text:
            sink(self._name, text)
        return len(text)

    def flush(self) -> None:
        if threading.get_ident() not in self._sinks:
            self._fallback.flush()

    def isatty(self) -> bool:
        return threading.get_ident() not in self._sinks and self._fallback.isatty()

    def __getattr__(self, name: str) -> object:  # encoding, fileno, ... of the real stream
        return getattr(self._fallback, name)


class _Capture:
    """Installs the routers while at least one thread is registered, and puts the
    previous streams back when the last one leaves (unless someone replaced ours since)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sinks: dict[int, Sink] = {}
        self._saved: tuple[TextIO, TextIO] | None = None
        self._installed: tuple[_Router, _Router] | None = None

    def enter(self, sink: Sink) -> None:
        with self._lock:
            if not self._sinks:
                self._saved = (sys.stdout, sys.stderr)
                self._installed = (
                    _Router("stdout", sys.stdout, self._sinks),
                    _Router("stderr", sys.stderr, self._sinks),
                )
                sys.stdout, sys.stderr = self._installed
            self._sinks[threading.get_ident()] = sink

    def leave(self) -> None:
        with self._lock:
            self._sinks.pop(threading.get_ident(), None)
            if self._sinks or self._saved is None or self._installed is None:
                return
            if sys.stdout is self._installed[0]:
                sys.stdout = self._saved[0]
            if sys.stderr is self._installed[1]:
                sys.stderr = self._saved[1]
            self._saved = self._installed = None


_CAPTURE = _Capture()


@contextlib.contextmanager
def capture_thread_output(sink: Sink) -> Iterator[None]:
    """While inside, what this thread writes to ``sys.stdout``/``sys.stderr`` goes to
    ``sink(stream, text)`` instead (other threads' output is untouched)."""
    _CAPTURE.enter(sink)
    try:
        yield
    finally:
        _CAPTURE.leave()
