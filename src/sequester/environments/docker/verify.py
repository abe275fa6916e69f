"""Scoring a Docker-API episode: the task's pristine tests, streamed from the host, run in
a container, their verdict read strictly. Written against :class:`ContainerOps` (a few
calls on one container), so that every failure can be injected in unit tests.

Separate mode (the default): a FRESH container from the agent's image id (the task's
pristine system), holding only the task's declared ``artifacts`` copied from the agent's
container, runs the tests; nothing of the agent's runs there, and the container is
removed whatever happens.

Shared mode (tasks scored on live services the agent started): the tests run in the
agent's own container. ``/tests`` and ``/logs/verifier`` are wiped and the wipe is
checked *before* the pristine tests go in (attack: a planted ``/tests/test.sh`` or
``reward.txt`` mixed into the verdict); after scoring they are wiped and checked again
(attack: the agent reading the tests once the verdict is in).

Residual risk of shared mode (said here because no check closes it): the agent's
processes, binaries, libraries and interpreter are what runs the tests. There is no
trusted runner inside a container image (``Capabilities.trusted_runner = False``): the
image's ``bash`` and ``python3`` are whatever the agent left at those paths, its live
processes (unless frozen) can read ``/tests`` while they run and write
``/logs/verifier``, and even the wipe checks run the container's ``sh``. A task that
needs a verdict the agent cannot forge must use separate mode.

Who is to blame (trainers drop errored trials, so nothing the agent can do may turn its
trial into an error): a timeout, a missing or invalid reward, a wipe of ``/tests`` that
does not take (the agent's container is the agent's: an immutable file, a process that
re-creates the folder, a replaced ``rm``) are the agent's 0 with ``zero_reason``; only a
failing engine (:class:`~.engine.EngineError`) raises ``VerifierCouldNotRun``. A wipe
after scoring that does not take leaves the verdict as it is, with a note, and fails
closed: the agent's container is killed (:meth:`ContainerOps.discard`), so nothing of
the agent's runs again beside the tests.
"""

from __future__ import annotations

import base64
import dataclasses
import fnmatch
import io
import logging
import posixpath
import tarfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from sequester.environments import verdict
from sequester.environments.base import separate_artifacts
from sequester.environments.docker.engine import EngineError
from sequester.environments.docker.files import ContainerFileError, dir_tar
from sequester.environments.verdict import Evaluation, judge, zero_result
from sequester.tasks import Task
from sequester.tasks.task_toml import Artifact
from sequester.verifier.invocation import tests_archive

__all__ = [
    "ContainerOps",
    "Verdict",
    "ARTIFACT_LIMIT",
    "docker_verifier_argv",
    "docker_verifier_env",
    "evaluate_shared",
    "evaluate_separate",
    "pack_artifacts",
    "wipe_staged",
    "NOT_WIPED",
]

log = logging.getLogger("sequester.environments.docker")

ARTIFACT_LIMIT = 256 << 20  # all artifacts together: the tars are held in the host's memory
REWARD_LIMIT = 1 << 20
WIPE_TIMEOUT = 60.0
VERIFIER_PATHS = ("/tests", "/logs/verifier")
# Exit 0 only when neither path exists, not even as a dangling link (a link at /tests
# would send the pristine tests wherever the agent pointed it).
_GONE = 'for p in "$@"; do if [ -e "$p" ] || [ -L "$p" ]; then exit 1; fi; done'
# The wipe and its check in one exec (each exec costs ~0.1 s on podman): exit 0 only when
# every path is gone afterwards, whatever rm said.
WIPE = 'rm -rf -- "$@"; ' + _GONE


class ContainerOps(Protocol):
    """The calls scoring makes on one container; each raises :class:`EngineError` when
    the engine fails (never for what the container's programs do)."""

    def exec(
        self, argv: list[str], timeout: float, *, env: Mapping[str, str] | None = None, workdir: str | None = None
    ) -> tuple[int | None, bytes, bool]:
        """Run ``argv`` under a host-enforced ``timeout``: (exit code, stdout + stderr, timed out)."""

    def put_tar(self, path: str, data: bytes) -> None:
        """Extract the tar ``data`` at the existing folder ``path``."""

    def get_tar(self, path: str, limit: int) -> bytes | None:
        """The engine's tar of ``path`` (None: it does not exist); ``ContainerFileError`` past ``limit``."""

    def read_file(self, path: str, limit: int) -> bytes | None:
        """The regular file at ``path``, or None (missing, not a file); ``ContainerFileError`` past ``limit``."""

    def remove(self, paths: Sequence[str]) -> bool:
        """``rm -rf`` the paths; whether none of them exists afterwards (not even as a link)."""

    def discard(self) -> None:
        """Finish with the container: the verifier's is removed, the agent's killed."""


