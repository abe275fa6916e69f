"""Run a Python script where user namespaces cannot be created, as inside many containers.

    python tests/helpers/no_userns.py SCRIPT [ARGS...]

Loads a seccomp filter (inherited by every child) that refuses ``unshare`` and ``clone``
with CLONE_NEWUSER and makes ``clone3`` fall back to ``clone``: the same restriction
Docker's default profile imposes. Then runs SCRIPT as ``__main__``.
"""

import errno
import runpy
import sys

import pyseccomp as sc

CLONE_NEWUSER = 0x10000000

flt = sc.SyscallFilter(sc.ALLOW)
flt.add_rule(sc.ERRNO(errno.EPERM), "unshare", sc.Arg(0, sc.MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER))
flt.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER))
flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
flt.load()
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
