"""One evaluation in the local backend: the pristine tests run through the runner, in the
verifier's own namespace, by the namespace helper (:mod:`sequester.sandbox.nsexec`);
the request and the bounded reading of what it printed. The verdict is
:func:`sequester.environments.verdict.judge`'s.

Called by :meth:`.episode.Episode.evaluate` (which freezes and thaws the agent around it).
"""

from __future__ import annotations

import base64
import functools
import itertools
import os
import threading
import time
from pathlib import Path

from sequester.environments.verdict import Evaluation
from sequester.guard import seccomp
from sequester.imagebuild.apt_install import installed_packages
from sequester.imagebuild.runner_libraries import runner_libraries
from sequester.sandbox.argv import CONTAINER_CAPS, CONTAINER_RLIMITS
from sequester.sandbox.bwrap import close_fd
from sequester.sandbox.cgroups.limits import make_limit_groups
from sequester.sandbox.nsexec.client import HeadTail, NsExec, write_and_close
from sequester.tasks import Task
from sequester.verifier import ahead, invocation, layout
from sequester.verifier.image_python import ImagePython

__all__ = ["run_tests"]

_RUNNER_SAID_LIMIT = 4096


_serial = itertools.count()


def run_tests(
    nsexec: NsExec,
    task: Task,
    *,
    init_pid: int,
    workdir: str,
    runner: Path | None,
    output_limit: int,
    max_processes: int = 4096,
    wheels: Path | None = None,
    installs: Path | None = None,
    image_python: ImagePython | None = None,
) -> Evaluation:
    """Run the task's pristine tests in the verifier's own namespace (see the module).

    Attack: the tests run the agent's programs, as host root for a root caller, whom
    RLIMIT_NPROC does not bind: the verifier's processes get a pids cgroup of their own
    (not the agent's: what the agent left cannot starve the tests) and, as an rlimit
    (which binds an ordinary user's, counted with all of that user's processes, the
    agent's included), twice the agent's limit."""
    started = time.monotonic()
    if runner is None:
        return Evaluation({"error": "the verifier's runner could not be built (see the log)"}, b"", (), 0.0)
    group, _ = make_limit_groups(
        f"sequester-{os.getpid()}-v{next(_serial)}", memory_mb=None, cpus=None, pids=max_processes
    )
    try:
        return _run_tests(
            nsexec,
            task,
            init_pid=init_pid,
            workdir=workdir,
            runner=runner,
            output_limit=output_limit,
            max_processes=max_processes,
            cgroups=group.procs if group else [],
            started=started,
            wheels=wheels,
            installs=installs,
            image_python=image_python,
        )
    finally:
        if group is not None:  # (its last process may still be on its way out: not waited for)
            group.remove_soon()


def _run_tests(
    nsexec: NsExec,
    task: Task,
    *,
    init_pid: int,
    workdir: str,
    runner: Path,
    output_limit: int,
    max_processes: int,
    cgroups: list[str],
    started: float,
    wheels: Path | None,
    installs: Path | None,
    image_python: ImagePython | None,
) -> Evaluation:
    st = os.stat(runner)
    tests = invocation.tests_archive(task)
    argv = invocation.verifier_argv(task)
    env = invocation.verifier_env(task, task_wheels=wheels is not None, image_python=image_python)
    planned = _ahead(task, argv)
    # The task's pinned wheels (sequester.verifier.wheels): the host's folder, by descriptor;
    # the helper copies them into a read-only tmpfs of the verifier's own namespace.
    wheels_fd = os.open(wheels, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) if wheels is not None else None
    # What its apt-get install lines install (sequester.imagebuild.apt_install): the tar, by
    # descriptor, copied likewise; the runner's apt-get unpacks it when the script asks.
    packages = installed_packages(installs) if installs is not None else []
    installs_fd = os.open(installs, os.O_RDONLY | os.O_CLOEXEC) if installs is not None else None
    # Their libraries and what those need of the pristine image: the host's folder, bound
    # read-only where the runner's Pythons' loader looks (sequester.imagebuild.runner_libraries).
    libs = runner_libraries(installs) if installs is not None else None
    libs_fd = os.open(libs, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) if libs is not None else None
    extra = [fd for fd in (wheels_fd, installs_fd, libs_fd) if fd is not None]
    tests_r, tests_w = os.pipe()
    out_r, out_w = os.pipe()
    said_r, said_w = os.pipe()
    for fd in (out_r, said_r, tests_w):
        os.set_inheritable(fd, False)
    try:
        worker = nsexec.request(
            {
                "op": "verify",
                "target": init_pid,
                "argv": argv,
                "env": env,
                "cwd": workdir,
                "caps": list(CONTAINER_CAPS),
                "seccomp": base64.b64encode(seccomp.compile_filter("agent")).decode(),
                "seccomp_nr": seccomp.syscall_number("seccomp"),
                "proc_submounts": _proc_submounts(init_pid),
                "watch": _write_watch(),
                "runner": {
                    "mount": str(layout.RUNNER_MOUNT),
                    "run": str(layout.RUN),
                    "bin": str(layout.BIN),
                    "dev": st.st_dev,
                    "ino": st.st_ino,
                    "home_env": (runner / "etc" / "uv-env").read_text(),
                    "wheels": str(layout.TASK_WHEELS) if wheels_fd is not None else None,
                    "run_size": run_size(wheels),
                    "installs": str(layout.TASK_INSTALLS) if installs is not None else None,
                    "packages": packages,
                    "libs": str(layout.TASK_LIBS) if libs_fd is not None else None,
                    "ahead": ahead.request(planned, env) if planned else None,
                },
                "runner_fd": invocation.RUNNER_FD,
                "cgroup": cgroups,
                "rlimits": {**CONTAINER_RLIMITS, "RLIMIT_NPROC": 2 * max_processes},
            },
            [tests_r, out_w, said_w, *extra],
        )
    except BaseException:
        for fd in (tests_w, out_r, said_r):
            close_fd(fd)
        raise
    finally:
        for passed in (tests_r, out_w, said_w, *extra):
            close_fd(passed)
    writer = threading.Thread(target=write_and_close, args=(tests_w, tests), daemon=True)
    writer.start()
    # Bounded while it streams: the agent's programs run inside the tests and can write
    # without end to the verifier's output; the host keeps the head and the tail.
    output, said = HeadTail(output_limit), HeadTail(_RUNNER_SAID_LIMIT)
    try:
        report = worker.report(
            time.monotonic() + task.config.verifier.timeout_sec, also=[(out_r, output), (said_r, said)]
        )
        if report is None:
            worker.kill()
    finally:
        writer.join()
        close_fd(out_r)
        close_fd(said_r)
    marks = tuple(dict.fromkeys(said.bytes().decode(errors="replace").split()))
    return Evaluation(report, output.bytes(), marks, time.monotonic() - started)


