"""Where a build step's program runs: the sandbox a ``RUN`` line (untrusted code from the
internet) or the copier of a ``COPY`` runs in, and how its writes become a layer.

The step's root is one overlay: the stage's layers so far (read-only, shared with every
build and episode that uses them) beneath a fresh folder that catches everything the
step writes. That folder *is* the new layer, in the store's own format (a deletion is a
0/0 character device, a replaced folder carries ``user.overlay.opaque``), so committing
it is a rename. Around it: a fresh ``/proc`` and ``/dev``, no host file but the layers
and what the step names (the build context for a ``COPY``, the verifier's runner for the
copier), its own user, PID, IPC, UTS and network namespaces; the step is one uid there
(the Dockerfile's ``USER``; on disk its files are the caller's), with a container's
capabilities only when that uid is 0, and the ``build`` seccomp profile (an agent's,
plus a chown that changes nothing: see :mod:`sequester.guard.seccomp`).

Network: none unless a :class:`~sequester.net.build.proxy.BuildProxy` is given; then
the host opens the proxy's listener inside the step's network namespace before the
command starts (bwrap's ``--block-fd``) and the step's environment names it. Nothing in
the sandbox holds a host file descriptor: its stdin is ``/dev/null``, its output a pipe.
"""

from __future__ import annotations

import itertools
import logging
import os
import resource
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sequester.errors import SequesterError
from sequester.guard import seccomp
from sequester.sandbox.argv import CONTAINER_CAPS, Identity, SandboxSpec
from sequester.sandbox.bwrap import StartedBwrap, close_fd, start_bwrap
from sequester.sandbox.cgroups.limits import make_limit_groups
from sequester.sandbox.idmap import IdMap
from sequester.sandbox.mounts import MountKind, MountOp
from sequester.sandbox.nsexec.client import shared_nsexec
from sequester.sandbox.readiness import readable

__all__ = ["StepRun", "StepOutcome", "step_spec", "run_step", "AUX", "APT_CONF", "OUTPUT_TAIL"]

log = logging.getLogger("sequester.imagebuild")

# Everything the builder adds to a step's view lives below /dev, which is bwrap's own
# tmpfs: a mount point there is never made in the layer being written.
AUX = Path("/dev/.sequester")
APT_CONF = AUX / "apt.conf"
# apt drops to its _apt user to download; the step has one uid, so the switch would
# fail and take apt-get down with it. Docker's apt runs as root too when _apt cannot.
_APT_CONF_TEXT = 'APT::Sandbox::User "root";\n'
OUTPUT_TAIL = 64 * 1024  # bytes of a step's output kept for its error message
_PROXY_PORT = 3128
_serial = itertools.count()


@dataclass(frozen=True)
class StepRun:
    """One program to run on top of ``lowers`` (lowest first), writing into ``upper``."""

    lowers: tuple[Path, ...]
    upper: Path
    work: Path
    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str = "/"
    uid: int = 0
    gid: int = 0
    extra_mounts: tuple[MountOp, ...] = ()
    data_files: Mapping[Path, str] = field(default_factory=dict)
    hostname: str = "buildkitsandbox"
    id_map: IdMap | None = None  # the ids the step maps (sandbox.idmap); None: the caller alone


@dataclass(frozen=True)
class StepOutcome:
    status: int | None  # the program's exit status; None: killed at the deadline
    tail: bytes  # the last OUTPUT_TAIL bytes of its output
    seconds: float
    refusals: tuple[str, ...] = ()

    @property
    def timed_out(self) -> bool:
        return self.status is None


def step_spec(run: StepRun, *, network: bool) -> SandboxSpec:
    """The sandbox of ``run``. Pure."""
    mounts = [
        MountOp(MountKind.OVERLAY, Path("/"), lowers=run.lowers, upper=run.upper, work=run.work),
        MountOp(MountKind.PROC, Path("/proc")),
        MountOp(MountKind.DEV, Path("/dev")),
        *run.extra_mounts,
    ]
    mounts += [MountOp(MountKind.DATA, path) for path in sorted({APT_CONF, *run.data_files})]
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        **run.env,
        "APT_CONFIG": str(APT_CONF),
    }
    if network:
        proxy = f"http://127.0.0.1:{_PROXY_PORT}"
        env.update(
            {
                "http_proxy": proxy,
                "https_proxy": proxy,
                "HTTP_PROXY": proxy,
                "HTTPS_PROXY": proxy,
                "no_proxy": "localhost,127.0.0.1,::1",
                "NO_PROXY": "localhost,127.0.0.1,::1",
            }
        )
    return SandboxSpec(
        mounts=tuple(mounts),
        command=run.argv,
        env=env,
        cwd=Path(run.cwd),
        identity=Identity.ROOT,
        id_map=run.id_map,
        caps=CONTAINER_CAPS if run.uid == 0 else (),
        uid=run.uid,
        gid=run.gid,
        hostname=run.hostname,
        # Held until the host has put the step in its limits (and opened its proxy): a
        # command that ran at once could fork before them.
        readonly_root=False,
        # With one id mapped, chown to another fails: the "build" filter makes it a no-op.
        seccomp=seccomp.compile_filter("build" if run.id_map is None else "agent"),
        hold=True,
    )


