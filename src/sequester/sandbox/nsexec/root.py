"""The verifier's own root folder, built by the namespace helper's worker in the
verifier's private copy of the agent's mount namespace (see :mod:`.server`).

The agent's view stays what the tests run against: every top-level folder of the agent's
root is bound into the new root as it is, and every top-level link is copied as the link
it is. What the runner itself reads by fixed absolute path comes from the verifier's side:

* the root folder itself is a fresh tmpfs: a ``pytest.ini``, ``conftest.py`` or any other
  file the agent put at ``/`` is not there (top-level files are not part of a task's
  environment), and the agent's live processes cannot change the verifier's top-level
  links while it runs;
* ``/tests`` and ``/logs`` are fresh tmpfs; ``/proc`` is the verifier's own (its init
  mounts it over the agent's); ``/dev`` is a fresh tmpfs with only the standard device nodes, taken from
  the agent's view only when they really are those devices (nobody can create a device
  node in a user namespace, so a character device 1:3 is the host's ``/dev/null``; it is
  checked and bound through one descriptor, so it cannot be swapped in between);
* ``/bin``: uv starts the tests' console scripts (``pytest``) through ``#!/bin/sh``, reads
  the loader named in ``/bin/sh`` (then ``/usr/bin/env``, ``/bin/dash``, ``/bin/ls``) to
  learn the C library's version and runs it, and ``system()``, ``popen()`` and Python's
  ``shell=True`` all run ``/bin/sh``. The verifier's ``/bin`` is a folder of its own root:
  an overlay of the agent's ``/bin`` (when that leads to ``/usr/bin`` or is a folder) in
  which those names are the runner's programs, checked before anything runs. The same
  overlay keeps what the tests write there out of the agent's view.
"""

from __future__ import annotations

import errno
import os
import stat

from sequester.sandbox.nsexec.ns import MNT_DETACH, MS_REC, check, libc

__all__ = ["build_root", "RUNNER_SHELL_NAMES", "ROOT_SIZE"]

MS_BIND, MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1000, 1, 2, 4, 8
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
_DEVICES = {"null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8), "urandom": (1, 9), "tty": (5, 0)}
# The verifier's own, never the agent's. (/proc is bound like the rest, then the verifier's
# init mounts its own over it: the kernel lets a user namespace mount a procfs only over a
# visible one.) A top-level entry of the agent's with one of these names is left out.
_OWN = ("tests", "logs", "dev", "bin", ".sequester")
# Names in /bin that the runner's programs run by absolute path.
RUNNER_SHELL_NAMES = {"sh": "bash", "dash": "bash", "ls": "ls", "env": "env"}
# Each bound folder is a mount (and the kernel caps a namespace's mounts): the agent's
# top-level entries beyond this many are left out, with a note.
MAX_TOP_ENTRIES = 512
# Where /bin may lead in the agent's view for its content to stay visible under the
# verifier's /bin: the usual places. Anything else (/, /opt, /proc, /tmp/x) gives a /bin
# holding only the runner's programs: the agent's odd layout is its own loss.
_BIN_TARGETS = ("/usr/bin", "/bin")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    check(
        libc.mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            flags,
            data.encode() if data else None,
        ),
        f"mount {target}",
    )


ROOT_SIZE = 1 << 30  # what the tests make at the verifier's top level (/jail), together