@dataclass(frozen=True)
class Verdict:
    """A scoring's result; ``clean``: nothing of the tests is left where the agent is."""

    result: verdict.VerifierResult
    clean: bool = True
    staged: bool = False  # the tests are still in the agent's container (``wipe_after=False``)


def docker_verifier_argv(task: Task) -> list[str]:
    """The task's ``test.sh`` run by the image's own bash; without one, the image's
    ``python3 -m pytest`` on the tests, 0/1 by its exit status (anything else: no verdict)."""
    if task.test_script is not None:
        return ["bash", "/tests/test.sh"]
    # -I: not the working directory (the agent's copied work: an /app/pytest.py would
    # be imported as pytest) nor PYTHON* variables on the path.
    script = (
        "python3 -I -m pytest /tests -rA\nrc=$?\n"
        "case $rc in 0) echo 1 > /logs/verifier/reward.txt;; 1) echo 0 > /logs/verifier/reward.txt;;"
        ' *) echo "sequester: pytest could not run the tests (exit $rc)" >&2;; esac\n'
    )
    return ["/bin/sh", "-c", script]


def docker_verifier_env(task: Task) -> dict[str, str]:
    """The exec's variables on top of the container's (the image's ENV, set at its
    creation, which the agent cannot change): the task's ``[verifier] env``. Not
    :func:`~sequester.verifier.invocation.verifier_env`: its paths are the trusted runner's,
    which no container image has."""
    return {"HOME": "/root", "LANG": "C.UTF-8", "TERM": "dumb", **task.config.verifier.env}


def _wipe(ops: ContainerOps, paths: Sequence[str]) -> bool:
    return ops.remove(paths)


def _score(
    ops: ContainerOps,
    task: Task,
    *,
    workdir: str,
    output_limit: int,
    reward_range: tuple[float, float] | None,
    frozen: str | None,
    notes: tuple[str, ...],
) -> verdict.VerifierResult:
    """Stage the pristine tests, run them, judge what they left (see :func:`judge`)."""
    ops.put_tar("/", dir_tar(list(VERIFIER_PATHS)))
    ops.put_tar("/tests", tests_archive(task))
    started = time.monotonic()
    code, output, timed_out = ops.exec(
        docker_verifier_argv(task), task.config.verifier.timeout_sec, env=docker_verifier_env(task), workdir=workdir
    )
    duration = time.monotonic() - started
    report: dict | None = None
    if not timed_out:
        files, more = {}, []
        for name in ("reward.json", "reward.txt"):
            try:
                data = ops.read_file(f"/logs/verifier/{name}", REWARD_LIMIT)
            except ContainerFileError as exc:  # the tests' programs made it huge: no verdict
                more.append(f"/logs/verifier/{name} was not read: {exc}")
                data = b"\0 too large"  # not a number: parse_rewards makes it invalid, the agent's 0
            if data is not None:
                files[name] = base64.b64encode(data).decode()
        report = {"exit_code": code, "files": files, "notes": more}
    ev = Evaluation(report, output[:output_limit], (), duration)
    return judge(task, ev, tampering=(), frozen=frozen, notes=notes, reward_range=reward_range)


def _could_not_run(exc: EngineError) -> verdict.VerifierCouldNotRun:
    return verdict.VerifierCouldNotRun(f"the verifier could not run: {exc}")


