"""The namespace helper process: enters an episode's namespaces from trusted code.

Started once per host process by :class:`sequester.sandbox.nsexec.client.NsExec` with
``python -s -B -P -m sequester.sandbox.nsexec.server FD``. It is single-threaded (so it can
fork safely and join user namespaces) and imports everything it will ever need up front:
once a worker has joined an episode's mount namespace, every path it opens belongs to the
agent's view, so it must not load any more code from disk.

For each request (a JSON message with file descriptors on a SEQPACKET socket) it forks a
worker and answers ``{"worker": pid}``; the worker reports on its own result pipe:

* ``spawn``: join the episode (user, mount, PID, network, IPC, UTS, cgroup), fork, and in
  the child make a session (with the given pty as controlling terminal), load the agent's
  seccomp filter, keep only the container capabilities, and exec. The child's parent then
  exits, so the episode's init adopts it.
* ``files``: join the episode and write, read or unpack files in the agent's view.
* ``net_router``, ``net_link``, ``net_nft``, ``net_stack``: an episode's network (see :mod:`.router`).
* ``verify``: join the episode's network, IPC and UTS namespaces and a *copy* of its mount
  namespace (as the parent user namespace, so the copy's mounts stay ours to change),
  in a new PID namespace the agent cannot see. There, fresh tmpfs at ``/tests`` and
  ``/logs``, the pristine tests unpacked, a fresh ``/proc``, and the test script run under
  the agent's own restrictions. Its init then reads ``/logs/verifier`` and reports, and
  everything of the verifier dies with it.
"""

from __future__ import annotations

import base64
import errno
import fcntl
import json
import os
import resource
import signal
import socket
import stat
import sys
import termios
import time
from collections.abc import Callable
from typing import Any

from sequester.guard.landlock import seal_special_files
from sequester.guard.privileges import keep_capabilities
from sequester.guard.seccomp import load_filter
from sequester.sandbox.nsexec.capture import VERDICT_NAMES, Capture
from sequester.sandbox.nsexec.files import extract, op_files
from sequester.sandbox.nsexec.ns import (
    CLONE_NEWNS,
    CLONE_NEWPID,
    MNT_DETACH,
    MS_BIND,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_PRIVATE,
    MS_REC,
    PR_SET_PDEATHSIG,
    check,
    die_with_parent,
    enter,
    finish_joining,
    harden_proc,
    libc,
    read_all,
    remount_readonly,
    report,
    restrict,
    start_joining,
)
from sequester.sandbox.nsexec.root import attach_tree, build_root, clone_tree
from sequester.sandbox.nsexec.router import op_net_link, op_net_nft, op_net_router, op_net_stack

_PR_SET_DUMPABLE = 4
_FILE_LIMIT = 1 << 20  # each file read back from /logs/verifier


# -- operations ---------------------------------------------------------------------


def op_spawn(req: dict[str, Any], fds: list[int]) -> None:
    result, stdin, stdout, stderr = fds[:4]
    extra = fds[4:]
    host_proc = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # host pids, after setns too
    joining = start_joining(req.get("cgroup"))  # (the freezer's, the limits': while it enters)
    try:
        enter(req["target"], user="agent", pid=True, cgroup=None, harden=bool(req.get("harden")))
    finally:
        finish_joining(joining)  # before the first fork, and before this worker may end
    # Fork twice: the process we start must be orphaned *inside* the episode's PID
    # namespace, so that the episode's init adopts and reaps it (an orphan of a process
    # outside it would go to the host's init, and the namespace would die slowly).
    go_r, go_w = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(go_w)
        if os.fork() == 0:
            os.close(go_r)
            _exec_agent_process(req, result, stdin, stdout, stderr, extra)
        os.read(go_r, 1)  # until the worker has seen our child's pid
        os._exit(0)
    os.close(go_r)
    child = _only_child(host_proc, middle)
    os.write(go_w, b"x")
    os.close(go_w)
    os.waitpid(middle, 0)
    report(result, {"pid": child})


