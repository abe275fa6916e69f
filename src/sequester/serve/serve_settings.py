"""The ``[serve]`` table of a config file: plain frozen data for ``sequester serve``.

    [serve]
    host = "127.0.0.1"             # loopback by default; anything else needs an explicit token
    port = 8000
    token = "..."                  # else $SEQUESTER_SERVE_TOKEN, else one is generated and printed
    tasks_dir = "tasks"            # the tasks episode sessions may name (relative: to this file)
    max_sessions = 16              # live sessions (episodes and kernels) at once
    kernel_pool = 0                # kernels kept started for kernel sessions (0: each starts its own)
    kernel_init = "import numpy"   # the pool's kernels are forks of a warm kernel that ran this once
    episode_pool = {python-csv-stats = 2}   # episodes kept started per task, for episode sessions
    idle_timeout = 600             # seconds without a frame before a connection and its session close
    max_message_bytes = 16777216   # one WebSocket message or HTTP body, at most
    progress_interval = 10         # seconds between keep-alive progress frames (clients opt in)
    ping_interval = 20             # WebSocket pings, to find half-open connections
    ping_timeout = 20              # a pong later than this closes the connection
    calibration = "auto"           # auto | required | off: see sequester.calibration (required:
                                   # a task without a calibrated record is refused)

Validated here so that ``sequester serve --config`` rejects a typo the way every other
command rejects one (:mod:`sequester.config`): the message names the key.
"""

from __future__ import annotations

import dataclasses
import math
import string
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sequester.errors import PolicyError

__all__ = ["ServeSettings", "check_token", "MIN_TOKEN_CHARS"]

# A bearer token shorter than this could be guessed by a client that just keeps trying
# (the server does not rate-limit wrong tokens; 16 URL-safe characters are 96 bits).
MIN_TOKEN_CHARS = 16
_TOKEN_CHARS = frozenset(string.ascii_letters + string.digits + "-._~+/=")


def check_token(token: object, where: str) -> str:
    """``token`` if it can be a bearer token (RFC 6750's characters, long enough), else a
    :class:`PolicyError` naming ``where`` (never the token itself: it may be a near-miss of
    the real one and land in a log)."""
    if not isinstance(token, str):
        raise PolicyError(f"{where}: the token is not a string")
    if len(token) < MIN_TOKEN_CHARS:
        raise PolicyError(f"{where}: the token has {len(token)} characters; at least {MIN_TOKEN_CHARS} are needed")
    if not set(token) <= _TOKEN_CHARS:
        raise PolicyError(f"{where}: the token may hold only letters, digits and -._~+/=")
    return token


@dataclass(frozen=True)
class ServeSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    token: str | None = dataclasses.field(default=None, repr=False)  # never in a repr, so never in a log
    tasks_dir: Path | None = None
    max_sessions: int = 16
    kernel_pool: int = 0
    kernel_init: str | None = None
    episode_pool: dict[str, int] = dataclasses.field(default_factory=dict, hash=False)
    idle_timeout: float = 600.0
    max_message_bytes: int = 16 * 1024 * 1024
    progress_interval: float = 10.0
    ping_interval: float = 20.0
    ping_timeout: float = 20.0
    calibration: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise PolicyError(f"serve.host: {self.host!r} is not a host name or address")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise PolicyError(f"serve.port: {self.port!r} is not a port (0-65535)")
        if self.token is not None:
            check_token(self.token, "serve.token")
        for name, kind in (
            ("max_sessions", int),
            ("max_message_bytes", int),
            ("idle_timeout", float),
            ("progress_interval", float),
            ("ping_interval", float),
            ("ping_timeout", float),
        ):
            value = getattr(self, name)
            number_ok = isinstance(value, int) if kind is int else isinstance(value, (int, float))
            if isinstance(value, bool) or not number_ok or not math.isfinite(value) or value <= 0:
                raise PolicyError(f"serve.{name}: {value!r} is not a positive {'whole ' * (kind is int)}number")
        if isinstance(self.kernel_pool, bool) or not isinstance(self.kernel_pool, int) or self.kernel_pool < 0:
            raise PolicyError(f"serve.kernel_pool: {self.kernel_pool!r} is not a whole number of kernels (0: none)")
        if self.kernel_init is not None:
            if not isinstance(self.kernel_init, str):
                raise PolicyError(f"serve.kernel_init: {self.kernel_init!r} is not Python code (a string)")
            try:
                compile(self.kernel_init, "<serve.kernel_init>", "exec")
            except (SyntaxError, ValueError) as exc:
                raise PolicyError(f"serve.kernel_init is not valid Python: {exc}") from None
            if not self.kernel_pool:
                raise PolicyError("serve.kernel_init needs serve.kernel_pool (its forks are the pool's kernels)")
        if not isinstance(self.episode_pool, Mapping):
            raise PolicyError(f"serve.episode_pool: {self.episode_pool!r} is not a table of task ids to episode counts")
        pool = {}
        for task, n in self.episode_pool.items():
            if not isinstance(task, str) or not task:
                raise PolicyError(f"serve.episode_pool: {task!r} is not a task id")
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise PolicyError(f"serve.episode_pool.{task}: {n!r} is not a whole number of episodes (0: none)")
            pool[task] = n
        object.__setattr__(self, "episode_pool", pool)  # a copy of its own
        if sum(pool.values()) > self.max_sessions:
            raise PolicyError(
                f"serve.episode_pool: {sum(pool.values())} episodes kept warm is more than max_sessions "
                f"({self.max_sessions}), the episode pool's capacity"
            )
        if self.calibration not in ("auto", "required", "off"):
            raise PolicyError(f"serve.calibration: {self.calibration!r} is not auto, required or off")
        if self.tasks_dir is not None:
            object.__setattr__(self, "tasks_dir", Path(self.tasks_dir))
