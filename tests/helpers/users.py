"""Throw-away system users for tests that run something as an ordinary user (root only).

:func:`temporary_user` creates the user (and its home) and removes both afterwards, with
any process of the user still running; a user of that name left behind by an earlier run
(recognised by ``leftover``) is taken over and removed the same way. A user it did not
create and does not recognise is used as it is and kept.
"""

from __future__ import annotations

import os
import pwd
import signal
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["SEQTEST_USER", "temporary_user", "user_exists", "kill_processes_of"]

# The suite's ordinary user (conftest's ``seqtest_user`` fixture): made for a session, removed at its end.
SEQTEST_USER = "seqtest"


def user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


@contextmanager
def temporary_user(name: str, *, leftover: Callable[[pwd.struct_passwd], bool] = lambda entry: False,
                   create_home: bool = True) -> Iterator[pwd.struct_passwd]:
    """The user ``name`` for the duration of the block; removed at its end (``userdel -r``)
    if this created it or ``leftover(entry)`` says an earlier run of the tests did."""
    if user_exists(name):
        entry = pwd.getpwnam(name)
        ours = leftover(entry)
    else:
        argv = ["useradd", "--shell", "/bin/sh", "--user-group", "--create-home" if create_home else "--no-create-home"]
        subprocess.run([*argv, name], check=True, capture_output=True)
        entry, ours = pwd.getpwnam(name), True
    try:
        yield entry
    finally:
        if ours:
            remove_user(entry)


def remove_user(entry: pwd.struct_passwd) -> None:
    """Stop the user's processes, delete the user, its group and its home."""
    kill_processes_of(entry.pw_uid)
    # --force: a killed process nobody has waited for yet (a zombie) still counts as the
    # user's, and would make userdel refuse.
    subprocess.run(["userdel", "--force", "--remove", entry.pw_name], capture_output=True, check=False)
    if os.path.isdir(entry.pw_dir) and entry.pw_dir.startswith("/home/") and not user_exists(entry.pw_name):
        subprocess.run(["rm", "-rf", "--one-file-system", entry.pw_dir], check=False)


def kill_processes_of(uid: int) -> None:
    """SIGKILL every process whose owner is ``uid`` (by pid; never uid 0)."""
    if uid == 0:
        raise ValueError("refusing to kill root's processes")
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
