"""The namespace helper process: enters an episode's namespaces from trusted code.

Started once per host process by :class:`sequester.episodes.nsexec.NsExec` with
``python -s -B -P -m sequester.episodes._nsexec_server FD``. It is single-threaded (so it can
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
* ``verify``: join the episode's network, IPC and UTS namespaces and a *copy* of its mount
  namespace (as the parent user namespace, so the copy's mounts stay ours to change),
  in a new PID namespace the agent cannot see. There, fresh tmpfs at ``/tests`` and
  ``/logs``, the pristine tests unpacked, a fresh ``/proc``, and the test script run under
  the agent's own restrictions. Its init then reads ``/logs/verifier`` and reports, and
  everything of the verifier dies with it.
"""

from __future__ import annotations

import base64
import ctypes
import errno
import fcntl
import io
import json
import os
import signal
import socket
import stat
import sys
import tarfile
import termios
import time
from typing import Any

from sequester.guard import privileges, seccomp

_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_REC, MS_PRIVATE, MNT_DETACH = 0x4000, 1 << 18, 2
NS_GET_PARENT = 0xB702
PR_SET_PDEATHSIG = 1
_FILE_LIMIT = 1 << 20  # each file read back from /logs/verifier


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _die_with_parent(parent: int | None) -> None:
    """SIGKILL when the parent dies. ``parent``: its pid as we see it, to catch a parent
    that died before the signal was armed (None for a PID namespace's init, whose parent
    is outside it and shows as 0)."""
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def _enter(target: int, *, user: str, pid: bool, cgroup: str | None) -> None:
    """Join ``target``'s namespaces. First the parent of the agent's user namespace (the
    one bwrap made, which owns the episode's other namespaces): there we hold every
    capability, as root or as the user who made it, which joining the others needs. Then
    the mount, network, IPC and UTS namespaces (and PID, for children); last, for
    ``user="agent"``, the agent's own user namespace."""
    if cgroup:
        with open(cgroup, "w") as f:
            f.write(str(os.getpid()))
    fds = {name: os.open(f"/proc/{target}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC)
           for name in ("mnt", "net", "ipc", "uts", "pid", "user")}
    try:
        parent = fcntl.ioctl(fds["user"], NS_GET_PARENT)
        try:
            _check(_libc.setns(parent, CLONE_NEWUSER), "setns(user)")
        finally:
            os.close(parent)
        order = [("mnt", CLONE_NEWNS), ("net", CLONE_NEWNET), ("ipc", CLONE_NEWIPC), ("uts", CLONE_NEWUTS)]
        if pid:
            order.append(("pid", CLONE_NEWPID))
        if user == "agent":
            order.append(("user", CLONE_NEWUSER))
        for name, flag in order:
            _check(_libc.setns(fds[name], flag), f"setns({name})")
    finally:
        for fd in fds.values():
            os.close(fd)


def _restrict(bpf: bytes, nr: int, caps: list[str]) -> None:
    """The agent's restrictions: seccomp (while we may still load it), then capabilities."""
    seccomp.load_filter(bpf, nr)
    privileges.keep_capabilities(caps)


def _extract(data: bytes, dest: str, policy: str) -> None:
    """Unpack a tar with tarfile's extraction filters (``data``: no links out, no special
    files, no setuid bits; ``tar``: the same minus the mode cleaning). Pythons before
    3.11.4 lack the filters: there, members that leave ``dest`` or are devices are refused."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter=_artifact_filter if policy == "artifacts" else policy)
            return
        for member in tar.getmembers():
            name = os.path.normpath(member.name)
            if name.startswith(("/", "..")) or member.isdev() or (
                    (member.issym() or member.islnk()) and os.path.normpath(
                        os.path.join(os.path.dirname(name), member.linkname)).startswith(("/", ".."))):
                raise OSError(errno.EPERM, f"refusing to unpack {member.name!r}")
            if policy == "data":
                member.mode &= 0o755
        tar.extractall(dest)


def _pack(paths: list[str], exclude: dict[str, list[str]], out: int) -> list[str]:
    """A tar stream of ``paths`` of the view (symlinks kept as links, never followed;
    only folders, files and links) onto ``out``; returns the paths that do not exist."""
    import fnmatch

    missing = []
    with os.fdopen(out, "wb") as stream, tarfile.open(fileobj=stream, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for path in paths:
            if not os.path.lexists(path):
                missing.append(path)
                continue
            patterns = exclude.get(path, [])

            def keep(info: tarfile.TarInfo, patterns: list[str] = patterns) -> tarfile.TarInfo | None:
                if not (info.isfile() or info.isdir() or info.issym()):
                    return None  # no devices, fifos or hard links into the view
                rel = info.name.split("/", 1)[-1]
                return None if any(fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(info.name, p) for p in patterns) \
                    else info

            tar.add(path, arcname=path.lstrip("/"), filter=keep)
    return missing


def _artifact_filter(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
    """tarfile's ``tar`` filter, except that a symlink may point anywhere (the link itself
    is data), and no member may lie below a link: artifacts unpack at ``/``, where the
    filter's own "outside the destination" test cannot catch ``app/link -> /etc``
    followed by ``app/link/passwd``; a tar made by ``_pack`` never has such members."""
    parent = os.path.dirname(os.path.join(dest, member.name.lstrip("/")))
    if os.path.realpath(parent) != os.path.normpath(parent):
        raise tarfile.OutsideDestinationError(member, parent)
    try:
        return tarfile.tar_filter(member, dest)
    except (tarfile.AbsoluteLinkError, tarfile.LinkOutsideDestinationError):
        if member.issym():
            return member
        raise


def _report(fd: int, message: dict[str, Any]) -> None:
    data = (json.dumps(message) + "\n").encode()
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


# -- operations ---------------------------------------------------------------------


def op_spawn(req: dict[str, Any], fds: list[int]) -> None:
    result, stdin, stdout, stderr = fds[:4]
    extra = fds[4:]
    host_proc = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # host pids, after setns too
    _enter(req["target"], user="agent", pid=True, cgroup=req.get("cgroup"))
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
    _report(result, {"pid": child})


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


def _exec_agent_process(req: dict[str, Any], result: int, stdin: int, stdout: int, stderr: int,
                        extra: list[int]) -> None:
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
        _restrict(base64.b64decode(req["seccomp"]), req["seccomp_nr"], req["caps"])
        os.execvpe(req["argv"][0], req["argv"], req["env"])
    except BaseException as exc:  # noqa: BLE001 - the result pipe is gone by now
        os.write(2, f"sequester: could not start {req['argv'][0]}: {exc}\n".encode())
    os._exit(127)


def op_files(req: dict[str, Any], fds: list[int]) -> None:
    result = fds[0]
    _enter(req["target"], user="agent", pid=False, cgroup=None)
    action, path = req["action"], req["path"]
    if action == "write":
        data = _read_all(fds[1])
        if req.get("mkdirs"):
            os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, req.get("mode", 0o644))
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, req.get("mode", 0o644))
        finally:
            os.close(fd)
        _report(result, {"ok": True})
    elif action == "read":
        with open(path, "rb") as f:
            data = f.read(req["limit"] + 1)
        if len(data) > req["limit"]:
            raise OSError(errno.EFBIG, f"{path} is larger than {req['limit']} bytes")
        _report(result, {"data": base64.b64encode(data).decode()})
    elif action == "list":
        entries = []
        for name in sorted(os.listdir(path))[:10000]:
            full = os.path.join(path, name)
            st = os.lstat(full)
            kind = "link" if stat.S_ISLNK(st.st_mode) else "dir" if stat.S_ISDIR(st.st_mode) else "other"
            entries.append([name, kind, os.readlink(full) if kind == "link" else None])
        _report(result, {"entries": entries})
    elif action == "extract":
        os.makedirs(path, exist_ok=True)
        _extract(_read_all(fds[1]), path, req.get("policy", "tar"))
        _report(result, {"ok": True})
    elif action == "pack":
        _report(result, {"missing": _pack(req["paths"], req.get("exclude", {}), fds[1])})
    else:
        raise ValueError(f"unknown file action {action!r}")


def op_verify(req: dict[str, Any], fds: list[int]) -> None:
    result, tests, output, runner_pipe = fds[:4]
    _enter(req["target"], user="parent", pid=False, cgroup=None)
    _die_with_parent(os.getppid())
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWPID), "unshare(mount, pid)")
    _check(_libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
    _check_runner(req["runner"])
    for point in (b"/tests", b"/logs"):
        _check(_libc.mount(b"tmpfs", point, b"tmpfs", 0, b"mode=0755,size=1g"), f"mount tmpfs on {point.decode()}")
    run = req["runner"]["run"]
    _check(_libc.mount(b"tmpfs", run.encode(), b"tmpfs", 0, b"mode=0755,size=2g"), f"mount tmpfs on {run}")
    for folder in ("home/.local/bin", "cache", "tools"):
        os.makedirs(f"{run}/{folder}", 0o755)
    with open(f"{run}/home/.local/bin/env", "w") as f:  # what TB2 scripts source after the uv installer
        f.write(req["runner"]["home_env"])
    os.mkdir("/logs/verifier", 0o777)
    os.chmod("/logs/verifier", 0o777)
    _extract(_read_all(tests), "/tests", "data")
    os.close(tests)
    init = os.fork()
    if init == 0:
        _verifier_init(req, result, output, runner_pipe)
    for fd in (output, result, runner_pipe):
        os.close(fd)
    _, status = os.waitpid(init, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def _check_runner(runner: dict[str, Any]) -> None:
    """The runner's tree must be the host's folder, mounted read-only where its programs
    expect it: the agent could never write either, so fail closed if anything else is
    there."""
    path = runner["mount"]
    st, vfs = os.stat(path), os.statvfs(path)
    if (st.st_dev, st.st_ino) != (runner["dev"], runner["ino"]) or not vfs.f_flag & os.ST_RDONLY:
        raise OSError(errno.EPERM, f"the verifier's runner is not mounted read-only at {path}")


def _verifier_init(req: dict[str, Any], result: int, output: int, runner_pipe: int) -> None:
    """PID 1 of the verifier's namespace: run the script, reap, read the verdict, report."""
    try:
        _die_with_parent(None)
        for point in sorted(req.get("proc_submounts", []), key=len, reverse=True):
            _libc.umount2(point.encode(), MNT_DETACH)
        _check(_libc.mount(b"proc", b"/proc", b"proc", 0, None), "mount /proc")
        script = os.fork()
        if script == 0:
            try:
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
                _restrict(base64.b64decode(req["seccomp"]), req["seccomp_nr"], req["caps"])
                os.execvpe(req["argv"][0], req["argv"], req["env"])
            except BaseException as exc:  # noqa: BLE001
                os.write(2, f"sequester: the verifier could not start: {exc}\n".encode())
                os._exit(127)
        os.close(output)
        os.close(runner_pipe)
        status = None
        while True:  # reap everything; note the script's own status
            try:
                pid, st = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            if pid == script:
                status = st
                break
        _report(result, {"exit_code": os.waitstatus_to_exitcode(status) if status is not None else None,
                         "files": _verdict_files()})
    except BaseException as exc:  # noqa: BLE001
        _report(result, {"error": f"{type(exc).__name__}: {exc}"})
    os._exit(0)


def _verdict_files() -> dict[str, str]:
    """Regular files directly in /logs/verifier (no symlinks), base64, size-capped."""
    out: dict[str, str] = {}
    for name in sorted(os.listdir("/logs/verifier"))[:64]:
        path = f"/logs/verifier/{name}"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            data = os.read(fd, _FILE_LIMIT + 1)
        finally:
            os.close(fd)
        if len(data) <= _FILE_LIMIT:
            out[name] = base64.b64encode(data).decode()
    return out


_OPS = {"spawn": op_spawn, "files": op_files, "verify": op_verify}


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
                    _report(fds[0], {"error": f"{type(exc).__name__}: {exc}"})
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
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    serve(sock)


if __name__ == "__main__":
    main()
