"""One evaluation: run the pristine tests through the runner, read what it left, decide.

Called by :meth:`.episode.Episode.evaluate` (which freezes and thaws the agent around it).
The namespace helper stages and runs everything (see :mod:`._nsexec_server`); here:
the request, the bounded reading of the verifier's output, and who is to blame when
there is no verdict:

============================================  ==========================================
what happened                                  result
============================================  ==========================================
the tests wrote a valid reward                 that reward
the verifier ran over ``timeout_sec``          0 for the agent (its programs were under test)
no reward file, or an invalid one              0 for the agent (its programs can kill or
                                               overwrite the test script's; a task whose
                                               own script never writes one shows up as 0
                                               for the oracle too)
``uvx`` started but pytest never did           :class:`VerifierCouldNotRun`: the runner's
                                               bootstrap failed (a Python or pinned package
                                               the runner lacks); the agent cannot cause it
the namespace helper could not stage or start  :class:`VerifierCouldNotRun` (the harness)
============================================  ==========================================

Every :class:`VerifierCouldNotRun` is checked once more by running the same tests in the
task's pristine environment (:meth:`.episode.Episode.evaluate`): if the runner works
there, the failure was the agent's doing (a view that breaks the verifier's set-up, a
forged report of the runner's) and is its 0.

An error is the harness's or the task's, never the agent's doing: trainers drop errored
trials, so nothing an agent does may turn its failing trial into one.
"""

from __future__ import annotations

import base64
import itertools
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sequester.errors import SequesterError
from sequester.guard import seccomp
from sequester.sandbox.argv import CONTAINER_CAPS
from sequester.sandbox.bwrap import close_fd
from sequester.tasks import Task
from sequester.verifier import layout
from sequester.environments import verdict as v
from sequester.sandbox.cgroups.limits import make_limit_groups
from sequester.sandbox.nsexec.client import HeadTail, NsExec, write_and_close

__all__ = ["Evaluation", "BootstrapFailed", "run_tests", "judge", "zero_result", "runner_works"]

_RUNNER_SAID_LIMIT = 4096


class BootstrapFailed(v.VerifierCouldNotRun):
    """uvx started, pytest never did. Whether that is the runner's failing or the agent's
    doing is decided by running the same tests in the task's pristine environment (see
    :meth:`sequester.environments.local.episode.Episode.evaluate`): the runner's own report could
    have been forged there by a program of the agent's, in the pristine one it cannot."""


@dataclass(frozen=True)
class Evaluation:
    """What one run of the verifier produced, as the host read it."""

    report: dict[str, Any] | None  # None: it ran over its time and was killed
    output: bytes                  # head and tail, at most the configured cap
    runner_said: tuple[str, ...]   # how far the runner got: "uvx", "pytest"
    duration: float


_serial = itertools.count()


def run_tests(nsexec: NsExec, task: Task, *, init_pid: int, workdir: str, runner: Path | None,
              output_limit: int, max_processes: int = 4096) -> Evaluation:
    """Run the task's pristine tests in the verifier's own namespace (see the module).

    Attack: the tests run the agent's programs, as host root for a root caller, whom
    RLIMIT_NPROC does not bind: the verifier's processes get a pids cgroup of their own
    (not the agent's: what the agent left cannot starve the tests) and, as an rlimit
    (which binds an ordinary user's, counted with all of that user's processes, the
    agent's included), twice the agent's limit."""
    started = time.monotonic()
    if runner is None:
        return Evaluation({"error": "the verifier's runner could not be built (see the log)"}, b"", (), 0.0)
    from sequester.verifier.wheels import ensure_task_wheels  # (here: the build package imports the episodes')

    try:  # a parse and a stat once fetched (the trial fetches before the agent runs)
        wheels = ensure_task_wheels(task, runner.parent)  # the runner is toolchain_dir/tree-<stamp>
    except SequesterError as exc:
        return Evaluation({"error": f"the task's pinned test wheels could not be had: {exc}"}, b"", (), 0.0)
    group, _ = make_limit_groups(f"sequester-{os.getpid()}-v{next(_serial)}", memory_mb=None, cpus=None,
                                 pids=max_processes)
    try:
        return _run_tests(nsexec, task, init_pid=init_pid, workdir=workdir, runner=runner, output_limit=output_limit,
                          max_processes=max_processes, cgroups=group.procs if group else [], started=started,
                          wheels=wheels)
    finally:
        if group is not None:
            group.remove()