def op_run(req: dict[str, Any], fds: list[int]) -> None:
    """``spawn`` for a command whose status the host must trust (``Episode.run``): this
    worker, outside the episode's PID namespace where no agent process can see, trace or
    signal it, is the process's parent and writes its wait status to the last descriptor
    (red team: a status the process itself reported on a pipe could be forged by another
    agent process through /proc/PID/fd). Its pid goes to the result pipe first."""
    result, stdin, stdout, stderr, status = fds[:5]
    joining = start_joining(req.get("cgroup"))
    try:
        enter(req["target"], user="agent", pid=True, cgroup=None, harden=False)
    finally:
        finish_joining(joining)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # (the server ignores it; we wait for our child)
    child = os.fork()
    if child == 0:
        os.close(status)
        _exec_agent_process(req, result, stdin, stdout, stderr, [])
    for fd in (stdin, stdout, stderr):
        os.close(fd)
    report(result, {"pid": child})
    os.close(result)
    while True:
        try:
            _, wait_status = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
    code = os.waitstatus_to_exitcode(wait_status)
    os.write(status, str(code if code >= 0 else 128 - code).encode())
    os.close(status)


def _only_child(proc: int, pid: int) -> int:
    """The host pid of ``pid``'s one child, once it exists (``proc``: the host's /proc)."""
    for _ in range(5000):
        fd = os.open(f"{pid}/task/{pid}/children", os.O_RDONLY, dir_fd=proc)
        try:
            children = os.read(fd, 4096).split()
        finally:
            os.close(fd)
        if children:
            return int(children[0])
        time.sleep(0.0005)
    raise OSError(errno.ECHILD, "the new process did not appear")


def _exec_agent_process(
    req: dict[str, Any], result: int, stdin: int, stdout: int, stderr: int, extra: list[int]
) -> None:
    try:
        os.setsid()
        # Move every descriptor out of the way first, then into place: 0-2, then 3, 4, ...
        moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in (stdin, stdout, stderr, *extra)]
        for fd in {result, stdin, stdout, stderr, *extra}:
            os.close(fd)
        for target_fd, fd in enumerate(moved):
            os.dup2(fd, target_fd)
            os.close(fd)
        if req.get("ctty"):
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        os.chdir(req.get("cwd") or "/")
        _set_rlimits(req.get("rlimits"))  # a container's defaults and the task's limits
        _default_signals()
        if req.get("ids"):
            _give_pipes(len(moved), req["ids"][0], req["ids"][1])
        restrict(base64.b64decode(req["seccomp"]), req["seccomp_nr"], req["caps"], req.get("ids"))
        os.execvpe(req["argv"][0], req["argv"], req["env"])
    except BaseException as exc:  # noqa: BLE001 - the result pipe is gone by now
        os.write(2, f"sequester: could not start {req['argv'][0]}: {exc}\n".encode())
    os._exit(127)


def _give_pipes(count: int, uid: int, gid: int) -> None:
    """Descriptors ``0 .. count - 1`` that are pipes (the shell's ``/dev/fd/3``, its
    output) to the image's ``User``: opened again by path they check the pipe's owner,
    the caller, whom another user of the namespace is not."""
    for fd in range(count):
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            os.fchown(fd, uid, gid)


def _set_rlimits(limits: dict[str, Any] | None) -> None:
    """``{"RLIMIT_NPROC": n}`` (soft and hard) or ``{"RLIMIT_NOFILE": [soft, hard]}``."""
    for name, value in (limits or {}).items():
        which = getattr(resource, name)
        soft, hard = (value, value) if isinstance(value, int) else value
        now = resource.getrlimit(which)[1]
        if now != resource.RLIM_INFINITY and hard > now:  # never above the caller's own
            hard = now
        resource.setrlimit(which, (min(soft, hard), hard))


