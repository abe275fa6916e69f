"""The one exception tree of sequester.

Everything the library raises on purpose derives from :class:`SequesterError`, so a
caller can catch the whole family at once. What a *program inside* a kernel does
wrong (raises, times out, is blocked) is not an exception on the host: it comes back
as a :class:`sequester.CellResult` with an ``error``.

    SequesterError
    ├── PolicyError              bad configuration; names the key or value
    ├── SandboxUnavailableError  isolation was required but namespaces cannot be made here
    ├── SandboxError             launching or staging a sandbox failed (nothing was left running)
    ├── TaskError                a task directory is malformed; names the file and field
    ├── ImageError               an image cannot be had, unpacked or used; names the reference and why
    │   └── BuildError           a Dockerfile sequester cannot build; names the line and why
    │       └── BuildTimeout     the build outlived its deadline
    ├── KernelError              misuse of a kernel or a kernel that cannot go on
    │   └── KernelClosedError    the kernel was closed (or its lifetime ran out)
    ├── EpisodeError             an episode used out of order, or given a bad working directory
    ├── PoolFull                 an episode pool had no slot within its wait, or too many callers waited
    └── VerifierError            no verdict (sequester.environments.verdict); "tests ran and
        ├── VerifierCouldNotRun      failed" is a reward of 0, never one of these
        ├── VerifierTimeout
        ├── RewardFileMissing
        └── RewardInvalid
"""

from __future__ import annotations

__all__ = [
    "SequesterError",
    "PolicyError",
    "SandboxUnavailableError",
    "SandboxError",
    "KernelError",
    "KernelClosedError",
    "TaskError",
    "ImageError",
    "BuildError",
    "BuildTimeout",
    "EpisodeError",
    "PoolFull",
    "TaskNotCalibrated",
]


class SequesterError(Exception):
    """Base class of every error sequester raises on purpose."""


class PolicyError(SequesterError, ValueError):
    """A policy (TOML file, CLI flag or API argument) is invalid.

    The message always names the offending key and value, e.g.
    ``runtime.allow[1]: 'example.com' is not HOST:PORT or a URL``.
    """


class SandboxUnavailableError(SequesterError):
    """``isolation = true`` was asked for, but user namespaces do not work here."""


class SandboxError(SequesterError):
    """Starting, staging or tearing down a sandbox failed.

    Raised only after everything the failed step started has been stopped: fail closed.
    """


class TaskError(SequesterError, ValueError):
    """A task directory is malformed; the message names the file and field.

    e.g. ``task.toml: [verifier] timeout_sec: 'abc' is not a positive number`` or
    ``environment/Dockerfile:7: source '../secret' is outside the build context``.
    """


class KernelError(SequesterError):
    """A kernel was used wrongly or cannot continue."""


class KernelClosedError(KernelError):
    """The kernel is closed: it was closed, never opened, or its lifetime ran out."""


class ImageError(SequesterError, ValueError):
    """An image cannot be pulled, imported, unpacked or used (unknown reference,
    unreachable registry, digest mismatch, malformed or hostile layer, no manifest for
    this platform). The message names the reference or layer and the reason; nothing
    half-made is ever left in the store."""


class BuildError(ImageError):
    """A Dockerfile that is malformed, or asks for something sequester does not do.

    A subclass of :class:`ImageError` because a build is one more way of getting an
    image: code that already catches ``ImageError`` (the CLI, an episode's image
    resolution) then catches build failures too, without knowing about builds. The
    message starts with ``"<source>:<line>: "`` and names the instruction, e.g.
    ``Dockerfile:4: RUN --mount is a BuildKit feature sequester does not support``.
    """


class BuildTimeout(BuildError):
    """The build outlived its deadline (the task's ``[environment] build_timeout_sec``)."""


class EpisodeError(SequesterError):
    """An episode was used out of order (exec before reset, after close, ...), or given a
    working directory that is not an absolute path."""


class PoolFull(SequesterError):
    """An episode pool (:class:`sequester.environments.pool.EpisodePool`) is at capacity and
    the caller could not wait: ``max_waiting`` callers wait already, or no slot came free
    within ``wait_timeout``. The message names the numbers. (The Ray backend's is also a
    ``ClusterError``, as its refusals were.)"""


class TaskNotCalibrated(SequesterError):
    """The task, on this machine's system and settings, does not score as it must when
    calibrated (its oracle below full marks, its nop above 0, or an error), or cannot be
    calibrated (no solution) where calibration is required: an environment error that
    retries do not repeat, never an agent's verdict (see :mod:`sequester.calibration`)."""
