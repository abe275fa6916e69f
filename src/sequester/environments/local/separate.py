"""A separate verifier environment (Harbor's ``[verifier] environment_mode = "separate"``).

The tests run in a fresh view of the task's pristine environment (a second episode of
the same task, with no agent shell) into which only the task's declared ``artifacts``
are copied from the agent's final state (its working directory when it declares none:
:func:`~sequester.environments.base.separate_artifacts`): no agent process and no file
the agent changed outside those paths is in it. The copy is a tar made inside the agent's view (links kept
as links, never followed; no devices, fifos or hard links) and unpacked inside the new
view, where nothing is written through a link; its size is bounded.
"""

from __future__ import annotations

import atexit
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from sequester.environments.base import separate_artifacts
from sequester.environments.local.evaluation import run_tests
from sequester.environments.verdict import Evaluation
from sequester.errors import SequesterError

if TYPE_CHECKING:
    from sequester.environments.local.episode import Episode
    from sequester.sandbox.nsexec.client import NsExec

__all__ = ["evaluate_separately", "ARTIFACT_LIMIT", "Spare"]

log = logging.getLogger("sequester.environments.local")

ARTIFACT_LIMIT = 256 << 20  # the tar is held in the host's memory while it is copied
_CLOSE_AFTER = 0.05  # seconds after the tests end that the separate environment is removed


def evaluate_separately(
    episode: Episode,
    fresh: Episode,
    nsexec: NsExec,
    agent_init: int,
    *,
    with_artifacts: bool = True,
    started: bool = False,
) -> tuple[Evaluation, tuple[str, ...]]:
    """The tests in ``fresh`` (a new, unstarted episode of the same settings) started as a
    pristine view of ``episode``'s task; ``with_artifacts``: with the task's artifacts
    copied from the agent's view (else nothing of the agent's); ``started``: ``fresh``
    is that view already (a :class:`Spare`'s)."""
    task, workdir = episode.task, episode.workdir
    notes: list[str] = ["the verifier ran in a separate environment (the task's pristine one plus its artifacts)"]
    artifacts, said = separate_artifacts(task, workdir) if with_artifacts else ((), None)
    notes += [said] if said else []
    packed: list[tuple[bytes, list[str]] | BaseException] = []

    def pack() -> None:  # the agent's artifacts are read while the fresh environment starts
        try:
            packed.append(
                nsexec.pack(
                    agent_init,
                    [a.source for a in artifacts],
                    {a.source: list(a.exclude) for a in artifacts},
                    limit=ARTIFACT_LIMIT,
                )
            )
        except BaseException as exc:  # noqa: BLE001 - raised again below
            packed.append(exc)

    packing = threading.Thread(target=pack, name="sequester-artifacts", daemon=True) if artifacts else None
    try:
        if packing is not None:
            packing.start()
        try:
            if not started:
                fresh.reset(task, workdir=workdir, shell=False, image=episode.image)  # the same image (or host)
        finally:
            if packing is not None:
                packing.join()
        if packed:
            try:
                if isinstance(packed[0], BaseException):
                    raise packed[0]  # (the agent's loss if a SequesterError, else what it is)
                tar, missing = packed[0]
                nsexec.extract_artifacts(fresh.init_pid, tar)
                notes += [f"artifact {path} does not exist in the agent's environment" for path in missing]
            except SequesterError as exc:  # the agent's content could not be copied: its loss
                notes.append(f"the artifacts were not copied: {exc}")
        ev = run_tests(
            nsexec,
            task,
            init_pid=fresh.init_pid,
            workdir=workdir,
            runner=fresh.runner,
            wheels=fresh.wheels,
            installs=fresh.installs,
            image_python=fresh.image_python,
            output_limit=episode.settings.output_bytes,
            max_processes=episode.settings.max_processes,
        )
    finally:
        # Its processes die now; removing its layers (slow on overlayfs: ~1 ms a folder)
        # need not hold up the verdict, nor share this interpreter with it while the verdict
        # is read: it starts a moment later. A process that exits first leaves them to the
        # next start's stale-state removal.
        fresh.abort()
        with _pending_lock:
            _pending[fresh] = threading.Lock()
        later = threading.Timer(_CLOSE_AFTER, _close, args=(fresh,))
        later.name, later.daemon = "sequester-separate-close", True
        later.start()
    return ev, tuple(notes)


class Spare:
    """A separate verifier's environment started ahead, in a thread, when an agent's
    episode starts on a task whose verifier runs separately (a view of the task's
    pristine environment with no process but its init: nothing of the agent's reaches
    it, and nothing happens in it until the tests run). :meth:`take` hands it to the
    next evaluation (which then copies the artifacts and runs the tests only);
    :meth:`discard` removes it unused. Used once."""

    def __init__(self, episode: Episode) -> None:
        self.fresh = episode._fresh()  # noqa: SLF001 - the episode's own helper
        self._started = _starter().submit(
            self.fresh.reset, episode.task, workdir=episode.workdir, shell=False, image=episode.image
        )

    def take(self) -> Episode | None:
        """The started environment, or None (it failed to start: removed)."""
        if self._started.exception() is None:
            return self.fresh
        self.discard()
        return None

    def discard(self) -> None:
        self._started.exception()  # (waits)
        try:
            self.fresh.close()
        except SequesterError as exc:
            log.warning("the spare separate verifier environment was not removed completely: %s", exc)


_starters: ThreadPoolExecutor | None = None
_starters_lock = threading.Lock()


def _starter() -> ThreadPoolExecutor:
    """The threads spares start on. A sandbox dies with the *thread* that started it
    (``bwrap --die-with-parent`` is ``PR_SET_PDEATHSIG``, which follows the parent
    thread), so not a thread of its own that ends when the start is done: a pool's,
    whose threads live as long as the process."""
    global _starters
    with _starters_lock:
        if _starters is None:
            _starters = ThreadPoolExecutor(max_workers=4, thread_name_prefix="sequester-spare")
        return _starters


def _close(fresh: Episode) -> None:
    """Remove ``fresh`` once: by its timer, or at exit (which waits for a removal the timer
    began: a process that ends meanwhile would cut it short and leave the layers)."""
    with _pending_lock:
        lock = _pending.get(fresh)
    if lock is None:
        return  # (removed already)
    with lock:
        with _pending_lock:
            if fresh not in _pending:
                return
        try:
            fresh.close()
        except SequesterError as exc:
            log.warning("the separate verifier environment was not removed completely: %s", exc)
        finally:
            with _pending_lock:
                _pending.pop(fresh, None)


# The separate environments whose removal is still to come or under way, each with the lock
# its removal holds; at exit every one is removed, or its removal waited for (a timer that has
# not fired by then never will: its thread is a daemon's).
_pending: dict[Episode, threading.Lock] = {}
_pending_lock = threading.Lock()


@atexit.register
def _close_pending() -> None:
    with _pending_lock:
        waiting = list(_pending)
    for fresh in waiting:
        _close(fresh)