def _default_signals() -> None:
    """What a container's process starts with: every disposition at its default (Python
    ignores SIGPIPE and SIGXFSZ, and an ignored disposition survives exec: ``yes | head``
    would print errors instead of ending quietly), whatever the host process inherited:
    every signal, not a list (a sequester started under ``nohup`` ignores SIGHUP, which
    its agents would inherit)."""
    for sig in range(1, signal.NSIG):
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):  # numbers the C library reserves (its own real-time signals)
            pass
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def op_verify(req: dict[str, Any], fds: list[int]) -> None:
    """The verifier: its root made here (in a copy of the episode's mount namespace, in a
    new PID namespace for children), the script's shell forked as that namespace's PID 1
    (:func:`_script_shell`), its reward writes captured (:mod:`.capture`) until it ends,
    then the verdict read and reported. Why the shell is PID 1: when it ends, the kernel
    kills every process of the namespace (the tests' own namespace below it included)
    and reaps them before ``waitpid`` returns it, so nothing a program under test left
    behind is alive when a reward file is read. (Signals: as PID 1 it gets only those it
    has a handler for, which bash installs for some; the tests' programs are in its
    process group, so a program can stop the script early: then no reward file but the
    shell's own counts, see :func:`_captured`.)"""
    result, tests, output, runner_pipe = fds[:4]
    # Its own pids cgroup: joined while the root is made (before the first fork).
    joining = start_joining(req.get("cgroup"))
    try:
        notes = _verifier_root(req, fds, tests)
    finally:
        finish_joining(joining)  # before the first fork, and before this worker may end
    watch = req.get("watch")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    shell = os.fork()
    if shell == 0:
        ours.close()
        _script_shell(req, result, output, runner_pipe, theirs)
    theirs.close()
    for fd in (output, runner_pipe):
        os.close(fd)
    try:
        capture = None
        _, listeners, _, _ = socket.recv_fds(ours, 1, 1) if watch else (b"", [], 0, None)
        ours.close()
        if watch and listeners:
            calls = {int(nr): name for nr, name in watch["calls"].items()}
            capture = Capture(listeners[0], shell, calls)
            status = capture.serve()
        else:
            status = os.waitpid(shell, 0)[1]
            if watch:
                notes.append(
                    "the test script's reward writes were not captured (see its output): the reward files "
                    "count as they are"
                )
        files = _verdict_files()
        if capture is not None:
            notes += _captured(capture, files, status)
        report(result, {"exit_code": os.waitstatus_to_exitcode(status), "files": files, "notes": notes})
    except BaseException as exc:  # noqa: BLE001
        report(result, {"error": f"{type(exc).__name__}: {exc}"})
    os._exit(0)


