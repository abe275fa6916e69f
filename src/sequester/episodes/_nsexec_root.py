"""The verifier's own root folder, built by the namespace helper's worker in the
verifier's private copy of the agent's mount namespace (see :mod:`._nsexec_server`).

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
  node in a user namespace, so a character device 1:3 is the host's ``/dev/null``);
* ``/bin/sh``: uv starts the tests' console scripts (``pytest``) through ``#!/bin/sh``,
  reads the loader named in ``/bin/sh`` (then ``/usr/bin/env``, ``/bin/dash``, ``/bin/ls``)
  to learn the C library's version and runs it, and ``system()``, ``popen()`` and Python's
  ``shell=True`` all run ``/bin/sh``. The folder ``/bin`` leads to gets a private overlay
  in which those names are the runner's own programs. The same overlay keeps what the
  tests write there out of the agent's view.
"""

from __future__ import annotations

import errno
import os
import stat

from ._nsexec_ns import MNT_DETACH, MS_REC, check, libc

__all__ = ["build_root", "RUNNER_SHELL_NAMES"]

MS_BIND, MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1000, 1, 2, 4, 8
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
_DEVICES = {"null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8), "urandom": (1, 9), "tty": (5, 0)}
# The verifier's own, never the agent's. (/proc is bound like the rest, then the verifier's
# init mounts its own over it: the kernel lets a user namespace mount a procfs only over a
# visible one.)
_OWN = ("tests", "logs", "dev")
# Names in the folder /bin leads to that the runner's programs run by absolute path.
RUNNER_SHELL_NAMES = {"sh": "bash", "dash": "bash", "ls": "ls", "env": "env"}
_OLD = ".sequester-old-root"


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    check(libc.mount(source.encode() if source else None, target.encode(), fstype.encode() if fstype else None,
                     flags, data.encode() if data else None), f"mount {target}")


def build_root(staging: str, runner_bin: str, run: str) -> list[str]:
    """Build the new root at ``staging`` (a mount point), pivot into it, give ``/bin``'s
    folder its overlay. ``run`` is the runner's private scratch folder (mounted here).
    Returns notes (what of the agent's root was left out)."""
    notes: list[str] = []
    _mount("tmpfs", staging, "tmpfs", MS_NOSUID, "mode=0755,size=16m")
    for entry in os.scandir("/"):
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
    for name in _OWN:
        os.mkdir(os.path.join(staging, name), 0o755)
    for name in ("tests", "logs"):
        _mount("tmpfs", os.path.join(staging, name), "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1g")
    _populate_dev(os.path.join(staging, "dev"))
    os.mkdir(os.path.join(staging, _OLD), 0o700)
    arch = os.uname().machine
    if arch not in _SYS_PIVOT_ROOT:
        raise OSError(errno.ENOSYS, f"pivot_root: no syscall number for {arch}")
    check(libc.syscall(_SYS_PIVOT_ROOT[arch], staging.encode(), os.path.join(staging, _OLD).encode()), "pivot_root")
    os.chdir("/")
    check(libc.umount2(f"/{_OLD}".encode(), MNT_DETACH), "detach the old root")
    os.rmdir(f"/{_OLD}")
    _mount("tmpfs", run, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=2g")
    _shell_overlay(runner_bin, run)
    return notes


def _populate_dev(dev: str) -> None:
    _mount("tmpfs", dev, "tmpfs", MS_NOSUID, "mode=0755,size=64k")
    for name, (major, minor) in _DEVICES.items():
        source = f"/dev/{name}"
        try:
            st = os.stat(source, follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISCHR(st.st_mode) or (os.major(st.st_rdev), os.minor(st.st_rdev)) != (major, minor):
            continue  # the agent replaced it: only a real device node is taken
        with open(os.path.join(dev, name), "w"):
            pass
        _mount(source, os.path.join(dev, name), None, MS_BIND)
    for name, link in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                       ("stderr", "/proc/self/fd/2"), ("ptmx", "pts/ptmx")):
        os.symlink(link, os.path.join(dev, name))
    os.mkdir(os.path.join(dev, "pts"), 0o755)
    _mount("devpts", os.path.join(dev, "pts"), "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=620")
    os.mkdir(os.path.join(dev, "shm"), 0o1777)
    _mount("tmpfs", os.path.join(dev, "shm"), "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=256m")


def _shell_overlay(runner_bin: str, run: str) -> None:
    """A private overlay on the folder ``/bin`` leads to, in which the names of
    :data:`RUNNER_SHELL_NAMES` are links to the runner's programs."""
    try:
        folder = os.path.realpath("/bin")
        # A path with these would be read as more mount options (the agent chose it).
        if not os.path.isdir(folder) or any(c in folder for c in ",:\\\n") or not folder.isprintable():
            raise FileNotFoundError(folder)
    except OSError:  # the agent removed /bin, broke or bent the link: the verifier's root gets its own
        if os.path.lexists("/bin"):
            os.unlink("/bin")
        folder = "/bin"
        os.mkdir(folder, 0o755)
    upper, work = os.path.join(run, "bin-upper"), os.path.join(run, "bin-work")
    os.mkdir(upper, 0o755)
    os.mkdir(work, 0o700)
    for name, program in RUNNER_SHELL_NAMES.items():
        os.symlink(os.path.join(runner_bin, program), os.path.join(upper, name))
    _mount("overlay", folder, "overlay", 0, f"lowerdir={folder},upperdir={upper},workdir={work}")