def build_root(staging: str, runner_bin: str, run: str, run_size: int) -> list[str]:
    """Build the new root at ``staging`` (a mount point), pivot into it. ``run`` is the
    runner's private folder (mounted here, ``run_size``); the root's own top level holds
    :data:`ROOT_SIZE` (each a tmpfs: memory, only as used).
    The verifier's own mounts come first (the agent cannot make them fail by using up the
    namespace's mounts); then the agent's top-level entries. Returns notes (what of the agent's root was left out)."""
    notes: list[str] = []
    agent_bin = _agent_bin()
    # Its own top level holds what the tests make there (path-tracing's `mkdir /jail`, a
    # 48 MB image written into it: 16 MiB cut it short, the oracle's 0).
    _mount("tmpfs", staging, "tmpfs", MS_NOSUID, f"mode=0755,size={ROOT_SIZE}")
    for name in _OWN:
        os.mkdir(os.path.join(staging, name), 0o755)
    for name in ("tests", "logs"):
        _mount("tmpfs", os.path.join(staging, name), "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1g")
    _populate_dev(os.path.join(staging, "dev"))
    _bin(os.path.join(staging, "bin"), os.path.join(staging, ".sequester"), agent_bin, runner_bin)
    entries = sorted(os.scandir("/"), key=lambda e: e.name)
    if len(entries) > MAX_TOP_ENTRIES:
        notes.append(
            f"the agent's root has {len(entries)} entries: only the first {MAX_TOP_ENTRIES} are in the verifier's root"
        )
    for entry in entries[:MAX_TOP_ENTRIES]:
        name, target = entry.name, os.path.join(staging, entry.name)
        if name in _OWN or name == os.path.basename(staging.rstrip("/")):
            continue
        try:
            if entry.is_symlink():
                os.symlink(os.readlink(entry.path), target)
            elif entry.is_dir(follow_symlinks=False):
                os.mkdir(target, 0o755)
                _mount(entry.path, target, None, MS_BIND | MS_REC)
            else:
                notes.append(f"/{name!r} (not a folder or link) is not in the verifier's root")
        except OSError as exc:  # the agent changed its root meanwhile: the verifier does without
            notes.append(f"/{name!r} is not in the verifier's root: {exc.strerror}")
    # pivot_root(".", "."): the old root ends up on top of the new one and is detached at
    # once; no folder of the new root is needed for it (nor can one be in the way).
    arch = os.uname().machine
    if arch not in _SYS_PIVOT_ROOT:
        raise OSError(errno.ENOSYS, f"pivot_root: no syscall number for {arch}")
    os.chdir(staging)
    check(libc.syscall(_SYS_PIVOT_ROOT[arch], b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")
    _mount("tmpfs", run, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0755,size={run_size}")
    _check_shell(runner_bin)
    return notes


def _agent_bin() -> str | None:
    """Where the agent's /bin leads, if it is one of the usual places (see _BIN_TARGETS)."""
    try:
        folder = os.path.realpath("/bin")
    except OSError:
        return None
    return folder if folder in _BIN_TARGETS and os.path.isdir(folder) else None


def _bin(target: str, scratch: str, agent_bin: str | None, runner_bin: str) -> None:
    """The verifier's /bin, a folder of its own root: an overlay of the agent's (when it
    leads to a usual place) in which :data:`RUNNER_SHELL_NAMES` are the runner's programs."""
    _mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0700,size=1m")
    upper, work = os.path.join(scratch, "bin-upper"), os.path.join(scratch, "bin-work")
    os.mkdir(upper, 0o755)
    os.mkdir(work, 0o700)
    for name, program in RUNNER_SHELL_NAMES.items():
        os.symlink(os.path.join(runner_bin, program), os.path.join(upper, name))
    if agent_bin is None:
        _mount(upper, target, None, MS_BIND)
    else:
        _mount("overlay", target, "overlay", 0, f"lowerdir={agent_bin},upperdir={upper},workdir={work}")


def _check_shell(runner_bin: str) -> None:
    """Fail closed unless /bin/sh is the runner's shell."""
    ours, there = os.stat(os.path.join(runner_bin, RUNNER_SHELL_NAMES["sh"])), os.stat("/bin/sh")
    if (there.st_dev, there.st_ino) != (ours.st_dev, ours.st_ino):
        raise OSError(errno.EPERM, "the verifier's /bin/sh is not the runner's shell")


_SYS_OPEN_TREE, _SYS_MOVE_MOUNT = 428, 429  # the same on x86_64 and aarch64
_OPEN_TREE_CLONE, _AT_EMPTY_PATH, _AT_FDCWD, _MOVE_MOUNT_F_EMPTY_PATH = 1, 0x1000, -100, 4


def _bind_fd(fd: int, target: str) -> None:
    """Bind what ``fd`` is (checked already) at ``target``: by descriptor, so the agent
    cannot swap the path between the check and the mount."""
    tree = libc.syscall(_SYS_OPEN_TREE, fd, b"", _OPEN_TREE_CLONE | _AT_EMPTY_PATH | os.O_CLOEXEC)
    if tree < 0:
        check(-1, f"open_tree for {target}")
    attach_tree(tree, target)


def clone_tree(fd: int) -> int | None:
    """A detached copy of the mount at ``fd`` (a folder), to attach later in another
    mount namespace (:func:`attach_tree`); None where this process may not make one (an
    ordinary user's, of a host folder)."""
    tree = libc.syscall(_SYS_OPEN_TREE, fd, b"", _OPEN_TREE_CLONE | _AT_EMPTY_PATH | os.O_CLOEXEC)
    return tree if tree >= 0 else None


def attach_tree(tree: int, target: str) -> None:
    """Put the detached mount ``tree`` at ``target`` (and close it)."""
    try:
        check(
            libc.syscall(_SYS_MOVE_MOUNT, tree, b"", _AT_FDCWD, target.encode(), _MOVE_MOUNT_F_EMPTY_PATH),
            f"move_mount to {target}",
        )
    finally:
        os.close(tree)


def _populate_dev(dev: str) -> None:
    _mount("tmpfs", dev, "tmpfs", MS_NOSUID, "mode=0755,size=64k")
    for name, (major, minor) in _DEVICES.items():
        try:
            fd = os.open(f"/dev/{name}", os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISCHR(st.st_mode) or (os.major(st.st_rdev), os.minor(st.st_rdev)) != (major, minor):
                continue  # the agent replaced it: only a real device node is taken
            with open(os.path.join(dev, name), "w"):
                pass
            _bind_fd(fd, os.path.join(dev, name))
        finally:
            os.close(fd)
    for name, link in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
    ):
        os.symlink(link, os.path.join(dev, name))
    os.mkdir(os.path.join(dev, "pts"), 0o755)
    _mount("devpts", os.path.join(dev, "pts"), "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=620")
    os.mkdir(os.path.join(dev, "shm"), 0o1777)
    _mount("tmpfs", os.path.join(dev, "shm"), "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=256m")