_plans: dict[tuple[object, ...], ahead.Ahead] = {}
_SCRIPTS_READ = 64  # the tests' own shell scripts read beside test.sh (a task's folder is the task's)


def _ahead(task: Task, argv: list[str]) -> ahead.Ahead | None:
    """What the runner installs before the script runs (:mod:`sequester.verifier.ahead`),
    read from the script's text (test.sh and the shell scripts beside it, which it may run;
    without one, the runner's own script)."""
    if argv[1:2] == ["-c"]:
        return ahead.plan(argv[2])
    script = task.test_script
    if script is None:
        return None
    try:
        scripts = sorted(p for p in script.parent.glob("*.sh") if p.is_file())[:_SCRIPTS_READ]
        key = tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in scripts)
    except OSError:
        return None
    if key not in _plans:
        if len(_plans) > 4096:
            _plans.clear()
        _plans[key] = ahead.plan(*(p.read_text(errors="replace") for p in scripts))
    return _plans[key]


def _proc_submounts(pid: int) -> list[str]:
    with open(f"/proc/{pid}/mountinfo") as f:
        return [p for p in (line.split()[4] for line in f) if p.startswith("/proc/")]


@functools.cache
def _write_watch() -> dict[str, object]:
    """The filter that hands the test script's opens for writing to the helper, which
    captures the script's own reward writes (:mod:`sequester.sandbox.nsexec.capture`),
    with the numbers of the calls it hands over. Made once (libseccomp takes a third of a
    millisecond); the request only reads it."""
    calls = {}
    for name in ("open", "openat", "creat", "openat2"):
        try:
            calls[str(seccomp.syscall_number(name))] = name
        except (OSError, ValueError, RuntimeError):
            pass  # (not on this architecture)
    return {
        "bpf": base64.b64encode(seccomp.compile_write_watch()).decode(),
        "seccomp_nr": seccomp.syscall_number("seccomp"),
        "calls": calls,
    }


_RUN_BASE = 2 << 30  # uv's cache and environments of a task with only small pins
_wheel_bytes: dict[Path, int] = {}  # (a task's wheels folder never changes once made)


def run_size(wheels: Path | None) -> int:
    """The size of the runner's scratch folder (a tmpfs: memory, only as used) for a
    task whose pinned wheels are ``wheels``: 2 GiB, plus three times the wheels, which
    uv unpacks there (torch's CUDA build and its libraries: about 3 GB of wheels, more
    than twice that unpacked). Bounded by the task's pins, never by the agent."""
    if wheels is None:
        return _RUN_BASE
    if wheels not in _wheel_bytes:
        _wheel_bytes[wheels] = sum(p.stat().st_size for p in wheels.glob("*.whl") if p.is_file())
    return _RUN_BASE + 3 * _wheel_bytes[wheels]
