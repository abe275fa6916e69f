"""``sequester serve``: episodes and kernels for trainers and remote harnesses (OpenEnv's protocol).

Binds loopback by default. The bearer token comes from ``--token-file``,
``$SEQUESTER_SERVE_TOKEN`` or ``[serve] token``, else it is generated and printed once on
standard error. Exit status: 0 after a clean shutdown (SIGTERM, Ctrl-C: every session is
closed first); 2 bad input (a flag, the config, the tasks folder or one of its tasks, the
token, a non-loopback ``--host`` without an explicit token); 3 the address cannot be
listened on.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import signal
import socket
import sys
from pathlib import Path

from sequester.cli.backend import add_backend_arguments, apply_backend_arguments
from sequester.cli.common import positive
from sequester.cli.network import add_network_arguments, apply_network_arguments
from sequester.config import load_config
from sequester.errors import PolicyError, SequesterError
from sequester.images.image_settings import IMAGE_SOURCES
from sequester.tasks.finder import has_task_toml

__all__ = ["add_serve_command", "cmd_serve"]

log = logging.getLogger("sequester.serve")


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0-65535)")
    return int(text)


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket (bound here, so that ``--port 0`` can be printed as the port it got)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        raise SequesterError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def _warm(text: str) -> tuple[str, int]:
    """``TASK=N`` of ``--episode-pool``."""
    task, sep, count = text.rpartition("=")
    if not sep or not task or not count.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not TASK=N (a task id of the tasks folder, a number)")
    return task, int(count)


def _loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback one (unresolvable: not loopback)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


def _read_init(path: str) -> str:
    """``--kernel-init FILE``'s code: UTF-8 text (exit 2 naming the file otherwise)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError(f"--kernel-init {path!r}: cannot be read as UTF-8 text ({exc})") from None


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from sequester.environments.local.capacity import shortfalls
    from sequester.serve.app import count_tasks, create_app, uvicorn_config
    from sequester.serve.auth import load_token

    config = load_config(args.config)
    overrides = {
        "host": args.host,
        "port": args.port,
        "max_sessions": args.max_sessions,
        "kernel_pool": args.kernel_pool,
        "kernel_init": _read_init(args.kernel_init) if args.kernel_init else None,
        "episode_pool": {**config.serve.episode_pool, **dict(args.episode_pool)} if args.episode_pool else None,
        "idle_timeout": args.idle_timeout,
        "tasks_dir": Path(args.tasks_dir) if args.tasks_dir else None,
        "calibration": args.calibration,
    }
    settings = dataclasses.replace(config.serve, **{k: v for k, v in overrides.items() if v is not None})
    episodes = config.episodes
    if args.image_source:
        episodes = dataclasses.replace(episodes, images=dataclasses.replace(episodes.images, source=args.image_source))
    episodes = apply_backend_arguments(args, episodes)
    episodes = apply_network_arguments(args, episodes)
    if settings.tasks_dir is not None and not settings.tasks_dir.is_dir():
        raise PolicyError(f"--tasks-dir {str(settings.tasks_dir)!r}: not a folder")
    if settings.tasks_dir is not None and has_task_toml(settings.tasks_dir):
        raise PolicyError(f"--tasks-dir {str(settings.tasks_dir)!r} is a task: give the folder of tasks it is in")
    config = dataclasses.replace(config, serve=settings, episodes=episodes)
    tasks = count_tasks(settings.tasks_dir)  # a malformed task is exit 2 now, not a client's error later
    token = load_token(args.token_file, settings)
    if not _loopback(settings.host):
        # Attack stopped: a server reachable from the network whose token only its
        # terminal ever saw is still a server on the network; and the token travels in
        # plain text, so whoever listens on the way can use it.
        if token.generated:
            raise PolicyError(
                f"--host {settings.host!r} is not a loopback address: set the token explicitly "
                "(--token-file, $SEQUESTER_SERVE_TOKEN or [serve] token) to serve beyond this machine"
            )
        log.warning(
            "serving on %s, beyond this machine: HTTP is plain text, so put a TLS proxy in front", settings.host
        )
    hide = tuple(Path(f).resolve() for f in (token.file, args.config) if f is not None)
    app = create_app(config, token=token.value, hide=hide, tasks=tasks)
    sock = _listen(settings.host, settings.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    err = sys.stderr
    err.write(
        f"sequester serve: http://{shown}:{port} ({tasks} task{'s' * (tasks != 1)}, up to "
        f"{settings.max_sessions} sessions; token from {token.source})\n"
    )
    if token.generated:  # printed once, here: nowhere else, in no log
        err.write(f"sequester serve: token: {token.value}\n")
    if episodes.backend == "local":
        # Whether this process and machine could hold every session at once, said now rather
        # than at the reset that finds out (each reset still refuses, naming the limit).
        short = shortfalls(settings.max_sessions, session=True)
        if short:
            err.write(
                f"sequester serve: warning: {settings.max_sessions} sessions with an episode each would not fit "
                f"here at once (the resets beyond will be refused): {'; '.join(short)}\n"
            )
    err.flush()
    if logging.getLogger().level > logging.INFO:
        log.setLevel(logging.INFO)  # one line per session event is the server's log
    verbose = logging.getLogger().level <= logging.INFO
    server = uvicorn.Server(uvicorn_config(app, settings, access_log=verbose))
    # uvicorn shuts down gracefully on SIGTERM and SIGINT (every session closed), then
    # raises the signal again for the handler it found: a quiet one, so a clean stop is
    # exit 0 (Ctrl-C too: Python's own SIGINT handler would make it 130).
    stops = (signal.SIGTERM, signal.SIGINT)
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in stops}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def add_serve_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve episodes and kernels over OpenEnv's protocol (HTTP + WebSocket)")
    p.add_argument("--host", metavar="HOST", help="address to listen on (default: [serve] host, 127.0.0.1)")
    p.add_argument("--port", type=_port, metavar="PORT", help="port (default: [serve] port, 8000; 0: any free one)")
    p.add_argument(
        "--tasks-dir",
        metavar="DIR",
        help="the folder of tasks episode sessions may name (default: [serve] tasks_dir; none: kernel sessions only)",
    )
    p.add_argument(
        "--image-source", choices=list(IMAGE_SOURCES), help="what each episode runs on (default: [images] source)"
    )
    add_backend_arguments(p)
    add_network_arguments(p)
    p.add_argument(
        "--max-sessions",
        type=positive(int),
        metavar="N",
        help="live sessions at once; a reset beyond is refused (default: [serve] max_sessions, 16)",
    )
    p.add_argument(
        "--calibration",
        choices=["auto", "required", "off"],
        help="a task whose calibration (sequester calibrate, with this server's settings) fails is refused at "
        "reset; required: one without a calibration too (default: [serve] calibration, auto)",
    )
    p.add_argument(
        "--kernel-pool",
        type=positive(int),
        metavar="N",
        help="keep N kernels started for kernel sessions (each used once; default: [serve] kernel_pool, 0)",
    )
    p.add_argument(
        "--kernel-init",
        metavar="FILE",
        help="the kernel pool's kernels are forks of a warm kernel that ran FILE (Python) once: imports, "
        "loaded data (needs --kernel-pool; default: [serve] kernel_init)",
    )
    p.add_argument(
        "--episode-pool",
        type=_warm,
        action="append",
        metavar="TASK=N",
        help="keep N episodes of TASK started for episode sessions (each used once; repeatable; "
        "default: [serve] episode_pool, none)",
    )
    p.add_argument(
        "--idle-timeout",
        type=positive(float),
        metavar="S",
        help="seconds without a frame before a connection and its session close (default: 600)",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="config file ([serve], [episodes], [images], and the kernels' policy); default: the embedded one",
    )
    p.add_argument(
        "--token-file",
        metavar="F",
        help="file whose first line is the bearer token (else $SEQUESTER_SERVE_TOKEN, [serve] token, or generated)",
    )
    p.set_defaults(func=cmd_serve)
