"""The kernel's cell runner: the second stage, which never had ctypes.

Exec'd by the first stage (the native ``kernel/stage0.c`` in a sandbox, else
:mod:`sequester.kernel.boot`) as
``python -s -B -P -c STAGE_TWO PACKAGE_ROOT IN_FD OUT_FD STAGE2`` once the process is
confined (namespaces, limits, privileges, Landlock, seccomp: all inherited across that
``execve``). In ``off`` mode the host starts it directly with only the two fds, and the
configuration arrives on ``IN_FD``. Standard library only, plus the in-kernel parts of
sequester (``guard.audit``, ``net.bridge``, ``kernel.protocol``), so start-up stays fast.

It starts the network bridge (its listeners may take any port: the first stage made the
kernel's network namespace allow that), installs the audit hook, answers ``ready`` with
a report of what holds (uid, capabilities, seccomp, Landlock) and serves ``run``
requests. A cell's stdout and stderr go to fd 1 and 2, which the host reads; the result
(value, error, duration) comes back on ``OUT_FD`` after the cell's output has been written.
"""

from __future__ import annotations

import time

_STARTED = time.monotonic_ns()  # start-up timing (see Kernel.start_timing): this image's first line

import _signal  # not ``signal``: it wraps the same functions in enums (milliseconds at start)
import builtins
import io
import os
import sys

from sequester.kernel.protocol import TEXT_LIMIT, read_message, write_message

TYPE_CHECKING = False  # not ``typing``: every kernel imports this module at start-up
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any

_VALUE_LIMIT = TEXT_LIMIT


class CellTimeout(BaseException):
    """Raised in the main thread when a cell's wall-clock budget runs out.

    A BaseException, so ``except Exception`` in model code does not swallow it.
    """


class OutputLimitExceeded(Exception):
    """The cell wrote more to stdout and stderr than the policy allows."""


# -- start ------------------------------------------------------------------------------


def start(cfg: dict[str, Any]) -> dict[str, Any]:
    """Bridge, then the audit hook; returns the report for the host's ``ready`` check."""
    mode = cfg["mode"]
    report: dict[str, Any] = {"mode": mode, **cfg.get("report", {})}
    if mode == "off":
        return _finish_report(report)
    if cfg.get("warm"):
        _load_forker(cfg["warm"])
        report["warm"] = True
    if cfg.get("bridge"):
        from sequester.net.bridge import start_bridge

        bridge = cfg["bridge"]
        start_bridge(bridge["control_fd"], [tuple(x) for x in bridge["listeners"]])
    from sequester.guard import audit

    network = cfg.get("audit_network")
    if network:
        from sequester.guard.resolver import install_resolver

        install_resolver(network.get("resolved", {}))
    audit.install_audit_hook(
        allowed_names=network["names"] if network else None,
        allowed_connects=[tuple(x) for x in network["connects"]] if network else None,
    )
    for name in [m for m in sys.modules if m.partition(".")[0] in audit.BLOCKED_IMPORTS]:
        del sys.modules[name]  # none should be loaded in this image; belt and braces
    for name in [m for m in sys.modules if m.startswith("sequester.guard")]:
        del sys.modules[name]
    # No gc.collect() here (1 ms of every start): it freed nothing that matters. The live
    # hook is reachable from no Python object, and the guard modules stay reachable as
    # attributes of the ``sequester`` package whether collected or not (harmless: they
    # hold functions and constants, not the hook).
    return _finish_report(report)


_FORKER: Any = None  # a warm kernel's _sequester_fork module and its channel


def _load_forker(warm: dict[str, Any]) -> None:
    """A warm kernel's native fork (``kernel/stage0_fork.c``), given its channel before any
    cell runs; forks' exits are reaped by the kernel (no status: the host has a pidfd)."""
    global _FORKER
    import importlib.util

    spec = importlib.util.spec_from_file_location("_sequester_fork", warm["module"])
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the fork module {warm['module']}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.prepare(warm["channel_fd"])
    _signal.signal(_signal.SIGCHLD, _signal.SIG_IGN)
    _FORKER = (module, warm["channel_fd"])


