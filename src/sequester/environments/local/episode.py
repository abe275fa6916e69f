"""An episode: one agent working on one task, scored by a verifier it cannot reach.

    ep = Episode()
    ep.reset("examples/tasks/python-csv-stats")
    ep.exec("python3 -c 'print(1)'")
    result = ep.evaluate()          # VerifierResult, or a VerifierError
    ep.close()

The one place that orders the steps of an episode. ``reset``: load the task, start its
sandbox (:mod:`.start`: the view, the environment's files, the init, its freezer), and
start the agent's shell through the namespace helper (:mod:`sequester.sandbox.nsexec`). ``evaluate``:
freeze the agent if asked, first; run the pristine tests in a namespace only the verifier
has, through the runner the agent cannot write, in the agent's view or a separate one
(:mod:`.evaluation`, :mod:`.separate`); then list the tampering, for information
(:mod:`.layers`). ``close``: kill everything, remove the layers. The source task is only
ever read.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import logging
import os
import secrets
import shlex
import tarfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from sequester.environments import verdict
from sequester.environments.archive import DIR_LIMIT, reroot
from sequester.environments.base import (
    Capabilities,
    ExecResult,
    UnsupportedByBackend,
    missing_capabilities,
    timed_task,
    wanted_verifier_env,
    wants_freeze,
)
from sequester.environments.local import checkpoint as checkpoints
from sequester.environments.local.checkpoint import Checkpoint, CheckpointError
from sequester.environments.local.evaluation import run_tests
from sequester.environments.local.layers import report_episode, view_points
from sequester.environments.local.process import run_process
from sequester.environments.local.separate import Spare, evaluate_separately
from sequester.environments.local.shell import SHELL_SETUP, Shell
from sequester.environments.local.start import RunningEpisode
from sequester.environments.local.system import start_system
from sequester.environments.local.tamper import printable
from sequester.environments.settings import EpisodeSettings, episode_image_store
from sequester.environments.verdict import frozen_evaluation_note, judge, runner_works, zero_result
from sequester.errors import EpisodeError, SandboxError
from sequester.guard import seccomp
from sequester.imagebuild.apt_install import unpacked_paths
from sequester.imagebuild.task_build import ensure_built
from sequester.images import ImageRecord
from sequester.images.choose import Choice, choose_image
from sequester.images.stack import image_path_kind
from sequester.net.episode.layout import resolv_conf
from sequester.net.episode.policy import EpisodePolicy, episode_policy, parse_operator_hosts
from sequester.net.episode.session import EpisodeNetwork, Preparing, network_unavailable, stack_host_id
from sequester.net.episode.upstream import Upstream, parse_server
from sequester.sandbox.argv import CONTAINER_RLIMITS
from sequester.sandbox.bwrap import close_fd
from sequester.sandbox.fdlimit import ensure_room
from sequester.sandbox.gpus import available_gpus
from sequester.sandbox.hostlimits import check_pty_room
from sequester.sandbox.nsexec.client import NsExec, shared_nsexec
from sequester.sandbox.probe import namespace_support
from sequester.sandbox.procs import pid_namespace
from sequester.tasks import Task, load_task
from sequester.verifier.image_python import ImagePython

__all__ = ["Episode", "EpisodeError", "ExecResult", "local_capabilities"]

log = logging.getLogger("sequester.environments.local")

_READ_LIMIT = 64 * 1024 * 1024
_CHOOSE = object()  # reset(): choose the image from the task and the image source
_ENDED = "exited (or did not end a timed-out command) and was restarted (its state was reset)"
# The descriptors one episode may hold at once in the process that runs it (counted in
# docs/running-tasks.md): 6 while its agent thinks, 17 with a network, one more on an image,
# about 26 at most while it starts, runs a command or evaluates. reset() makes sure of room
# for one more, and as much again for the caller's own work, before it starts anything.
EPISODE_DESCRIPTORS = 32


class _State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    CLOSED = "closed"


# The tests run by the runner tree the agent cannot write, in the agent's view or a fresh
# one; the agent can be frozen (cgroup freezer, else signals); the task's network, narrowed
# by the operator's (sequester.net.episode).
LOCAL_CAPABILITIES = Capabilities(
    backend="local",
    separate_verifier=True,
    shared_verifier=True,
    freeze=True,
    trusted_runner=True,
    network_policies=frozenset({"none", "public", "allowlist"}),
    checkpoint=True,
)


def local_capabilities() -> Capabilities:
    """:data:`LOCAL_CAPABILITIES` with the GPUs this host has (:mod:`sequester.sandbox.gpus`)."""
    count, source = available_gpus()
    return dataclasses.replace(LOCAL_CAPABILITIES, gpus=count, gpu_source=source)


def _nothing() -> None:
    pass


class Episode:
    """One agent's episode on one task (local mode: namespaces on this host). Not thread-safe;
    run many episodes in many threads."""

    def __init__(
        self,
        settings: EpisodeSettings | None = None,
        *,
        hide: Iterable[str | os.PathLike[str]] = (),
        nsexec: NsExec | None = None,
    ):
        """``hide``: more paths the agent must not see (other tasks, the jobs folder)."""
        self.settings = settings or EpisodeSettings()
        self.extra_hidden = tuple(Path(p).resolve() for p in hide)
        self._nsexec = nsexec
        self._state = _State.NEW
        self._run: RunningEpisode | None = None
        self._aborted = threading.Event()
        self._verifier_only = False  # a separate verifier's environment: never the agent's hosts
        # A separate or pristine verifier's environment: the tests' installs as the agent's
        # episode had them (decided once per trial: never a second, different answer).
        self._installs_of: RunningEpisode | None = None
        self._spare: Spare | None = None  # a separate verifier's environment, started ahead
        self._network_record: dict[str, object] | None = None

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

    @property
    def capabilities(self) -> Capabilities:
        """What the local backend can do here (see :mod:`sequester.environments.base`)."""
        return local_capabilities()

    def start(self, task: Task | str | os.PathLike[str], *, image: Choice | None = None) -> Episode:
        """:meth:`reset` on ``task``, as :class:`~sequester.environments.base.Environment`
        names it; ``image``: the system chosen for it (else chosen here)."""
        return self.reset(task, choice=image)

    def _running(self) -> RunningEpisode:
        if self._aborted.is_set():
            raise EpisodeError("the episode was aborted")
        if self._run is None:
            raise EpisodeError(
                "the episode is not running: call reset(task) first"
                if self._state is not _State.CLOSED
                else "the episode is closed"
            )
        return self._run

    # -- lifecycle ----------------------------------------------------------------------

    def reset(
        self,
        task: Task | str | os.PathLike[str],
        *,
        workdir: str | None = None,
        shell: bool = True,
        image_source: str | None = None,
        image: ImageRecord | None | object = _CHOOSE,
        choice: Choice | None = None,
    ) -> Episode:
        """Start the episode on ``task`` (a loaded task or its folder), replacing any
        earlier one. ``workdir`` overrides the task's working directory; ``shell=False``
        starts no agent shell (a separate verifier's environment). ``image_source``
        (default: the settings' ``[images] source``, ``auto``): the system the episode
        runs on (see :mod:`sequester.images.choose`); ``image``: this image record, or
        ``None`` for host mode, instead of choosing; ``choice``: a choice already made
        (a job's, with its notes). An image that cannot be had raises
        :class:`~sequester.errors.ImageError` before anything starts; so does a process
        whose open-file limit cannot hold another episode, :class:`SandboxError` (the
        soft limit is raised first: :mod:`sequester.sandbox.fdlimit`), or a machine whose
        ptys are all in use (``kernel.pty.max``); one that cannot make another namespace or
        process fails naming the limit it hit (:mod:`sequester.sandbox.hostlimits`)."""
        return self._begin(
            task, workdir=workdir, shell=shell, image_source=image_source, image=image, choice=choice, resume=None
        )

    def _begin(
        self,
        task: Task | str | os.PathLike[str],
        *,
        workdir: str | None,
        shell: bool,
        image_source: str | None,
        image: ImageRecord | None | object,
        choice: Choice | None,
        resume: Checkpoint | None,
    ) -> Episode:
        """:meth:`reset`, or with ``resume`` a start on a checkpoint's layers, in its
        shell's working directory and with its exported variables."""
        if self._state is _State.CLOSED:
            raise EpisodeError("the episode is closed")
        if not namespace_support().available:
            raise SandboxError(f"episodes need user namespaces: {namespace_support().detail}")
        self._stop()
        ensure_room(2 * EPISODE_DESCRIPTORS, "another episode")
        if shell:
            check_pty_room("another episode")  # its shell's terminal (sequester.sandbox.hostlimits)
        task = task if isinstance(task, Task) else load_task(task)
        if shell and resume is None:  # (a separate verifier's environment, a checkpoint: already timed)
            task = timed_task(task, self.settings)
        # What the task needs of this backend and host (GPUs, Compose services), before
        # anything is chosen, fetched, built or started.
        missing = missing_capabilities(self.capabilities, task, self.settings)
        if missing:
            raise UnsupportedByBackend("; ".join(missing))
        if choice is not None:
            pass
        elif image is _CHOOSE:
            store = episode_image_store(self.settings)
            choice = choose_image(
                task,
                image_source or self.settings.images.source,
                store,
                build=lambda t: ensure_built(t, store, self.settings),
            )
        else:
            choice = Choice(image, "image" if image is not None else "host")  # type: ignore[arg-type]
        self._nsexec = self._nsexec or shared_nsexec()
        policy = self.network_policy(task)  # (a task's bad allowed_hosts fails before anything starts)
        wanted = policy.has_network and network_unavailable() is None
        # A root caller's router and stack are made while the sandbox starts (half the cost).
        early = Preparing(self._nsexec, policy) if wanted and stack_host_id() is not None else None
        above = resume.layers if resume is not None else ()
        if resume is not None:
            checkpoints.hold_for(resume)  # (or CheckpointError: it was released)
        try:
            self._run = start_system(
                task,
                choice,
                self.settings,
                self.extra_hidden,
                workdir,
                resolv_conf() if wanted else None,
                installs_of=self._installs_of,
                above=above,
            )
        except BaseException:
            checkpoints.let_go(above)
            if early is not None:
                early.discard()
            raise
        run, chosen = self._run, self._run.workdir
        if resume is not None:
            run.env = dict(resume.env)
            try:  # (bounded when the checkpoint was made: its own copy)
                checkpoints.copy_logs(resume.logs, run.dirs.root / "logs", self.settings.checkpoint_disk_mb << 20)
            except (OSError, CheckpointError) as exc:
                run.notes.append(f"the agent's log folders of checkpoint {resume.id} could not be copied: {exc}")
        self._state = _State.RUNNING
        try:
            # The network is linked while the shell starts (the shell is sequester's and runs
            # nothing of the agent's before this returns): both done before any agent process.
            linked = self._start_network(run, policy, early)
            try:
                if not shell:  # else the shell's start does it
                    self._nsexec.harden(run.bwrap.pid)
                if run.lease is not None and chosen != "/" and image_path_kind(run.layers, chosen) == "none":
                    self._make_dir(chosen)
                if shell:
                    self._start_shell(harden=True, cwd=self._resume_cwd(run, resume))
            finally:
                linked()
        except BaseException:  # (an episode whose /proc and /dev were not made safe is not used)
            self._stop()
            raise
        if shell and run.gpus is not None and run.gpus.ldconfig:
            self._update_ldcache(run.gpus.ldconfig)
        if shell and not self._verifier_only and wanted_verifier_env(task, self.settings, None) == "separate":
            # Its verifier runs in a fresh pristine view: started now, while the agent works,
            # so the evaluation only copies the artifacts and runs the tests.
            self._spare = Spare(self)
        return self

    def _update_ldcache(self, folders: tuple[str, ...]) -> None:
        """The GPU driver's libraries in the loader's cache, as the CDI hook
        ``update-ldcache`` does in a container: ``ldconfig`` of their folders, in the view,
        before the agent's first command (its output is the trial's note if it fails)."""
        run = self._running()
        assert run.shell is not None
        r = run.shell.run("ldconfig " + " ".join(shlex.quote(f) for f in folders), 60, 4096)
        if r.exit_code != 0:
            run.notes.append(
                f"ldconfig of the GPU driver's folders failed ({r.exit_code}): {(r.stdout + r.stderr).strip()[:300]}"
            )

    def network_policy(self, task: Task) -> EpisodePolicy:
        """``task``'s network narrowed by the settings' (the operator's); a separate
        verifier's environment never gets the operator's hosts."""
        env = task.config.environment
        return episode_policy(
            env.effective_network_mode,
            env.allowed_hosts,
            run_network=self.settings.network,
            agent_hosts=() if self._verifier_only else parse_operator_hosts(self.settings.allowed_hosts),
        )

    def _start_network(
        self, run: RunningEpisode, policy: EpisodePolicy, early: Preparing | None = None
    ) -> Callable[[], None]:
        """Start the episode's network by ``policy`` (``early``: its router, being made);
        nothing at all for an episode without one. Its link into the episode is made in a
        thread: the returned function waits for it, and raises what made it fail."""
        self._network_record = {**policy.to_record(), "traffic": None}
        run.notes += policy.notes()
        if not policy.has_network:
            self._network_record["mode"] = self._network_record["agent_mode"] = "none"
            return _nothing
        why = network_unavailable()
        if why is not None:
            run.notes.append(f"the task's network ({policy.agent_mode}) could not be given: {why}")
            self._network_record.update(mode="none", agent_mode="none", unavailable=why)
            return _nothing
        assert self._nsexec is not None
        servers = [parse_server(s) for s in self.settings.dns_servers]
        net = (
            early.result() if early is not None else EpisodeNetwork.prepare(self._nsexec, policy, target=run.bwrap.pid)
        )
        failed: list[BaseException] = []
        lock, abandoned = threading.Lock(), threading.Event()

        def link() -> None:
            try:
                net.link(run.bwrap.pid, upstream=Upstream(servers or None), write_resolv_conf=not run.resolv_placed)
            except BaseException as exc:  # noqa: BLE001 - raised again by linked()
                failed.append(exc)
            with lock:
                if abandoned.is_set() and not failed:  # nobody waits for it any more
                    net.close()

        thread = threading.Thread(target=link, name="sequester-net-link", daemon=True)
        thread.start()

        def linked() -> None:
            try:
                thread.join()
            except BaseException:  # interrupted (^C, a timeout's exception): the network is not ours
                with lock:
                    abandoned.set()
                    if not thread.is_alive() and not failed:
                        net.close()
                raise
            if failed:  # (link closed everything of the network)
                raise failed[0]
            run.network = net
            # its /etc/resolv.conf (the responder's address) is the network's, not the agent's change
            run.view_points = run.view_points | view_points(["/etc/resolv.conf"])
            if self._verifier_only:
                net.verifier_phase()

        return linked

    @property
    def network(self) -> dict[str, object] | None:
        """The episode's network for the trial's record: its policy and where it came from,
        and (once the episode is closed, or now) the destinations reached, bounded."""
        run = self._run
        if run is not None and run.network is not None:
            self._network_record = run.network.record()
        return dict(self._network_record) if self._network_record is not None else None

    def _make_dir(self, path: str) -> None:
        """``path`` as a folder in the agent's view (an image without its working directory)."""
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(".")
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        self._nsexec_call().extract(self._running().bwrap.pid, path, buf.getvalue())

    @property
    def image(self) -> ImageRecord | None:
        """The image the episode runs on; ``None``: host mode."""
        return self._running().image

    @property
    def system(self) -> dict[str, object]:
        """What the episode runs on, for a trial's record: the image by digest, or host mode."""
        record = self._running().image
        if record is None:
            return {"mode": "host"}
        return {
            "mode": "image",
            "image": record.names[0] if record.names else None,
            "digest": record.digest,
            "id": record.id,
            "source": record.source,
        }

    def _resume_cwd(self, run: RunningEpisode, resume: Checkpoint | None) -> str | None:
        """Where the shell of an episode started on ``resume`` starts: where the shell was at
        the checkpoint, when that is a plain path to a folder of the view (looked up in its
        layers, nothing followed), else the episode's working directory (with a note). The
        episode's own working directory, the tests' and the artifacts', stays the task's
        (red team: a shell's cwd, or a forged $PWD, moved the verifier's to a decoy)."""
        if resume is None or resume.shell_cwd is None or resume.shell_cwd == run.workdir:
            return None
        if checkpoints.plain_path(resume.shell_cwd) and image_path_kind(run.layers, resume.shell_cwd) == "dir":
            return resume.shell_cwd
        run.notes.append(
            f"the shell's working directory at checkpoint {resume.id} ({printable(resume.shell_cwd)[:200]!r}) is not a "
            f"folder of the view: the shell starts in {run.workdir}"
        )
        return None

    def _start_shell(self, *, harden: bool = False, cwd: str | None = None) -> None:
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
                run.bwrap.pid,
                list(run.shell_argv),
                env=run.env,
                cwd=cwd or run.workdir,
                stdin=slave,
                stdout=out_w,
                stderr=slave,
                extra=[control_r],
                ctty=True,
                caps=run.agent_caps,
                seccomp_bpf=seccomp.compile_filter("agent"),
                seccomp_nr=seccomp.syscall_number("seccomp"),
                cgroup=run.agent_cgroups,
                rlimits={**CONTAINER_RLIMITS, **run.rlimits},
                harden=harden,
                ids=run.agent_ids,
            )
        except BaseException:
            for fd in (master, control_w, out_r):
                close_fd(fd)
            raise
        finally:
            for fd in (slave, control_r, out_w):
                close_fd(fd)
        run.shell = Shell(pid, control_w, out_r, master, pid_ns=pid_namespace(run.bwrap.pid))
        try:
            os.write(control_w, SHELL_SETUP.encode())
        except OSError:
            run.shell.alive = False

    def exec(self, command: str, timeout: float | None = None) -> ExecResult:
        """Run ``command`` in the agent's persistent shell (cwd and exports persist).

        ``timeout`` defaults to the settings' ``exec_timeout``; the task's ``[agent]
        timeout_sec`` bounds the whole episode. A command that runs over ends whole (see
        :mod:`.shell`): its foreground job is interrupted (^C), then killed, and the rest
        of its command line does not run; background jobs and the shell's state stay.
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
            try:
                self._start_shell()
            except SandboxError as exc:
                # The agent's own doing (its processes fill its limit, say): the command
                # does not run, and the trial goes on to its verdict.
                return ExecResult(
                    "",
                    "",
                    None,
                    False,
                    0.0,
                    f"the agent's shell could not be restarted, so the command did not run: {exc}",
                )
            run.notes.append(f"the agent's shell {_ENDED}")
        assert run.shell is not None
        result = run.shell.run(command, limit, self.settings.output_bytes)
        if not run.shell.alive:
            try:
                self._start_shell()
                run.notes.append(f"the agent's shell {_ENDED}")
            except SandboxError as exc:  # tried again at the next exec
                log.info("the agent's shell could not be restarted: %s", exc)
        return result

    def run(
        self,
        argv: list[str],
        *,
        input: bytes | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        user: str | int | None = None,
        timeout: float | None = None,
        output_limit: int | None = None,
    ) -> ExecResult:
        """Run ``argv`` as a fresh process of the episode, beside the agent's shell (not in
        it: nothing of one call stays for the next, and calls may run at once), as the
        agent's shell runs: the same namespaces, capabilities, filter, cgroup and limits.

        ``argv[0]`` is found on the episode's ``PATH`` (``env`` applied first); ``cwd``
        (relative: to the working directory); ``user``: a name of the view's
        ``/etc/passwd`` or a uid, else the image's user; ``input``: its standard input.
        Past ``timeout`` (default: the settings' ``exec_timeout``) its process group is
        killed and ``timed_out`` set; past ``output_limit`` bytes of a stream (default: the
        settings' ``output_bytes``) too, with ``note`` saying so.
        """
        run = self._running()
        limit = self.settings.exec_timeout if timeout is None else timeout
        if not argv:
            raise EpisodeError("run: an empty command")
        if limit <= 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        ids = run.agent_ids if user is None else self._user_ids(user, min(limit, 10.0))
        where = cwd if cwd and cwd.startswith("/") else f"{run.workdir.rstrip('/')}/{cwd}" if cwd else run.workdir
        assert self._nsexec is not None
        return run_process(
            self._nsexec,
            run.bwrap.pid,
            argv,
            env={**run.env, **(env or {})},
            cwd=where,
            input=input,
            timeout=limit,
            output_limit=output_limit or self.settings.output_bytes,
            caps=run.agent_caps,
            cgroup=run.agent_cgroups,
            rlimits={**CONTAINER_RLIMITS, **run.rlimits},
            ids=ids,
        )

    def _user_ids(self, user: str | int, timeout: float) -> tuple[int, int] | None:
        """``(uid, gid)`` of ``user`` in the view (None: root, as the namespace's root is);
        the view's ``/etc/passwd`` read within ``timeout`` (red team: the agent made it a fifo)."""
        name = str(user)
        try:
            data = self._nsexec_call().read_file(
                self._running().bwrap.pid, "/etc/passwd", limit=1 << 20, timeout=timeout
            )
        except SandboxError as exc:
            raise EpisodeError(f"user {name!r}: the episode's /etc/passwd cannot be read ({exc})") from None
        passwd = data.decode(errors="replace")
        for line in passwd.splitlines():
            fields = line.split(":")
            if len(fields) >= 4 and (fields[0] == name or fields[2] == name) and fields[2].isdigit():
                uid, gid = int(fields[2]), int(fields[3]) if fields[3].isdigit() else int(fields[2])
                return None if uid == 0 else (uid, gid)
        if name.isdigit():
            return None if int(name) == 0 else (int(name), int(name))
        raise EpisodeError(f"user {name!r}: no such user in the episode's /etc/passwd")

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

    def read_dir(self, path: str, limit: int = DIR_LIMIT) -> bytes:
        """A tar of the folder ``path`` of the view (names relative to it; links kept as links)."""
        where = self._absolute(path)
        try:
            data, missing = self._nsexec_call().pack(self._running().bwrap.pid, [where], {}, limit=limit, timeout=60)
        except SandboxError as exc:
            raise EpisodeError(f"{where}: {exc}") from exc
        if missing:
            raise EpisodeError(f"{where}: no such folder")
        return reroot(data, where)

    def _fresh(self) -> Episode:
        """A new episode of these settings and this helper: a separate verifier's environment."""
        fresh = Episode(self.settings, hide=self.extra_hidden, nsexec=self._nsexec)
        fresh._verifier_only = True
        fresh._installs_of = self._running()
        return fresh

    @property
    def runner(self) -> Path | None:
        """The verifier's runner tree on the host (None: it could not be built)."""
        return self._running().runner

    @property
    def wheels(self) -> Path | None:
        """The wheels the task's test script pins beyond the runner's, on the host."""
        return self._running().wheels

    @property
    def image_python(self) -> ImagePython | None:
        """The image's python3, when the runner carries its version."""
        return self._running().image_python

    @property
    def installs(self) -> Path | None:
        """The tar of what the task's test script apt-get installs, on the host."""
        return self._running().installs

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
        image = run.image is not None
        # What the tests' installs unpack (sequester.imagebuild.apt_install) is the tests'
        # writing, not the agent's: not reported.
        known = run.view_points | (unpacked_paths(run.installs) if run.installs is not None else frozenset())
        lines = report_episode(run.dirs, known=known, ids=run.id_map, image=image, sealed=run.above)
        return lines + (self._top_level_entries(run) if image else self._top_level_changes(run))

    def _top_level_entries(self, run: RunningEpisode) -> list[str]:
        """On an image the agent's writes to ``/`` itself are in its writable layer: what it
        put there other than a folder (a file, a link, a whiteout of the image's ``/bin``)."""
        found: list[str] = []
        try:
            with os.scandir(run.dirs.upper_root) as entries:
                for entry in entries:
                    if len(found) >= 20:
                        found.append("and more entries at the top of the tree")
                        break
                    if not entry.is_dir(follow_symlinks=False):
                        found.append(f"changed /{printable(entry.name)} at the top of the tree")
        except OSError:
            pass
        return found

    def _top_level_changes(self, run: RunningEpisode) -> list[str]:
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

    def evaluate(self, *, freeze: bool | None = None, verifier_env: str | None = None) -> verdict.VerifierResult:
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
        wanted = wants_freeze(task, self.settings, freeze)
        mode = wanted_verifier_env(task, self.settings, verifier_env)
        assert self._nsexec is not None
        notes: tuple[str, ...] = ()
        frozen = None
        if wanted:  # first: nothing of the evaluation happens while an agent process runs
            outcome = run.freezer.freeze()
            frozen, notes = outcome.method, (outcome.note,)
        if run.network is not None:  # the verifier never gets the operator's hosts
            run.network.verifier_phase()
        try:
            if mode == "separate":
                spare, self._spare = self._spare, None
                ready = spare.take() if spare is not None else None
                ev, more = evaluate_separately(
                    self, ready or self._fresh(), self._nsexec, run.bwrap.pid, started=ready is not None
                )
                notes += more
            else:
                ev = run_tests(
                    self._nsexec,
                    task,
                    init_pid=run.bwrap.pid,
                    workdir=run.workdir,
                    runner=run.runner,
                    wheels=run.wheels,
                    installs=run.installs,
                    image_python=run.image_python,
                    output_limit=self.settings.output_bytes,
                    max_processes=self.settings.max_processes,
                )
        finally:
            if run.network is not None:
                run.network.agent_phase()
            if wanted:
                run.freezer.thaw()
                if not outcome.held and run.shell is not None:
                    run.shell.alive = False  # its processes were killed: the next exec starts a new one
        # Information only, and only once the verdict is in: nothing of it decides the
        # reward, and the agent learns of the evaluation from nothing done before it.
        findings = tuple(self.tampering())
        try:
            result = judge(
                task, ev, tampering=findings, frozen=frozen, notes=notes, reward_range=self.settings.reward_range
            )
            said = frozen_evaluation_note(frozen, timed_out=ev.report is None, reward=result.reward)
            return dataclasses.replace(result, notes=(*result.notes, said)) if said else result
        except verdict.VerifierCouldNotRun as exc:
            # The runner's fault, or the agent's (a view that breaks the verifier's set-up or
            # bootstrap, a forged report)? The same tests in the task's pristine environment,
            # where nothing of the agent's is, decide: trainers drop errors, so only a
            # failure that happens there too may stay one.
            pristine, _ = evaluate_separately(self, self._fresh(), self._nsexec, run.bwrap.pid, with_artifacts=False)
            if not runner_works(pristine):
                raise
            return zero_result(
                ev,
                f"{exc} -- but the task's pristine environment does not fail that way: the "
                "agent's view or programs did this",
                tampering=findings,
                frozen=frozen,
                notes=notes,
            )

    # -- checkpoints (sequester.environments.local.checkpoint) -----------------------------

    def checkpoint(self) -> Checkpoint:
        """Seal the episode's files as they are now and go on from them: the agent's
        processes are frozen, the sandbox ends, its writable layer becomes a read-only
        layer of the returned :class:`Checkpoint`, and the episode starts again on it under
        a fresh writable layer, its shell in the working directory and with the exported
        variables it had. Every other process is not restored: named in
        ``Checkpoint.not_restored`` and the episode's notes. The agent's remaining time
        goes on. Past ``[episodes] checkpoint_depth`` sealed layers, those below are squashed
        into one first. :class:`CheckpointError` (the episode as it was) past
        ``checkpoint_disk_mb``, or for a layer or logs it cannot measure or copy whole;
        :class:`UnsupportedByBackend` for a host-mode episode."""
        run = self._running()
        if run.lease is None or run.image is None:
            raise UnsupportedByBackend(
                "checkpoint() needs an episode on an image (a host-mode view keeps the agent's fresh folders as "
                "plain folders, not as a layer that can be sealed)"
            )
        # Past checkpoint_depth, the layers below are squashed into one first, while the
        # episode runs on (they never change): a squash that cannot be made refuses the
        # checkpoint with the episode as it was (red team: a squash that failed and went
        # on one layer deeper each time ended with an overlay too long to mount).
        below: tuple[Path, ...] = run.above
        if len(run.above) + 1 > self.settings.checkpoint_depth:
            below = (checkpoints.squash(run.above, self.settings.state_dir, run.id_map),)
        else:
            checkpoints.hold(run.above)  # the checkpoint's own hold on the layers below
        try:
            cwd, env = self._shell_state(run)
            folder = checkpoints.new_folder(self.settings.state_dir)
        except BaseException:
            checkpoints.let_go(below)
            raise
        run.freezer.freeze()
        try:
            size = checkpoints.tree_bytes(run.dirs.upper_root)
            room = (self.settings.checkpoint_disk_mb << 20) - checkpoints.held_bytes() - size
            if room < 0:
                raise CheckpointError(
                    f"the checkpoint's layer takes {size >> 20} MB and this process's checkpoints "
                    f"{checkpoints.held_bytes() >> 20} MB already ([episodes] checkpoint_disk_mb = "
                    f"{self.settings.checkpoint_disk_mb}): release checkpoints no longer needed"
                )
            # The agent's logs, while it is frozen (any failure leaves the episode as it was).
            size += checkpoints.copy_logs(run.dirs.root / "logs", folder / "logs", room)
            others = self._other_processes(run)
        except BaseException:
            checkpoints.discard_folder(folder)
            checkpoints.let_go(below)
            run.freezer.thaw()
            raise
        remaining = run.deadline - time.monotonic() if run.deadline is not None else None
        run.bwrap.kill()  # (nothing writes the layer from here on)
        try:
            layer = checkpoints.seal(run.dirs, folder, size)
        except BaseException:
            checkpoints.let_go(below)
            self._stop()
            raise
        layers = (*below, layer)
        cp = Checkpoint(
            task=run.task,
            choice=Choice(run.image, "image"),
            layers=layers,
            workdir=run.workdir,
            shell_cwd=cwd,
            env=env or dict(run.env),
            not_restored=tuple(others),
            layer_bytes=size,
            remaining=remaining,
        )
        try:
            self._resume(cp, "checkpoint")
        except BaseException as exc:  # (the episode is stopped: its checkpoint is not left held)
            cp.release()
            raise CheckpointError(f"the episode did not start again on its checkpoint, and is stopped: {exc}") from exc
        return cp

    def rollback(self, checkpoint: Checkpoint) -> Episode:
        """Start the episode again on ``checkpoint``: every change since is gone (its
        writable layer dropped), the shell as the checkpoint had it, no other process.
        ``checkpoint`` stays held (roll back to it again, or fork from it)."""
        if self._state is _State.CLOSED:
            raise EpisodeError("the episode is closed")
        current = self._run.task if self._run is not None else None
        if current is not None and current.path.resolve() != checkpoint.task.path.resolve():
            # (red team: a session of a hard task rolled back onto an easy task's checkpoint
            # and was scored by the easy task's tests under the hard task's name)
            raise CheckpointError(
                f"checkpoint {checkpoint.id} is of task {checkpoint.task.name}, not of this episode's ({current.name})"
            )
        self._resume(checkpoint, "rollback")
        return self

    def fork(self, checkpoint: Checkpoint, n: int) -> list[Episode]:
        """``n`` new episodes started on ``checkpoint`` (this episode's settings): each
        shares every layer up to it and has its own writable layer, namespaces, network and
        processes; none sees another's. Each gets a machine id of its own. Close each.
        On a failure, the ones started are closed and the error raised."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise CheckpointError(f"fork: n = {n!r} is not a positive number of episodes")
        started: list[Episode] = []
        try:
            for _ in range(n):
                episode = Episode(self.settings, hide=self.extra_hidden, nsexec=self._nsexec)
                started.append(episode)
                episode.start_from(checkpoint)
        except BaseException:
            for episode in started:
                episode.close()
            raise
        return started

    def start_from(self, checkpoint: Checkpoint) -> Episode:
        """Start this episode as a fork of ``checkpoint`` (:meth:`fork` of one, for an
        episode made elsewhere: a pool's, on its own thread), replacing any earlier one."""
        self._resume(checkpoint, "fork")
        return self

    def _resume(self, cp: Checkpoint, how: str) -> None:
        if cp.released:
            raise CheckpointError(f"checkpoint {cp.id} was released")
        self._begin(
            cp.task, workdir=cp.workdir, shell=True, image_source=None, image=_CHOOSE, choice=cp.choice, resume=cp
        )
        run = self._running()
        if cp.remaining is not None:
            run.deadline = time.monotonic() + cp.remaining
        if how == "fork":
            self._new_machine_id()
        run.notes.append(
            f"{how} {cp.id}: the shell started again with the exported variables it had"
            + (f"; not restored: {', '.join(cp.not_restored[:8])}" if cp.not_restored else "")
            + ("" if len(cp.not_restored) <= 8 else f" and {len(cp.not_restored) - 8} more")
        )

    def _shell_state(self, run: RunningEpisode) -> tuple[str | None, dict[str, str]]:
        """The agent's shell's working directory and exported variables (its own builtins),
        or ``(None, {})`` when it does not answer within 10 s."""
        if run.shell is None or not run.shell.alive:
            return None, {}
        result = run.shell.run(checkpoints.SHELL_STATE_COMMAND, 10.0, 1 << 20)
        if result.exit_code != 0 or result.timed_out:
            return None, {}
        return checkpoints.parse_shell_state(result.stdout)

    def _other_processes(self, run: RunningEpisode) -> list[str]:
        """The command lines of the episode's processes but its init, the init's ``sleep``
        and the agent's shell: what a restart does not bring back (at most 100)."""
        skip = {run.bwrap.pid, run.shell.pid if run.shell is not None else -1}
        found: list[str] = []
        for proc in run.freezer.ns.members():
            with proc:
                if proc.pid in skip or len(found) >= 100:
                    continue
                line = (proc.read("cmdline") or b"").rstrip(b"\0")
                stat_line = proc.read("stat") or b""
                ppid = stat_line.rpartition(b")")[2].split()[1:2]
                if ppid == [str(run.bwrap.pid).encode()] and line == b"sleep\x0086400":
                    continue
                if line:
                    found.append(printable(line.replace(b"\0", b" ").decode(errors="replace"))[:200])
        return found

    def _new_machine_id(self) -> None:
        """A fork's own ``/etc/machine-id`` when the view has a non-empty one (systemd's
        format: 32 lowercase hex digits and a newline)."""
        try:
            current = self.read_file("/etc/machine-id")
            if len(current) == 33 and current[:32].isalnum() and current.endswith(b"\n"):  # (what systemd writes)
                self.write_file("/etc/machine-id", secrets.token_hex(16) + "\n", 0o444)
        except (EpisodeError, SandboxError, OSError) as exc:  # (a link the agent put there: its own loss)
            self._running().notes.append(f"the fork's /etc/machine-id was left as it is: {printable(str(exc))[:200]}")

    # -- teardown ------------------------------------------------------------------------

    def _stop(self) -> None:
        spare, self._spare = self._spare, None
        if spare is not None:
            spare.discard()
        run, self._run = self._run, None
        if run is None:
            return
        errors = []
        for step in (
            (run.network.close if run.network else None),
            run.freezer.thaw,
            (run.shell.close if run.shell else None),
            run.bwrap.kill,
            run.freezer.remove,
            (run.limit_groups.remove if run.limit_groups else None),
            run.dirs.remove,
            (run.storage_quota.remove if run.storage_quota else None),
            (run.lease.release if run.lease else None),
            ((lambda: checkpoints.let_go(run.above)) if run.above else None),
        ):
            if step is None:
                continue
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - keep tearing down; report at the end
                errors.append(f"{getattr(step, '__qualname__', step)}: {exc}")
        if run.network is not None:
            self._network_record = run.network.record()  # as it was when closed
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