def evaluate_shared(
    ops: ContainerOps,
    task: Task,
    *,
    workdir: str,
    output_limit: int,
    reward_range: tuple[float, float] | None = verdict.DEFAULT_REWARD_RANGE,
    frozen: str | None = None,
    notes: tuple[str, ...] = (),
    start_verifier: Callable[[], ContainerOps] | None = None,
    wipe_after: bool = True,
) -> Verdict:
    """The tests in the agent's own container (see the module for what this trusts).

    ``start_verifier`` (a fresh container of the pristine image) decides whom to blame
    when the engine fails a request in the agent's container: the agent can make its
    container refuse one (a file where a folder is staged, at the right moment). If the
    same tests run in the pristine container without engine failure, the failure was the
    agent's doing and is its 0; else it is :class:`VerifierCouldNotRun` (as the local
    backend decides: :meth:`sequester.environments.local.episode.Episode.evaluate`).

    ``wipe_after=False``: the tests are left in place (``Verdict.staged``) for the caller
    to wipe with :func:`wipe_staged` before the agent acts again, or never if the
    container is removed first (see :meth:`DockerEnvironment.evaluate` for when that is
    safe)."""
    notes = (*notes, "the verifier ran in the agent's container (shared mode: the agent's programs ran the tests)")
    empty = Evaluation({}, b"", (), 0.0)
    failure: EngineError | None = None
    try:
        if not _wipe(ops, VERIFIER_PATHS):
            return Verdict(
                zero_result(
                    empty,
                    "/tests or /logs/verifier could not be removed from the agent's container before the tests "
                    "went in (the agent's doing: the pristine tests are not mixed with what it left)",
                    tampering=(),
                    frozen=frozen,
                    notes=notes,
                )
            )
    except EngineError as exc:
        return Verdict(_blame(exc, task, start_verifier, workdir=workdir, frozen=frozen, notes=notes))
    clean, result = False, None
    try:
        result = _score(
            ops, task, workdir=workdir, output_limit=output_limit, reward_range=reward_range, frozen=frozen, notes=notes
        )
    except EngineError as exc:
        failure = exc
    finally:
        clean = wipe_staged(ops) if wipe_after or failure is not None else True
    if failure is not None:
        result = _blame(failure, task, start_verifier, workdir=workdir, frozen=frozen, notes=notes)
    assert result is not None
    if not clean:
        result = dataclasses.replace(result, notes=(*result.notes, NOT_WIPED))
    return Verdict(result, clean, staged=not wipe_after and failure is None)


NOT_WIPED = (
    "/tests or /logs/verifier could not be removed from the agent's container after scoring: the "
    "container was killed so that nothing of the agent's can read them"
)


def wipe_staged(ops: ContainerOps) -> bool:
    """Remove the staged tests and the verifier's logs from the agent's container; if that
    does not take (or the engine fails), kill the container (fail closed: the tests may
    still be where the agent is, so it runs no more). Whether the wipe took."""
    clean = False
    try:
        clean = _wipe(ops, VERIFIER_PATHS)
    except EngineError as exc:
        log.warning("the tests could not be removed from the agent's container: %s", exc)
    if not clean:
        try:
            ops.discard()
        except EngineError as exc:
            log.error("the agent's container still holds the tests and could not be killed: %s", exc)
    return clean


def _blame(
    failure: EngineError,
    task: Task,
    start_verifier: Callable[[], ContainerOps] | None,
    *,
    workdir: str,
    frozen: str | None,
    notes: tuple[str, ...],
) -> verdict.VerifierResult:
    """The agent's 0 for an engine failure in its container, if the pristine container
    runs the same tests without one; else :class:`VerifierCouldNotRun` (see above)."""
    if start_verifier is None:
        raise _could_not_run(failure)
    try:
        evaluate_separate(None, start_verifier, task, workdir=workdir, output_limit=4096, with_artifacts=False)
    except verdict.VerifierCouldNotRun:
        raise _could_not_run(failure) from None
    return zero_result(
        Evaluation({}, b"", (), 0.0),
        f"the engine failed a request in the agent's container ({failure}), but not in the task's "
        "pristine container: the agent's container did this",
        tampering=(),
        frozen=frozen,
        notes=notes,
    )


def pack_artifacts(
    ops: ContainerOps, artifacts: Sequence[Artifact], limit: int = ARTIFACT_LIMIT
) -> tuple[list[tuple[str, bytes]], list[str]]:
    """Each artifact of the agent's container as (the folder to extract it at, a tar of
    only folders, files and links, minus its ``exclude`` patterns); notes on those left
    out. All together at most ``limit`` bytes."""
    packed, notes, used = [], [], 0
    for artifact in artifacts:
        try:
            data = ops.get_tar(artifact.source, limit - used)
        except ContainerFileError as exc:  # the agent's content: its loss, never an error
            notes.append(f"artifact {artifact.source} was not copied: {exc}")
            continue
        if data is None:
            notes.append(f"artifact {artifact.source} does not exist in the agent's environment")
            continue
        try:
            tar = _filtered(data, artifact.exclude)
        except (tarfile.TarError, EOFError, OSError) as exc:
            # The agent changed the files while the engine packed them (a file growing or
            # shrinking: the engine's archive ends early): its loss, never an error.
            notes.append(f"artifact {artifact.source} was not copied: it changed while it was copied ({exc})")
            continue
        used += len(tar)
        packed.append((posixpath.dirname(artifact.source.rstrip("/")) or "/", tar))
    return packed, notes