def _finish_report(report: dict[str, Any]) -> dict[str, Any]:
    status: dict[str, str] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                status[key] = value.strip()
    except FileNotFoundError:  # a warm kernel: its /proc is covered (it reports no sets)
        if not report.get("warm"):
            raise
    report.update(
        uid=os.getuid(),
        gid=os.getgid(),
        caps={k: status.get(k, "") for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")},
        seccomp=status.get("Seccomp", ""),
        no_new_privs=status.get("NoNewPrivs", ""),
        cwd=os.getcwd(),
    )
    return report


# -- cells ------------------------------------------------------------------------------


class _CellOutput(io.TextIOBase):
    """stdout or stderr of a cell: straight to the fd, counted against the cell's cap."""

    def __init__(self, fd: int, budget: list[int], stream: bool):
        self._fd = fd
        self._budget = budget  # shared by stdout and stderr: [bytes left]
        self._stream = stream
        self._pending: list[bytes] = []
        self._pending_size = 0

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return False

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        data = text.encode("utf-8", "backslashreplace")
        left = self._budget[0]
        over = len(data) > left
        if over:
            data = data[: max(left, 0)]
        self._budget[0] = left - len(data)
        self._pending.append(data)
        self._pending_size += len(data)
        if self._stream or self._pending_size >= 65536 or over:
            self.flush()
        if over:
            raise OutputLimitExceeded("the cell's output is over the sandbox policy's output_bytes limit")
        return len(text)

    def flush(self) -> None:
        if not self._pending:
            return
        view = memoryview(b"".join(self._pending))
        self._pending.clear()
        self._pending_size = 0
        while view:
            view = view[os.write(self._fd, view) :]


class Cells:
    """Runs cells in one persistent namespace."""

    def __init__(self, output_limit: int):
        self.namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
        self.output_limit = output_limit
        self._in_cell = False
        _signal.signal(_signal.SIGALRM, self._on_alarm)

    def _on_alarm(self, signum: int, frame: Any) -> None:
        if self._in_cell:
            raise CellTimeout

    def run(self, code: str, timeout: float | None, filename: str = "<cell>", stream: bool = False) -> dict[str, Any]:
        started = time.perf_counter()
        budget = [self.output_limit]
        out, err = _CellOutput(1, budget, stream), _CellOutput(2, budget, stream)
        saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = out, err
        value: str | None = None
        error: dict[str, Any] | None = None
        try:
            body, last = self._compile(code, filename)
            self._in_cell = True
            if timeout:
                _signal.setitimer(_signal.ITIMER_REAL, timeout)
            try:
                if body is not None:
                    exec(body, self.namespace)
                if last is not None:
                    result = eval(last, self.namespace)
                    if result is not None:
                        self.namespace["_"] = result
                        value = _safe_repr(result)
            finally:
                _signal.setitimer(_signal.ITIMER_REAL, 0)
                self._in_cell = False
        except CellTimeout:
            error = {
                "type": "TimeoutError",
                "message": f"the cell ran over its {timeout:g} s timeout and was interrupted",
                "traceback": "",
            }
        except BaseException as exc:  # noqa: BLE001 - everything the cell raises is its result
            error = _describe(exc)
        finally:
            sys.stdout, sys.stderr = saved
            for stream_ in (out, err):
                try:
                    stream_.flush()
                except OSError:
                    pass
        return {"value": value, "error": error, "duration": time.perf_counter() - started}

    _ast: Any = None

    @classmethod
    def _compile(cls, code: str, filename: str) -> tuple[Any, Any]:
        if cls._ast is None:
            # Not ``ast`` (it imports contextlib, enum, collections) and not at start-up:
            # making the AST types costs ~2 ms, which the first cell pays, not the start.
            import _ast

            cls._ast = _ast
        _ast = cls._ast
        tree: Any = compile(code, filename, "exec", _ast.PyCF_ONLY_AST)  # what ast.parse does: a Module
        last = None
        if tree.body and isinstance(tree.body[-1], _ast.Expr):
            last = compile(_ast.Expression(tree.body.pop().value), filename, "eval")
        body = compile(tree, filename, "exec") if tree.body else None
        return body, last


def _safe_repr(value: Any) -> str:
    try:
        text = repr(value)
    except BaseException as exc:  # noqa: BLE001
        return f"<repr() failed: {type(exc).__name__}: {exc}>"
    return _clip(text)


def _clip(text: str) -> str:
    """Every text field of a result is bounded, so a result always fits the host's frame
    limit (an honest cell never gets its kernel killed for a long error message)."""
    if len(text) > _VALUE_LIMIT:
        text = text[:_VALUE_LIMIT] + f"... [{len(text) - _VALUE_LIMIT} more characters]"
    return text


def _describe(exc: BaseException) -> dict[str, Any]:
    import traceback

    here = os.path.abspath(__file__)
    tb = exc.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) == here:
        tb = tb.tb_next  # the kernel's own frames are noise to the caller
    if isinstance(exc, SyntaxError):  # the program's line, not the kernel's call into the compiler
        lines = traceback.format_exception_only(type(exc), exc)
    else:
        lines = traceback.format_exception(type(exc), exc, tb)
    message = str(exc) if not isinstance(exc, SyntaxError) else (exc.msg or "")
    if isinstance(exc, SystemExit):
        message = str(exc.code) if exc.code is not None else "0"
    return {"type": _clip(type(exc).__name__), "message": _clip(message), "traceback": _clip("".join(lines))}


