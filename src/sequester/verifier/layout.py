"""Where the runner's tree appears in a view, and its folders. Pure.

The tree is built once per machine on the host (:mod:`.tree`) and mounted read-only at
:data:`RUNNER_MOUNT` in the verifier's private mount namespace, from the host folder
itself, after the agent's namespace was copied: nothing the agent did in its view can
stand at these paths for the verifier. Its programs are patched to load their dynamic
loader and libraries from here, so they run only where the tree is mounted at this path.
"""

from __future__ import annotations

import platform
from pathlib import PurePosixPath

__all__ = [
    "RUNNER_MOUNT",
    "BIN",
    "LIB",
    "LIBEXEC",
    "PYTHONS",
    "WHEELS",
    "ETC",
    "RUN",
    "RUN_HOME",
    "RUN_CACHE",
    "RUN_TOOLS",
    "RUN_PIP",
    "SCRATCH",
    "SCRATCH_CACHE",
    "SCRATCH_TOOLS",
    "TOOL_INDEX",
    "PIP_LINES",
    "PINNED",
    "TASK_WHEELS",
    "TASK_INSTALLS",
    "TASK_LIBS",
]

PINNED = ("pytest==8.4.1", "pytest-json-ctrf==0.3.5")  # the runner's own wheels: pytest for TB2's scripts
RUNNER_MOUNT = PurePosixPath("/opt/sequester-verifier")
BIN = RUNNER_MOUNT / "bin"  # first on the runner's PATH: shell, core tools, uv, python
LIB = RUNNER_MOUNT / "lib"  # the loader and every library the tree's programs load
LIBEXEC = RUNNER_MOUNT / "libexec"  # the real binaries behind the wrappers in bin/
PYTHONS = RUNNER_MOUNT / "python"  # uv's managed installations: cpython-X.Y.Z-linux-ARCH-gnu/
WHEELS = RUNNER_MOUNT / "wheels"  # the pinned wheels uv installs from, offline
ETC = RUNNER_MOUNT / "etc"  # the runner's own configuration files
# An empty folder: a private tmpfs at verify time. What the runner installs for the script
# (sequester.verifier.ahead: its uvx tools, its pip lines) is installed here before the
# script's shell runs anything, and the folder is then read-only for the script and every
# program it starts (see sequester.sandbox.nsexec.server): nothing they run can change
# the test runner of a later step, or of this one.
RUN = RUNNER_MOUNT / "run"
RUN_HOME = RUN / "home"  # HOME of the test script's own shell (read-only: its .local/bin/env)
RUN_CACHE = RUN / "cache"  # uv's cache of what was installed ahead (the uvx tools' environments)
RUN_TOOLS = RUN / "tools"
RUN_PIP = RUN / "pip"  # the environment the runner's pip installed the script's pip lines into
TOOL_INDEX = RUN / "uvx-tools"  # the uvx commands installed ahead: bin folder, command, words
PIP_LINES = RUN_PIP / ".sequester-lines"  # the pip install lines installed ahead, one a line
# A writable mount of its own inside RUN: uv's cache for what the script has uv install
# that could not be read from its text ahead (``uvx -w "$PKG"``, ``uv venv``), installed
# here as the script runs, where the programs it ran before can write (the trial says so).
SCRATCH = RUN / "scratch"
SCRATCH_CACHE = SCRATCH / "cache"
SCRATCH_TOOLS = SCRATCH / "tools"
# A task's own pinned wheels (sequester.verifier.wheels), copied from the host at verify time
# into a read-only tmpfs of the verifier's namespace; only when the task needs them.
TASK_WHEELS = RUN / "task-wheels"
# What the task's apt-get install lines install (sequester.imagebuild.apt_install), copied
# likewise: ``install.tar`` and ``packages`` (one name a line), unpacked by the runner's apt-get.
TASK_INSTALLS = RUN / "apt"
# The shared libraries of those installs and what they need of the task's pristine image
# (sequester.imagebuild.runner_libraries): the host's folder, bound read-only (copied for an
# ordinary user) over an empty folder of the tree, which the runner's loaders search last:
# their built-in system folder ``/usr/lib/<triplet>/`` is rewritten to it, same length (see
# tree.py). Nothing but the runner's loaders looks there; no variable points at it.
_DEFAULT_LIB = f"/usr/lib/{platform.machine()}-linux-gnu/"
TASK_LIBS = RUNNER_MOUNT / ("a" * max(1, len(_DEFAULT_LIB) - len(str(RUNNER_MOUNT)) - 2))
# The host loader's own name (uv tells glibc from musl by it): see tree.py.
