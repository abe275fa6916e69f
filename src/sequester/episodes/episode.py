"""An episode: one agent working on one task, scored by a verifier it cannot reach.

    ep = Episode()
    ep.reset("examples/tasks/python-csv-stats")
    ep.exec("python3 -c 'print(1)'")
    result = ep.evaluate()          # VerifierResult, or a VerifierError
    ep.close()

The one place that orders the steps of an episode. ``reset``: load the task, plan the
agent's view (:mod:`.view`), stage the Dockerfile's files into fresh writable layers
(:mod:`.staging`), start the episode's init under bwrap, put it in a freezer, and start
the agent's shell through the namespace helper (:mod:`.nsexec`). ``evaluate``: list
visible tampering (:mod:`.tamper`), optionally freeze the agent, run the pristine tests in
a namespace only the verifier has, read the verdict strictly (:mod:`.verifier`).
``close``: kill everything, remove the layers. The source task is only ever read.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import logging
import tarfile
import os
import subprocess
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SandboxError, SequesterError
from ..guard import seccomp
from ..policy import Policy
from ..sandbox.argv import CONTAINER_CAPS, Identity, SandboxSpec
from ..sandbox.bwrap import StartedBwrap, close_fd, start_bwrap
from ..sandbox.host import HostFacts, gather_host_facts
from ..sandbox.launch import ROOT_SECRETS
from ..sandbox.mounts import SYSTEM_DIRS, MountKind, MountOp, hidden_paths
from ..sandbox.probe import namespace_support
from ..tasks import Task, load_task
from . import verifier as v
from .freezer import Freezer, make_freezer
from .nsexec import NsExec, shared_nsexec, write_and_close
from .settings import EpisodeSettings
from .shell import SHELL_SETUP, ExecResult, Shell
from .staging import stage_environment, tops_needed
from .state import EpisodeDirs, remove_stale
from .layers import report_episode, view_points
from ..verifier import ensure_runner
from .evaluation import judge, run_tests
from .separate import evaluate_separately
from .view import plan_episode_view

__all__ = ["Episode", "EpisodeError", "ExecResult"]

log = logging.getLogger("sequester.episodes")

# The episode's init: PID 1 of its namespace, which the agent cannot signal (the kernel
# ignores signals to an init that has no handler). bash reaps every orphan it adopts, so
# background processes the agent starts keep running until close() and leave no zombies.
# It says "r" on the ready pipe once bwrap has finished building the view.
_INIT = 'printf r >&"$0"; eval "exec $0>&-"; while :; do sleep 86400 & wait $!; done'
_AGENT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_READ_LIMIT = 64 * 1024 * 1024
_runner_lock = threading.Lock()
_runners: dict[Path, Path | None] = {}
_stale_cleaned: set[Path] = set()


class EpisodeError(SequesterError):
    """An episode was used out of order (exec before reset, after close, ...)."""


class _State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    CLOSED = "closed"


@dataclass
class _Running:
    task: Task
    workdir: str
    dirs: EpisodeDirs
    bwrap: StartedBwrap
    freezer: Freezer
    env: dict[str, str]
    deadline: float | None
    shell: Shell | None = None
    notes: list[str] = field(default_factory=list)
    symlinks: tuple[MountOp, ...] = ()  # the view's top-level symlinks, as made
    runner: Path | None = None  # the verifier's runner tree on the host
    view_points: frozenset = frozenset()  # where the view's own mounts are (not the agent's changes)


def _runner(folder: Path) -> Path | None:
    """The verifier's runner tree (built once per process and folder); ``None`` when it
    cannot be built: episodes still start, and their evaluations say why they cannot run."""
    with _runner_lock:
        if folder not in _runners:
            try:
                _runners[folder] = ensure_runner(folder)
            except SequesterError as exc:
                log.error("the verifier's runner could not be built in %s: %s", folder, exc)
                _runners[folder] = None
        return _runners[folder]


class Episode:
    """One agent's episode on one task (local mode: namespaces on this host). Not thread-safe;
    run many episodes in many threads."""

    def __init__(self, settings: EpisodeSettings | None = None, *, hide: Iterable[str | os.PathLike[str]] = (),
                 nsexec: NsExec | None = None):
        """``hide``: more paths the agent must not see (other tasks, the jobs folder)."""
        self.settings = settings or EpisodeSettings()
        self.extra_hidden = tuple(Path(p).resolve() for p in hide)
        self._nsexec = nsexec
        self._state = _State.NEW
        self._run: _Running | None = None
        self._aborted = threading.Event()

    # -- properties --------------------------------------------------------------------

    @property
    def task(self) -> Task:
        return self._running().task

    @property
    def instruction(self) -> str:
        return self._running().task.instruction

    @property
    def workdir(self) -> str:
        return self._running().workdir

    @property
    def notes(self) -> list[str]:
        """What of the task's environment could not be reproduced, and similar remarks."""
        return list(self._running().notes)

    @property
    def init_pid(self) -> int:
        """Host pid of the episode's init (diagnostics, tests)."""
        return self._running().bwrap.pid

    def _running(self) -> _Running:
        if self._aborted.is_set():
            raise EpisodeError("the episode was aborted")
        if self._run is None:
            raise EpisodeError("the episode is not running: call reset(task) first" if self._state is not _State.CLOSED
                               else "the episode is closed")
        return self._run

    # -- lifecycle ----------------------------------------------------------------------

    def reset(self, task: Task | str | os.PathLike[str], *, workdir: str | None = None, shell: bool = True) -> Episode:
        """Start the episode on ``task`` (a loaded task or its folder), replacing any
        earlier one. ``workdir`` overrides the task's working directory; ``shell=False``
        starts no agent shell (a separate verifier's environment)."""
        if self._state is _State.CLOSED:
            raise EpisodeError("the episode is closed")
        if not namespace_support().available:
            raise SandboxError(f"episodes need user namespaces: {namespace_support().detail}")
        self._stop()
        task = task if isinstance(task, Task) else load_task(task)
        chosen = workdir or task.config.environment.workdir or task.default_workdir or str(task.path)
        if not chosen.startswith("/"):
            raise EpisodeError(f"workdir {chosen!r} is not an absolute path")
        self._nsexec = self._nsexec or shared_nsexec()
        if self.settings.state_dir not in _stale_cleaned:
            remove_stale(self.settings.state_dir)
            _stale_cleaned.add(self.settings.state_dir)
        dirs = EpisodeDirs.create(self.settings.state_dir)
        try:
            self._run = self._start(task, chosen, dirs)
        except BaseException:
            dirs.remove()
            raise
        self._state = _State.RUNNING
        if shell:
            self._start_shell()
        return self

    def _start(self, task: Task, workdir: str, dirs: EpisodeDirs) -> _Running:
        facts = gather_host_facts()
        hidden_top, hidden_deep = self._hidden(task, facts)
        fresh = {p.name for p in hidden_top}
        for top in tops_needed(task, workdir):
            if not (Path("/") / top).is_dir() or (Path("/") / top).is_symlink():
                fresh.add(top)
        notes = [f"{u.instruction} at {task.dockerfile.source}:{u.line} not applied: {u.reason}"
                 for u in (task.dockerfile.unsupported if task.dockerfile else ())]
        if task.config.environment.effective_network_mode != "no-network":
            notes.append("the task asks for network access; local episodes have none")
        runner = _runner(self.settings.toolchain_dir)
        # Without a WORKDIR the agent works at the task's own path: an empty writable folder
        # there, instead of the read-only one that hides the task.
        scratch = (Path(workdir),) if workdir == str(task.path) else ()
        hidden_deep = [(p, d) for p, d in hidden_deep if p not in scratch]
        mounts = plan_episode_view(facts, dirs, hidden_top=hidden_top, hidden=hidden_deep, new_tops=fresh,
                                   toolchain=runner, scratch=scratch)
        for op in mounts:
            for folder in (op.upper, op.work, op.source if op.kind.value == "bind" else None):
                if folder is not None:
                    folder.mkdir(parents=True, exist_ok=True)
        notes += stage_environment(task, dirs, fresh, workdir)
        if workdir == str(task.path):
            notes.append("no WORKDIR: the agent works in an empty folder at the task's path")
        env = {"PATH": _AGENT_PATH, "HOME": "/root", "LANG": "C.UTF-8", "TERM": "xterm", "PWD": workdir,
               **(task.dockerfile.env_map if task.dockerfile else {})}
        spec = SandboxSpec(
            mounts=mounts, command=("/bin/bash", "--noprofile", "--norc", "-c", _INIT), env={"PATH": _AGENT_PATH},
            cwd=Path("/"), identity=Identity.ROOT, caps=CONTAINER_CAPS, hostname=task.name[:63] or "sequester",
            as_pid_1=True, readonly_root=False,
        )
        ready_r, ready_w = os.pipe()
        # The init (and so every agent process) must hold nothing of the host's: not its
        # stdout or stderr, which would let `echo ... > /proc/1/fd/1` forge the operator's
        # output or truncate its log. bwrap's own error messages go to a pipe read until
        # the view is up; after that, writes to it fail.
        err_r, err_w = os.pipe()
        os.set_inheritable(err_r, False)
        try:
            spec = dataclasses.replace(spec, command=(*spec.command, str(ready_w)))
            started = start_bwrap(spec, data_files={}, keep_fds=[ready_w], stdout=subprocess.DEVNULL, stderr=err_w,
                                  stderr_reader=err_r)
        except BaseException:
            close_fd(err_r)
            raise
        finally:
            close_fd(ready_w)
            close_fd(err_w)
        try:
            if not _wait_readable(ready_r, 30) or os.read(ready_r, 1) != b"r":
                said = _pending(err_r).decode(errors="replace").strip()
                raise SandboxError(f"the episode's sandbox did not come up: {said or 'bwrap failed to build the view'}")
            freezer = make_freezer(started.pid)
        except BaseException:
            started.kill()
            raise
        finally:
            close_fd(ready_r)
            close_fd(err_r)
        timeout = task.config.agent.timeout_sec
        return _Running(task, workdir, dirs, started, freezer, env,
                        time.monotonic() + timeout if timeout else None, notes=notes,
                        symlinks=tuple(op for op in mounts if op.kind is MountKind.SYMLINK), runner=runner,
                        view_points=view_points(op.dest for op in mounts))

    def _hidden(self, task: Task, facts: HostFacts) -> tuple[set[Path], list[tuple[Path, bool]]]:
        """Top-level folders to give fresh, and deeper paths to cover.

        Whoever the caller, an agent's world is the operating system's folders (root's
        rule, :data:`SYSTEM_DIRS`) plus fresh ones: other users' and other programs' data
        (``/home``, ``/srv``, ``/mnt``, ...) is not part of a task's environment. Below
        those, the caller's own hidden paths (its home and folders, for an ordinary user).
        """
        dirs, files = hidden_paths(Policy(), facts)
        top = {e.path for e in facts.entries
               if e.path.parent == Path("/") and not e.is_symlink and e.path.name not in SYSTEM_DIRS}
        deep = [*dirs, *files, task.path.resolve(), self.settings.state_dir, *self.extra_hidden]
        if facts.is_root:
            deep += ROOT_SECRETS
        found: list[tuple[Path, bool]] = []
        for path in dict.fromkeys(deep):
            if len(path.parts) > 2 and (path.exists() or path.is_symlink()):
                found.append((path, path.is_dir() and not path.is_symlink()))
        return top, found

    def _start_shell(self) -> None:
        run = self._running()
        if run.shell is not None:
            run.shell.close()
            run.shell = None
        master, slave = Shell.make_pty()
        control_r, control_w = os.pipe()
        out_r, out_w = os.pipe()
        for fd in (master, control_w, out_r):
            os.set_inheritable(fd, False)
        try:
            assert self._nsexec is not None
            pid = self._nsexec.spawn(
                run.bwrap.pid, ["bash", "--noprofile", "--norc", "/dev/fd/3"], env=run.env, cwd=run.workdir,
                stdin=slave, stdout=out_w, stderr=slave, extra=[control_r], ctty=True, caps=CONTAINER_CAPS,
                seccomp_bpf=seccomp.compile_filter("agent"), seccomp_nr=seccomp.syscall_number("seccomp"),
                cgroup=run.freezer.procs_path,
            )
        except BaseException:
            for fd in (master, control_w, out_r):
                close_fd(fd)
            raise
        finally:
            for fd in (slave, control_r, out_w):
                close_fd(fd)
        run.shell = Shell(pid, control_w, out_r, master)
        try:
            os.write(control_w, SHELL_SETUP.encode())
        except OSError:
            run.shell.alive = False

    def exec(self, command: str, timeout: float | None = None) -> ExecResult:
        """Run ``command`` in the agent's persistent shell (cwd and exports persist).

        ``timeout`` defaults to the settings' ``exec_timeout``; the task's ``[agent]
        timeout_sec`` bounds the whole episode. A command that runs over is interrupted
        (^C), then killed; background processes keep running.
        """
        run = self._running()
        limit = self.settings.exec_timeout if timeout is None else timeout
        if limit <= 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        if run.deadline is not None:
            left = run.deadline - time.monotonic()
            if left <= 0:
                return ExecResult("", "", None, True, 0.0, "the episode's agent time ([agent] timeout_sec) is over")
            limit = min(limit, left)
        if run.shell is None or not run.shell.alive:
            self._start_shell()
            run.notes.append("the agent's shell exited and was restarted (cwd and variables were reset)")
        assert run.shell is not None
        result = run.shell.run(command, limit, self.settings.output_bytes)
        if not run.shell.alive:
            self._start_shell()
        return result

    def write_file(self, path: str, content: bytes | str, mode: int = 0o644) -> None:
        """Write a file in the agent's view (as its root), creating parent folders."""
        data = content.encode() if isinstance(content, str) else content
        self._nsexec_call().write_file(self._running().bwrap.pid, self._absolute(path), data, mode=mode)

    def read_file(self, path: str) -> bytes:
        return self._nsexec_call().read_file(self._running().bwrap.pid, self._absolute(path), limit=_READ_LIMIT)

    def upload_dir(self, source: str | os.PathLike[str], dest: str) -> None:
        """Copy a host folder into the agent's view at ``dest`` (the oracle's solution)."""
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(Path(source).resolve(), arcname=".")
        self._nsexec_call().extract(self._running().bwrap.pid, self._absolute(dest), buf.getvalue())

    def _nsexec_call(self) -> NsExec:
        self._running()
        assert self._nsexec is not None
        return self._nsexec

    def _absolute(self, path: str) -> str:
        return path if path.startswith("/") else f"{self.workdir.rstrip('/')}/{path}"

    # -- evaluation --------------------------------------------------------------------

    def tampering(self) -> list[str]:
        """Every change the agent's layers hold in the folders a verifier on the agent's
        system would have trusted (see :mod:`.layers`): information only, bounded, and it
        never raises for anything the agent left."""
        run = self._running()
        return report_episode(run.dirs, known=run.view_points) + self._top_level_changes(run)

    def _top_level_changes(self, run: _Running) -> list[str]:
        """The view's root is a tmpfs of the sandbox's own (not on the host's disk): look
        through the init's root from the host (``readlink`` follows nothing) whether the
        agent replaced one of its symlinks (``/bin`` -> ``usr/bin``)."""
        found = []
        for op in run.symlinks:
            try:
                target = os.readlink(f"/proc/{run.bwrap.pid}/root/{op.dest.name}")
            except OSError:
                target = None
            if target != op.target:
                found.append(f"replaced /{op.dest.name} (a symlink to {op.target}) at the top of the tree")
        return found

    def evaluate(self, *, freeze: bool | None = None, verifier_env: str | None = None) -> v.VerifierResult:
        """Run the task's pristine tests where only the verifier sees them, through the
        runner the agent cannot write (:mod:`sequester.verifier`); read the verdict.

        ``freeze`` (default: the task's ``[verifier] freeze_agent``, else the settings)
        stops every agent process first, before anything of the evaluation happens.
        ``verifier_env`` (default: the settings, else the task's ``[verifier]
        environment_mode``, else ``"shared"``): ``"separate"`` runs the tests in a fresh
        view of the task's pristine environment holding only the task's ``artifacts``
        from the agent's final state (see :mod:`.separate`).
        Returns a :class:`VerifierResult` (a 0 with ``zero_reason`` when the agent made
        the tests end without a valid reward); raises :class:`VerifierCouldNotRun` only
        for what the agent cannot cause (see :mod:`.evaluation`).
        """
        run = self._running()
        task = run.task
        wanted = freeze if freeze is not None else (
            task.config.verifier.freeze_agent if task.config.verifier.freeze_agent is not None
            else self.settings.freeze_agent)
        mode = verifier_env or self.settings.verifier_env or task.config.verifier.environment_mode or "shared"
        if mode not in ("shared", "separate"):
            raise ValueError(f"verifier_env: {mode!r} is not 'shared' or 'separate'")
        assert self._nsexec is not None
        notes: tuple[str, ...] = ()
        frozen = None
        if wanted:  # first: nothing of the evaluation happens while an agent process runs
            outcome = run.freezer.freeze()
            frozen, notes = outcome.method, (outcome.note,)
        try:
            if mode == "separate":
                ev, more = evaluate_separately(self, run.bwrap.pid)
                notes += more
            else:
                ev = run_tests(self._nsexec, task, init_pid=run.bwrap.pid, workdir=run.workdir, runner=run.runner,
                               output_limit=self.settings.output_bytes)
        finally:
            if wanted:
                run.freezer.thaw()
                if not outcome.held and run.shell is not None:
                    run.shell.alive = False  # its processes were killed: the next exec starts a new one
        # Information only, and only once the verdict is in: nothing of it decides the
        # reward, and the agent learns of the evaluation from nothing done before it.
        findings = tuple(self.tampering())
        return judge(task, ev, tampering=findings, frozen=frozen, notes=notes)

    # -- teardown ------------------------------------------------------------------------

    def _stop(self) -> None:
        run, self._run = self._run, None
        if run is None:
            return
        errors = []
        for step in (run.freezer.thaw, (run.shell.close if run.shell else None), run.bwrap.kill, run.freezer.remove,
                     run.dirs.remove):
            if step is None:
                continue
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - keep tearing down; report at the end
                errors.append(f"{getattr(step, '__qualname__', step)}: {exc}")
        if errors:
            raise SandboxError("the episode was not cleaned up completely: " + "; ".join(errors))

    def abort(self) -> None:
        """From any thread: kill every process of the episode now (a command in flight
        ends at once). Every later use raises :class:`EpisodeError`; :meth:`close` still
        has to be called to clean up."""
        self._aborted.set()
        run = self._run
        if run is not None:
            run.bwrap.signal_init()

    def close(self) -> None:
        """Kill every process of the episode and remove its layers. Idempotent."""
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        self._stop()

    def __enter__(self) -> Episode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _wait_readable(fd: int, timeout: float) -> bool:
    import select

    return bool(select.select([fd], [], [], timeout)[0])


def _pending(fd: int, limit: int = 4096) -> bytes:
    os.set_blocking(fd, False)
    try:
        return os.read(fd, limit)
    except OSError:
        return b""