def _run_tests(nsexec: NsExec, task: Task, *, init_pid: int, workdir: str, runner: Path, output_limit: int,
               max_processes: int, cgroups: list[str], started: float, wheels: Path | None) -> Evaluation:
    st = os.stat(runner)
    tests = v.tests_archive(task)
    # The task's pinned wheels (sequester.verifier.wheels): the host's folder, by descriptor;
    # the helper copies them into a read-only tmpfs of the verifier's own namespace.
    wheels_fd = os.open(wheels, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) if wheels is not None else None
    tests_r, tests_w = os.pipe()
    out_r, out_w = os.pipe()
    said_r, said_w = os.pipe()
    for fd in (out_r, said_r, tests_w):
        os.set_inheritable(fd, False)
    try:
        worker = nsexec.request({
            "op": "verify", "target": init_pid, "argv": v.verifier_argv(task),
            "env": v.verifier_env(task, task_wheels=wheels_fd is not None),
            "cwd": workdir, "caps": list(CONTAINER_CAPS),
            "seccomp": base64.b64encode(seccomp.compile_filter("agent")).decode(),
            "seccomp_nr": seccomp.syscall_number("seccomp"), "proc_submounts": _proc_submounts(init_pid),
            "runner": {"mount": str(layout.RUNNER_MOUNT), "run": str(layout.RUN), "bin": str(layout.BIN),
                       "dev": st.st_dev, "ino": st.st_ino, "home_env": (runner / "etc" / "uv-env").read_text(),
                       "wheels": str(layout.TASK_WHEELS) if wheels_fd is not None else None},
            "runner_fd": v.RUNNER_FD, "cgroup": cgroups, "rlimits": {"RLIMIT_NPROC": 2 * max_processes},
        }, [tests_r, out_w, said_w, *([wheels_fd] if wheels_fd is not None else [])])
    except BaseException:
        for fd in (tests_w, out_r, said_r):
            close_fd(fd)
        raise
    finally:
        for fd in (tests_r, out_w, said_w, wheels_fd):
            if fd is not None:
                close_fd(fd)
    writer = threading.Thread(target=write_and_close, args=(tests_w, tests), daemon=True)
    writer.start()
    # Bounded while it streams: the agent's programs run inside the tests and can write
    # without end to the verifier's output; the host keeps the head and the tail.
    output, said = HeadTail(output_limit), HeadTail(_RUNNER_SAID_LIMIT)
    try:
        report = worker.report(time.monotonic() + task.config.verifier.timeout_sec,
                               also=[(out_r, output), (said_r, said)])
        if report is None:
            worker.kill()
    finally:
        writer.join()
        close_fd(out_r)
        close_fd(said_r)
    marks = tuple(dict.fromkeys(said.bytes().decode(errors="replace").split()))
    return Evaluation(report, output.bytes(), marks, time.monotonic() - started)


def judge(task: Task, ev: Evaluation, *, tampering: tuple[str, ...], frozen: str | None,
          notes: tuple[str, ...] = (),
          reward_range: tuple[float, float] | None = v.DEFAULT_REWARD_RANGE) -> v.VerifierResult:
    """The verdict of one evaluation (see the table above), or :class:`VerifierCouldNotRun`."""
    text = ev.output.decode(errors="replace")
    seen: dict[str, Any] = {"output": text, "duration": ev.duration, "tampering": tampering}
    notes = (*notes, *(ev.report or {}).get("notes", ()))

    def zero(reason: str, exit_code: int | None = None, files: dict[str, bytes] | None = None) -> v.VerifierResult:
        return zero_result(ev, reason, tampering=tampering, frozen=frozen, notes=notes, exit_code=exit_code,
                           files=files)

    if ev.report is None:
        return zero(f"the verifier ran over its {task.config.verifier.timeout_sec:g} s and was killed")
    if "error" in ev.report:
        raise v.VerifierCouldNotRun(f"the verifier could not run: {ev.report['error']}", **seen)
    exit_code = ev.report.get("exit_code")
    files = {name: base64.b64decode(data) for name, data in ev.report.get("files", {}).items()}
    seen.update(exit_code=exit_code, files=files)
    if "uvx" in ev.runner_said and "pytest" not in ev.runner_said:
        raise BootstrapFailed(
            "the verifier could not run: uvx never started pytest (the runner lacks the Python or a package the "
            f"test script asks for; the script exited {exit_code})", **seen)
    if "reward.json" in files and not v.tests_mention(task, b"reward.json"):
        # Attack: a program the tests ran (the agent's) writing reward.json, which wins over
        # the reward.txt the script writes. A task whose tests never name reward.json gets
        # its verdict from reward.txt only.
        files = {k: val for k, val in files.items() if k != "reward.json"}
        notes = (*notes, "reward.json ignored: none of the task's tests write it (a program they ran did)")
    try:
        rewards = v.parse_rewards(files, reward_range)
    except v.VerifierError as exc:
        return zero(f"{exc} (the script exited {exit_code})", exit_code, files)
    return v.VerifierResult(rewards, text, exit_code, ev.duration, files, tampering, frozen, notes=notes)


def runner_works(ev: Evaluation) -> bool:
    """Whether the runner got as far as the tests in ``ev``: it was set up, and if uvx
    started, pytest did too (a timeout counts: the tests were running)."""
    if ev.report is None:
        return True
    if "error" in ev.report:
        return False
    return not ("uvx" in ev.runner_said and "pytest" not in ev.runner_said)


def zero_result(ev: Evaluation, reason: str, *, tampering: tuple[str, ...], frozen: str | None,
                notes: tuple[str, ...], exit_code: int | None = None,
                files: dict[str, bytes] | None = None) -> v.VerifierResult:
    """The agent's 0 for an evaluation without a valid verdict, with the reason."""
    return v.VerifierResult({"reward": 0.0}, ev.output.decode(errors="replace"), exit_code, ev.duration,
                            dict(files or {}), tampering, frozen, zero_reason=reason, notes=notes)


def _proc_submounts(pid: int) -> list[str]:
    with open(f"/proc/{pid}/mountinfo") as f:
        return [p for p in (line.split()[4] for line in f) if p.startswith("/proc/")]