# -- main loop --------------------------------------------------------------------------


def serve(in_fd: int, out_fd: int, output_limit: int, cfg: dict[str, Any] | None = None) -> None:
    cells = Cells(output_limit)
    while True:
        request = read_message(in_fd)
        if request is None or request.get("op") == "shutdown":
            return
        if request.get("op") == "fork" and _FORKER is not None:
            _fork(out_fd, cfg or {})
        elif request.get("op") == "run":
            result = cells.run(
                str(request.get("code", "")),
                request.get("timeout"),
                str(request.get("filename") or "<cell>"),
                bool(request.get("stream")),
            )
            write_message(out_fd, {"op": "result", "id": request.get("id"), **result})


def _fork(out_fd: int, cfg: dict[str, Any]) -> None:
    """The host asked for a fork (its descriptors and plan are on the fork channel). The
    warm kernel answers ``forked``; the fork, confined by the time this returns there,
    starts its own bridge and answers ``ready`` on its own pipe (the same numbers)."""
    global _FORKER
    module, channel = _FORKER
    try:
        got = module.fork(channel)
    except OSError as exc:
        write_message(out_fd, {"op": "fork_failed", "error": f"{type(exc).__name__}: {exc}"})
        return
    if got is None:
        write_message(out_fd, {"op": "forked"})
        return
    numbers, begun, confined, _nonce = got
    _FORKER = None  # a fork forks nothing (its filter refuses it anyway)
    report: dict[str, Any] = {"mode": cfg["mode"], "forked": True, **cfg.get("report", {})}
    bridge = cfg.get("bridge")
    if bridge:
        from sequester.net.bridge import start_bridge

        start_bridge(numbers[4], [tuple(x) for x in bridge["listeners"]])
    report = _finish_report(report)
    report["timing"] = [["stage0", begun], ["exec0", confined], ["started", time.monotonic_ns()]]
    write_message(out_fd, {"op": "ready", "report": report})


def _native_marks(extra: list[str]) -> list[tuple[str, int]]:
    """The native first stage's timestamps: its last argument, ``T<started>,<exec>``."""
    if len(extra) != 1 or not extra[0].startswith("T"):
        return []
    try:
        started, execed = (int(x) for x in extra[0][1:].split(","))
    except ValueError:
        return []
    return [("stage0", started), ("exec0", execed)]


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    in_fd, out_fd = int(args[0]), int(args[1])
    try:
        from sequester.kernel.boot import decode_stage_two, read_config

        imported = time.monotonic_ns()
        cfg = decode_stage_two(args[2]) if len(args) > 2 else read_config(in_fd)
        if cfg is None:
            return
        report = start(cfg)
        timing = [
            *cfg.get("timing", ()),
            *_native_marks(args[3:]),
            ("server", _STARTED),
            ("server_imported", imported),
            ("started", time.monotonic_ns()),
        ]
        report["timing"] = [[name, ns] for name, ns in timing]
    except BaseException as exc:  # noqa: BLE001 - tell the host why, then die: fail closed
        import traceback

        where = "".join(traceback.format_exception(exc)[-3:])
        write_message(out_fd, {"op": "failed", "error": f"{type(exc).__name__}: {exc}\n{where}"})
        os._exit(70)
    write_message(out_fd, {"op": "ready", "report": report})
    serve(in_fd, out_fd, int(cfg.get("output_bytes") or cfg["limits"]["output_bytes"]), cfg)


if __name__ == "__main__":
    main()