def _captured(capture: Capture, files: dict[str, str], status: int) -> list[str]:
    """The verdict files by who wrote them (see :mod:`.capture`): what the script's shell
    wrote itself replaces the visible reward files, and then a reward file it did not
    write does not count either (a program's reward.json beside the shell's reward.txt);
    where the shell wrote none, the visible ones count (a scorer the script ran wrote
    them, as under Docker) unless the shell was stopped by a signal (a program it ran can
    signal its process group: the script never got to its own write). The notes say
    which."""
    notes = []
    own = capture.contents
    stopped = os.WIFSIGNALED(status) or os.waitstatus_to_exitcode(status) >= 128
    for name in sorted(capture.others):
        if name not in capture.borrowed:
            notes.append(
                f"a program the test script ran wrote into the script's own /logs/verifier/{name} (the shell's "
                "descriptor, as its output) beside the script's own write: not counted"
            )
        elif stopped:
            notes.append(
                f"/logs/verifier/{name} was written by a program the test script ran (through the script's own "
                "descriptor), and the script was stopped by a signal: not counted"
            )
            del own[name]
        else:
            notes.append(
                f"/logs/verifier/{name} was written by a program the test script ran, through the script's own "
                "descriptor (`{ scorer; } > reward.txt`): it counts, as under Docker"
            )
    for name, data in own.items():
        encoded = base64.b64encode(data).decode()
        if name in files and files[name] != encoded:
            notes.append(
                f"/logs/verifier/{name} as the folder shows it differs from what the test script's shell wrote "
                "(a program the tests ran or an agent process wrote it): the script's own write is the verdict"
            )
        files[name] = encoded
    for name in VERDICT_NAMES:
        if name in files and name not in own:
            if own:
                notes.append(
                    f"/logs/verifier/{name} was written by a program the test script ran, beside the script's own "
                    f"{', '.join(sorted(own))}: not counted"
                )
                del files[name]
            elif stopped:
                notes.append(
                    f"/logs/verifier/{name} was written by a program the test script ran, and the script was "
                    f"stopped by a signal (status {os.waitstatus_to_exitcode(status)}) before it wrote a reward "
                    "itself: not counted"
                )
                del files[name]
            else:
                notes.append(
                    f"/logs/verifier/{name} was written by a program the test script ran, not by the script's "
                    "shell: it counts as written (any program the tests ran could have written it, as under Docker)"
                )
    extra = [n for n in files if n not in VERDICT_NAMES]
    while extra and (len(files) > _FILES_READ or sum(len(v) for v in files.values()) * 3 // 4 > _FILES_TOTAL):
        del files[extra.pop()]  # (the others were read in name order: the last go)
    return notes


def _verifier_root(req: dict[str, Any], fds: list[int], tests: int) -> list[str]:
    """The verifier's root (see :func:`sequester.sandbox.nsexec.root.build_root`), the
    runner checked, its scratch folders, the task's wheels and the staged tests."""
    runner = req["runner"]
    # The task's wheels (gigabytes for a torch pin) bound read-only rather than copied into
    # memory, where this worker may: a copy of the host's folder made before it leaves
    # the host's mount namespace (root's: an ordinary user's worker copies them).
    # The staged folders and tar, each when there: the wheels' folder, the installs' tar, the
    # installs' libraries' folder (bound likewise; copied without noexec: the loader maps them).
    kinds = [k for k in ("wheels", "installs", "libs") if runner.get(k)]
    staged = dict(zip(kinds, fds[4 : 4 + len(kinds)], strict=True))
    wheels_tree = clone_tree(staged["wheels"]) if "wheels" in staged else None
    libs_tree = clone_tree(staged["libs"]) if "libs" in staged else None
    enter(req["target"], user="parent", pid=False, cgroup=None)
    die_with_parent(os.getppid())
    check(libc.unshare(CLONE_NEWNS | CLONE_NEWPID), "unshare(mount, pid)")
    check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
    notes = build_root("/tests", runner["bin"], runner["run"], runner["run_size"])
    _check_runner(runner)
    run = runner["run"]
    for folder in ("home/.local/bin", "cache", "tools"):
        os.makedirs(f"{run}/{folder}", 0o755)
    with open(f"{run}/home/.local/bin/env", "w") as f:  # what TB2 scripts source after the uv installer
        f.write(runner["home_env"])
    # The one folder of the runner's the script's programs may write (see _script_shell):
    # uv's cache for what it installs as it runs, which could not be installed ahead. A
    # mount of its own (bound onto itself: the same tmpfs, one budget), so it stays
    # writable when the runner's folder is sealed.
    scratch = f"{run}/scratch"
    for folder in ("", "/cache", "/tools"):
        os.mkdir(scratch + folder, 0o755)
    check(libc.mount(scratch.encode(), scratch.encode(), None, MS_BIND, None), f"bind {scratch}")
    if "wheels" in staged:
        if wheels_tree is not None:
            os.mkdir(runner["wheels"], 0o755)
            attach_tree(wheels_tree, runner["wheels"])
            remount_readonly(runner["wheels"])
        else:
            _copy_wheels(staged["wheels"], runner["wheels"])
    if "installs" in staged:
        _copy_installs(staged["installs"], runner["installs"], runner.get("packages") or [])
    if "libs" in staged:  # (over the tree's own empty folder there, which its loaders search)
        if libs_tree is not None:
            attach_tree(libs_tree, runner["libs"])
            remount_readonly(runner["libs"])
        else:
            _copy_libraries(staged["libs"], runner["libs"])
    for fd in fds[4:]:  # received without close-on-exec: nothing of the host's reaches the script
        os.close(fd)
    os.mkdir("/logs/verifier", 0o777)
    os.chmod("/logs/verifier", 0o777)
    extract(read_all(tests), "/tests", "data")
    os.close(tests)
    # Attack: a program the tests run rewriting test.sh while bash reads it (bash reads its
    # script as it goes), or a test file pytest has yet to import. The staged tests are
    # sealed: a read-only mount, which the tests' programs (no CAP_SYS_ADMIN over it) cannot
    # make writable. (pytest then keeps no cache in /tests: a warning, not a failure.)
    remount_readonly("/tests")
    return notes


def _check_runner(runner: dict[str, Any]) -> None:
    """The runner's tree must be the host's folder, mounted read-only where its programs
    expect it: the agent could never write either, so fail closed if anything else is
    there."""
    path = runner["mount"]
    st, vfs = os.stat(path), os.statvfs(path)
    if (st.st_dev, st.st_ino) != (runner["dev"], runner["ino"]) or not vfs.f_flag & os.ST_RDONLY:
        raise OSError(errno.EPERM, f"the verifier's runner is not mounted read-only at {path}")


def _copy_wheels(source: int, target: str) -> None:
    """The task's pinned wheels (sequester.verifier.wheels): the host's folder ``source`` (a
    descriptor opened on the host, so no path of the agent's view is involved) copied into
    a tmpfs of its own at ``target``, then made read-only. Only regular ``*.whl`` files,
    opened without following links; the copy happens before anything of the verifier runs,
    and neither the agent nor the tests' programs can write it."""
    # (a pin's source distribution too: uv builds it)
    _copy_files(source, target, lambda name: name.endswith((".whl", ".tar.gz")), MS_NOEXEC)


def _copy_libraries(source: int, target: str) -> None:
    """The installs' libraries (sequester.imagebuild.runner_libraries): the host's folder
    ``source``, copied likewise; not ``noexec``: the runner's loader maps them."""
    _copy_files(source, target, lambda name: True, 0)


def _copy_files(source: int, target: str, wanted: Callable[[str], bool], noexec: int) -> None:
    """The regular files of the host's folder ``source`` whose names are ``wanted`` (not
    hidden ones), opened without following links, copied into a tmpfs of their own at
    ``target`` (``noexec``: MS_NOEXEC or 0), then made read-only. Names of one file (hard
    links) stay one file."""
    names, total = [], 0
    inodes: dict[int, str] = {}  # inode -> the name it is first copied as
    links: dict[str, str] = {}  # name -> the name of the copy it is a link to
    with os.scandir(source) as entries:
        for entry in entries:
            if wanted(entry.name) and not entry.name.startswith(".") and entry.is_file(follow_symlinks=False):
                st = entry.stat(follow_symlinks=False)
                if st.st_ino in inodes:
                    links[entry.name] = inodes[st.st_ino]
                    continue
                inodes[st.st_ino] = entry.name
                names.append(entry.name)
                total += st.st_size
    if not os.path.isdir(target):
        os.mkdir(target, 0o755)
    size = total + (len(names) + 256) * 4096  # page rounding and folder entries
    check(
        libc.mount(
            b"tmpfs", target.encode(), b"tmpfs", MS_NOSUID | MS_NODEV | noexec, f"mode=0755,size={size}".encode()
        ),
        f"mount {target}",
    )
    for name in names:
        src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=source)
        try:
            dst = os.open(os.path.join(target, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                while os.sendfile(dst, src, None, 1 << 24):
                    pass
            finally:
                os.close(dst)
        finally:
            os.close(src)
    for name, copy in links.items():
        os.link(os.path.join(target, copy), os.path.join(target, name))
    remount_readonly(target)


def _copy_installs(source: int, target: str, packages: list[str]) -> None:
    """What the task's apt-get install lines install (sequester.imagebuild.apt_install): the
    host's tar ``source`` (a descriptor) copied into a tmpfs of its own at ``target`` as
    ``install.tar``, with ``packages`` (one a line), then made read-only; before anything
    of the verifier runs. The runner's apt-get unpacks it, as the tests' own process."""
    size = os.fstat(source).st_size
    os.mkdir(target, 0o755)
    check(
        libc.mount(
            b"tmpfs",
            target.encode(),
            b"tmpfs",
            MS_NOSUID | MS_NODEV | MS_NOEXEC,
            f"mode=0755,size={size + (64 << 10)}".encode(),
        ),
        f"mount {target}",
    )
    dst = os.open(os.path.join(target, "install.tar"), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        offset = 0
        while offset < size:
            sent = os.sendfile(dst, source, offset, min(size - offset, 1 << 24))
            if sent == 0:
                break
            offset += sent
    finally:
        os.close(dst)
    with open(os.path.join(target, "packages"), "x") as f:
        f.write("".join(f"{p}\n" for p in packages if p and "\n" not in p))
    remount_readonly(target)


def _nest_the_tests(proc_submounts: list[str]) -> int:
    """Everything the test script starts, in PID and mount namespaces below the script's
    shell: the shell stays in the verifier's PID namespace, its children are made in a new
    one (whose init is a reaper of ours) with a ``/proc`` of that namespace only.

    Attack: a program the tests run (the agent's) finding the shell that runs test.sh in
    /proc, attaching to it with ptrace or opening its /proc/PID/mem (the same user may,
    the shell being dumpable), and changing the script's text as the shell reads it on
    after the program ends: the tests' failure wrote 1. Below the shell, no program of
    the tests can name it: its PID is in no namespace they see, their /proc lists only
    their own namespace, and ``getppid()`` is 0 for the shell's children. Returns the read
    end of the reaper's ready pipe (see :func:`_await_tests_proc`)."""
    check(libc.unshare(CLONE_NEWPID | CLONE_NEWNS), "unshare(pid, mount) for the tests")
    ready_r, ready_w = os.pipe()
    reaper = os.fork()  # PID 1 of the new namespace; the shell's later children join it
    if reaper == 0:
        os.close(ready_r)
        _tests_reaper(ready_w, proc_submounts)
    os.close(ready_w)
    return ready_r


def _await_tests_proc(ready: int) -> None:
    """Wait until the reaper :func:`_nest_the_tests` made has mounted the tests' /proc
    (``ready``: the pipe's read end it returned); before the shell runs anything."""
    try:
        if os.read(ready, 1) != b"r":
            raise OSError(errno.EIO, "the tests' PID namespace could not be made")
    finally:
        os.close(ready)


def _tests_reaper(ready: int, proc_submounts: list[str]) -> None:  # pragma: no cover - a forked child's life
    """PID 1 of the tests' namespace: a fresh /proc for it, then only reaping, with no
    capability and not dumpable (the tests' programs see it as PID 1), until the shell
    that made it ends (then the kernel ends the namespace). The fresh /proc goes over the
    view's (the agent's), whose own submounts (``proc_submounts``: its hardening) are
    taken off first: the kernel mounts a procfs in a user namespace only where one is
    fully visible already."""
    try:
        die_with_parent(None)
        libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
        for point in sorted(proc_submounts, key=len, reverse=True):
            libc.umount2(point.encode(), MNT_DETACH)
        check(libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None), "mount /proc")
        harden_proc("/proc")
        for name in os.listdir("/proc/self/fd"):
            if int(name) not in (ready,):
                try:
                    os.close(int(name))
                except OSError:
                    pass
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        keep_capabilities([])
        os.write(ready, b"r")
        os.close(ready)
        while True:
            try:
                while os.waitpid(-1, os.WNOHANG)[0] > 0:
                    pass
            except ChildProcessError:
                pass
            signal.sigwait([signal.SIGCHLD])
    finally:
        os._exit(0)


def _script_shell(req: dict[str, Any], result: int, output: int, runner_pipe: int, worker: socket.socket) -> None:
    """PID 1 of the verifier's namespace, becoming the shell that runs test.sh: its
    output and the runner's pipe in place, the tests' own namespaces below it, Landlock,
    the filter whose notifications ``worker`` gets (:mod:`.capture`), the agent's
    restrictions, then exec."""
    try:
        die_with_parent(None)
        os.setsid()
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.dup2(runner_pipe, req["runner_fd"])
        for fd in {null, output, result, runner_pipe} - {0, 1, 2, req["runner_fd"]}:
            os.close(fd)
        try:
            os.chdir(req["cwd"])
        except OSError:
            os.chdir("/")
        _set_rlimits(req.get("rlimits"))
        runner = req.get("runner") or {}
        if runner.get("ahead"):
            _install_ahead(runner["ahead"], req)
        # Attack: a program the script runs (the agent's make before the script's uvx
        # pytest) writing the runner's uv cache or pip environment, so that a later step
        # runs its pytest; a program pytest starts rewriting a module of the running
        # pytest's environment. What the runner installed ahead (sequester.verifier.ahead)
        # is read-only from here on: in the verifier's mount namespace (nothing but the
        # worker is left in it) and so in the tests' copy of it (they hold no
        # CAP_SYS_ADMIN over it: they cannot make it writable); only its scratch folder,
        # a mount of its own, stays writable.
        if "run" in runner:
            remount_readonly(runner["run"])
        tests_proc = _nest_the_tests(req.get("proc_submounts", []))
        # Attack: a program the tests run making /logs/verifier/reward.txt a FIFO (the
        # script's own `echo 0 >` blocks on it until the program has put its 1 in place)
        # or a link elsewhere. The test shell and all it starts make no FIFO, socket,
        # link or device node there, and move nothing in (Landlock). (Made while the
        # reaper mounts the tests' /proc: the reaper, forked before, is not restricted by
        # it and may still mount.)
        if seal_special_files("/logs") == 0:
            os.write(2, b"sequester: Landlock (ABI 2) is missing: /logs is not sealed\n")
        _default_signals()
        _await_tests_proc(tests_proc)
        _hand_over_writes(req.get("watch"), worker)
        restrict(base64.b64decode(req["seccomp"]), req["seccomp_nr"], req["caps"])
        os.execvpe(req["argv"][0], req["argv"], req["env"])
    except BaseException as exc:  # noqa: BLE001
        os.write(2, f"sequester: the verifier could not start: {exc}\n".encode())
    os._exit(127)


def _install_ahead(ahead: dict[str, Any], req: dict[str, Any]) -> None:
    """Install what the script's text asks for (:mod:`sequester.verifier.ahead`) before
    the script runs anything: each step a child of this process (the shell-to-be, so in
    the verifier's namespaces, not the tests'), with the agent's restrictions, the
    runner's environment (telling the host nothing: a step that fails here is made again
    as the script runs, and fails there as it would have), its output the script's. A
    tool's environment is recorded in the runner's uvx index, a pip line in its list,
    each only on success; a tool that could not be installed is recorded as failed (its
    folder "-"): the runner's uvx then fails it as a set-up failure, never installs it as
    the script runs (red team: an agent that made the install fail, through a setting of
    the view's, had it installed where its own program could write)."""
    env = ahead["env"]  # (the host's allowlist of the script's: see sequester.verifier.ahead)
    sep = ahead["separator"]
    index, lines = [], []
    for step in ahead["steps"]:
        if step.get("unless") and os.path.exists(step["unless"]):
            continue
        out = _run_step(step["argv"], env, req, capture=bool(step.get("tool")))
        if step.get("tool"):
            tool = step["tool"]
            bin_dir = (_tool_bin(out, ahead["roots"], tool["command"]) if out is not None else None) or "-"
            fields = [bin_dir, tool["command"], *tool["words"]]
            if all(f and not {"\t", "\n", sep} & set(f) for f in fields):
                index.append(f"{bin_dir}\t{tool['command']}\t{sep.join(tool['words'])}\n")
        elif out is not None:
            lines.append(sep.join(step["pip_line"]) + "\n")
    if index:
        with open(ahead["index"], "w") as f:
            f.writelines(index)
    if lines and os.path.isdir(os.path.dirname(ahead["pip_lines"])):
        with open(ahead["pip_lines"], "w") as f:
            f.writelines(lines)


def _tool_bin(out: bytes, roots: list[str], command: str) -> str | None:
    """The tool environment's ``bin`` folder from what the runner's ``env`` printed as uv
    ran it there (uv puts that folder first on ``PATH``): only a folder inside one of the
    runner's cache ``roots``, holding ``command``."""
    for line in out.decode(errors="replace").splitlines():
        if line.startswith("PATH="):
            first = os.path.realpath(line[5:].split(":", 1)[0])
            inside = any(first.startswith(root.rstrip("/") + "/") for root in roots)
            if inside and os.path.isfile(os.path.join(first, command)):
                return first
            return None
    return None


_STEP_OUTPUT = 64 << 10  # what a step prints on its standard output that is kept (a PATH)


def _run_step(argv: list[str], env: dict[str, str], req: dict[str, Any], *, capture: bool) -> bytes | None:
    """Run one install step (see :func:`_install_ahead`): its standard output (bounded),
    or None if it failed. Its standard error is the script's output."""
    read, write = os.pipe() if capture else (-1, -1)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - a forked child's life
        try:
            if capture:
                os.close(read)
                os.dup2(write, 1)
                os.close(write)
            os.chdir("/")
            # Attack (red team): a process a step leaves behind (a build's) writing the
            # runner's folder after it was sealed for the tests. Each step is PID 1 of a
            # namespace of its own: when it ends, the kernel kills all it left.
            check(libc.unshare(CLONE_NEWPID), "unshare(pid) for an install step")
            step = os.fork()
            if step == 0:
                restrict(base64.b64decode(req["seccomp"]), req["seccomp_nr"], req["caps"])
                os.execve(argv[0], argv, env)
            os._exit(os.waitstatus_to_exitcode(os.waitpid(step, 0)[1]) & 0xFF)
        except BaseException as exc:  # noqa: BLE001
            os.write(2, f"sequester: the runner could not install ahead: {exc}\n".encode())
        os._exit(127)
    out = b""
    if capture:
        os.close(write)
        try:
            while chunk := os.read(read, 65536):
                if len(out) < _STEP_OUTPUT:
                    out += chunk[: _STEP_OUTPUT - len(out)]
        finally:
            os.close(read)
    status = os.waitpid(pid, 0)[1]
    return out if os.waitstatus_to_exitcode(status) == 0 else None


def _hand_over_writes(watch: dict[str, Any] | None, worker: socket.socket) -> None:
    """Load the write-watching filter and send its notification descriptor to the
    worker (then the worker answers this process's opens for writing); without it, say
    so on the script's output and go on (the worker then reads the files as they are)."""
    try:
        if watch:
            listener = load_filter(base64.b64decode(watch["bpf"]), watch["seccomp_nr"], listener=True)
            socket.send_fds(worker, [b"l"], [listener])
            os.close(listener)
    except OSError as exc:
        os.write(2, f"sequester: the reward files are not captured: {exc}\n".encode())
    finally:
        worker.close()


_FILES_TOTAL = 8 << 20  # all files read back, together (the report must stay small)
_FILES_READ = 64  # files read back, the reward files first
_FILES_SCANNED = 4096  # folder entries looked at (the tests' programs can make millions)


def _verdict_files() -> dict[str, str]:
    """Regular files directly in /logs/verifier (no symlinks), base64, each and all
    together size-capped; the reward files first, then the others in name order among the
    first entries of the folder. The tests' programs may have removed or replaced the
    folder, or filled it: then there are none or fewer (the agent's 0), never an error.

    Attack: a program the tests ran replacing /logs/verifier with a link to a folder the
    agent's live processes write (its /tmp): the folder is opened without following a link,
    from /logs (the verifier's own mount point, which cannot be replaced), and every file
    relative to it."""
    out: dict[str, str] = {}
    try:
        logs = os.open("/logs", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            folder = os.open("verifier", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=logs)
        finally:
            os.close(logs)
    except OSError:
        return out
    try:
        with os.scandir(folder) as entries:
            names = sorted(e.name for _, e in zip(range(_FILES_SCANNED), entries, strict=False))
        first = [n for n in ("reward.json", "reward.txt") if n in names]
        names = first + [n for n in names if n not in first]
        total = 0
        for name in names[:_FILES_READ]:
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
            except OSError:
                continue
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    continue
                data = os.read(fd, _FILE_LIMIT + 1)
            finally:
                os.close(fd)
            if len(data) <= _FILE_LIMIT and total + len(data) <= _FILES_TOTAL:
                out[name] = base64.b64encode(data).decode()
                total += len(data)
    except OSError:
        return out
    finally:
        os.close(folder)
    return out


def op_harden(req: dict[str, Any], fds: list[int]) -> None:
    """In the episode's mount namespace (as its owner, the parent user namespace): the
    view's /proc and /dev hardened before any agent process starts (see _nsexec_ns)."""
    enter(req["target"], user="parent", pid=False, cgroup=None, harden=True)
    report(fds[0], {"ok": True})


_OPS = {
    "spawn": op_spawn,
    "run": op_run,
    "files": op_files,
    "verify": op_verify,
    "harden": op_harden,
    "net_router": op_net_router,
    "net_link": op_net_link,
    "net_nft": op_net_nft,
    "net_stack": op_net_stack,
}


def serve(sock: socket.socket) -> None:
    # Children are reaped by the kernel; workers put SIGCHLD back before they fork or exec.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 16)
        except InterruptedError:
            continue
        if not message:
            return
        try:
            req = json.loads(message)
            op = _OPS[req["op"]]
        except (ValueError, KeyError) as exc:
            sock.send(json.dumps({"error": f"bad request: {exc}"}).encode())
            for fd in fds:
                os.close(fd)
            continue
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            sock.close()
            try:
                _die_with_parent_of_worker()
                op(req, fds)
            except BaseException as exc:  # noqa: BLE001 - the host gets the reason
                try:
                    report(fds[0], {"error": f"{type(exc).__name__}: {exc}"})
                except OSError:
                    pass
                os._exit(1)
            os._exit(0)
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"worker": pid}).encode())


def _die_with_parent_of_worker() -> None:
    # Armed before any namespace change; setns into a user namespace clears it, so the
    # operations that outlive a request re-arm it (the verifier) or hand their child to
    # the episode's init (spawn).
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    serve(sock)


if __name__ == "__main__":
    main()