def run_step(
    run: StepRun,
    *,
    timeout: float | None,
    proxy=None,
    on_output: Callable[[bytes], None] | None = None,
    max_processes: int = 4096,
) -> StepOutcome:
    """Run ``run`` to its end (or its deadline); its output goes to ``on_output`` as it
    comes, and its last :data:`OUTPUT_TAIL` bytes into the outcome."""
    spec = step_spec(run, network=proxy is not None)
    data = {APT_CONF: _APT_CONF_TEXT, **run.data_files}
    for folder in (run.upper, run.work):
        folder.mkdir(parents=True, exist_ok=True)
    out_r, out_w = os.pipe()
    started_at = time.monotonic()
    try:
        started = start_bwrap(spec, data_files=data, keep_fds=[], stdout=out_w, stderr=out_w, stderr_reader=out_r)
    except BaseException:
        close_fd(out_r)
        raise
    finally:
        close_fd(out_w)
    tail = _Tail(on_output)
    reader = threading.Thread(target=tail.drain, args=(out_r,), name="sequester-build-output", daemon=True)
    reader.start()
    refusals: tuple[str, ...] = ()
    # A RUN's fork bomb must not take the host's pids: a pids cgroup where this process
    # may make one (root: RLIMIT_NPROC does not bind the host's root), and RLIMIT_NPROC
    # (which binds an ordinary user). The command is still held, so everything it starts
    # is in both.
    groups, _ = make_limit_groups(
        f"sequester-{os.getpid()}-build{next(_serial)}", memory_mb=None, cpus=None, pids=max_processes
    )
    try:
        try:
            if groups is not None:
                groups.enrol(started.pid)
            resource.prlimit(started.pid, resource.RLIMIT_NPROC, (max_processes, max_processes))
            # Attack (a root caller's step is host uid 0): procfs lets host uid 0 write the
            # kernel's settings (core_pattern: a program run as host root) whatever its
            # capabilities, and chmod the host's own /dev/null that bwrap binds. Both are
            # made read-only, as for an episode, before the command exists.
            shared_nsexec().harden(started.pid)
            if proxy is not None:
                from sequester.net.netns_listener import open_listener_in

                # The pidfd and the namespace bwrap reported: a recycled pid cannot hand us
                # another process's network namespace.
                listener = open_listener_in(
                    started.pid, _PROXY_PORT, pidfd=started.pidfd, net_namespace=started.net_namespace
                )
                proxy.serve(listener)
            started.release()
        except (OSError, SequesterError):
            if _alive(started):
                raise  # fail closed: a step whose limits or hardening did not take never runs
            # else bwrap died making the sandbox (a mount it could not make): its message is
            # in the output, and its exit status is the step's
        status = _wait(started, timeout)
    finally:
        started.kill()
        if groups is not None:
            groups.remove()
        if proxy is not None:
            proxy.close()
            refusals = tuple(proxy.refusals)
        reader.join(5)
    return StepOutcome(status, tail.data, time.monotonic() - started_at, refusals)


def _alive(started: StartedBwrap) -> bool:
    return not readable(started.pidfd, 0)


def _wait(started: StartedBwrap, timeout: float | None) -> int | None:
    """bwrap's exit status (the command's), or None when the deadline came first."""
    fd = os.pidfd_open(started.popen.pid)
    try:
        ready = readable(fd, timeout)
    finally:
        close_fd(fd)
    if not ready:
        return None
    code = started.popen.wait()
    return 128 - code if code < 0 else code  # killed by a signal: as a shell reports it


class _Tail:
    """The step's output: passed on as it comes, the last OUTPUT_TAIL bytes kept."""

    def __init__(self, on_output: Callable[[bytes], None] | None):
        self.on_output = on_output
        self.data = b""

    def drain(self, fd: int) -> None:
        try:
            while chunk := os.read(fd, 65536):
                self.data = (self.data + chunk)[-OUTPUT_TAIL:]
                if self.on_output is not None:
                    try:
                        self.on_output(chunk)
                    except Exception:  # a broken log must not stall the step's pipe
                        log.exception("build output callback failed")
                        self.on_output = None
        except OSError:
            pass
        finally:
            close_fd(fd)