def _filtered(data: bytes, exclude: Sequence[str]) -> bytes:
    """The engine's tar re-packed with folders, files and links only (no devices, fifos
    or hard links into the verifier's container), no set-id bits, no member below a link
    (attack: ``out -> /usr/bin`` then ``out/python3`` overwriting the verifier's tools),
    and nothing matching ``exclude`` (relative to the artifact, or its full name)."""
    out = io.BytesIO()
    links: set[str] = set()
    with (
        tarfile.open(fileobj=io.BytesIO(data), mode="r:") as src,
        tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as dst,
    ):
        for member in src:
            name = member.name.strip("/")
            parts = name.split("/")
            rel = name.split("/", 1)[-1]
            if not (member.isreg() or member.isdir() or member.issym()) or ".." in parts:
                continue
            # Below a link kept earlier? One set lookup per folder of the name (a scan of
            # every link for every member was quadratic: an agent's 100,000 links).
            if any("/".join(parts[:i]) in links for i in range(1, len(parts))):
                continue
            if any(fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(name, p) for p in exclude):
                continue
            if member.issym():
                links.add(name)
            member.mode &= 0o1777
            dst.addfile(member, src.extractfile(member) if member.isreg() else None)
    return out.getvalue()


_PARENT = 'mkdir -p -- "$1" && [ "$(cd -- "$1" && pwd -P)" = "$1" ]'


def evaluate_separate(
    agent: ContainerOps | None,
    start_verifier: Callable[[], ContainerOps],
    task: Task,
    *,
    workdir: str,
    output_limit: int,
    reward_range: tuple[float, float] | None = verdict.DEFAULT_REWARD_RANGE,
    frozen: str | None = None,
    notes: tuple[str, ...] = (),
    artifact_limit: int = ARTIFACT_LIMIT,
    with_artifacts: bool = True,
) -> Verdict:
    """The tests in a fresh container from the pristine image plus the artifacts copied
    from ``agent`` (``with_artifacts=False``: none, nothing of the agent's at all)."""
    notes = (*notes, "the verifier ran in a separate container (the task's pristine image plus its artifacts)")
    packed: list[tuple[str, bytes]] = []
    more: list[str] = []
    artifacts, said = separate_artifacts(task, workdir) if with_artifacts else ((), None)
    more += [said] if said else []
    try:
        if artifacts and agent is not None:
            packed, found = pack_artifacts(agent, artifacts, artifact_limit)
            more += found
    except EngineError as exc:
        raise _could_not_run(exc) from exc
    try:
        verifier = start_verifier()
    except EngineError as exc:
        raise _could_not_run(exc) from exc
    try:
        for parent, tar in packed:
            # Attack: a parent that resolves through a link an earlier artifact made (the
            # pristine image's own tools check it: nothing of the agent's runs here yet).
            # "/" (a task's working directory as its artifact) needs neither: saves an exec.
            code = 0 if parent == "/" else verifier.exec(["/bin/sh", "-c", _PARENT, "sh", parent], WIPE_TIMEOUT)[0]
            if code != 0:
                more.append(f"an artifact below {parent} was not copied: that folder is not a plain folder there")
                continue
            try:
                verifier.put_tar(parent, tar)
            except EngineError as exc:  # the agent's content the engine would not take: its loss
                more.append(f"an artifact below {parent} was not copied: {exc}")
        return Verdict(
            _score(
                verifier,
                task,
                workdir=workdir,
                output_limit=output_limit,
                reward_range=reward_range,
                frozen=frozen,
                notes=(*notes, *more),
            )
        )
    except EngineError as exc:
        raise _could_not_run(exc) from exc
    finally:
        try:
            verifier.discard()
        except EngineError as exc:  # the next start's reaper removes it when this process is gone
            log.warning("the verifier's container was not removed: %s", exc)
