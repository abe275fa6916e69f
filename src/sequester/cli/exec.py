"""``sequester exec``: run a program in a fresh kernel and relay its output."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sequester.cli.common import add_policy_flags, policy_of, positive
from sequester.errors import PolicyError

__all__ = ["add_exec_command"]


def add_exec_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("exec", help="run a program in a fresh kernel")
    add_policy_flags(p, overrides=True)
    p.add_argument("--timeout", type=positive(float), help="seconds (default: limits.cell_timeout)")
    p.add_argument("file", metavar="FILE|-")
    p.set_defaults(func=cmd_exec)


def cmd_exec(args: argparse.Namespace) -> int:
    from sequester.kernel.client import Kernel

    code, filename = _program(args.file)
    policy = policy_of(args)

    def relay(stream: str, text: str) -> None:
        out = sys.stdout if stream == "stdout" else sys.stderr
        out.write(text)
        out.flush()

    with Kernel(policy) as kernel:
        result = kernel.run(code, filename=filename, timeout=args.timeout, on_output=relay)
    if result.error is None:
        return 0
    if result.error.type == "SystemExit":
        code_text = result.error.message
        if code_text in ("0", "None", ""):
            return 0
        if not code_text.lstrip("-").isdigit():
            sys.stderr.write(code_text + "\n")
            return 1
        return int(code_text)
    sys.stderr.write(_user_traceback(result.error.type, result.error.traceback, filename) or f"{result.error}\n")
    return 1


def _program(file: str) -> tuple[str, str]:
    """The program's text and the name its tracebacks use; unreadable or not UTF-8: exit 2."""
    if file == "-":
        data, filename = sys.stdin.buffer.read(), "<stdin>"
    else:
        try:
            data, filename = Path(file).read_bytes(), file
        except OSError as exc:
            raise PolicyError(f"cannot read {file!r}: {exc.strerror}") from None
    try:
        return data.decode("utf-8"), filename
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise PolicyError(
            f"{filename}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}, "
            f"line {line}); a program must be UTF-8"
        ) from None


def _user_traceback(kind: str, text: str, filename: str) -> str:
    """A traceback as the user should see it: a syntax error shows the program's line only,
    not the kernel's call into the compiler (``ast.py``)."""
    if kind not in ("SyntaxError", "IndentationError", "TabError") or not text:
        return text
    lines = text.splitlines(keepends=True)
    start = next(
        (i for i, line in enumerate(lines) if line.startswith(f'  File "{filename}", line ') and ", in " not in line),
        None,
    )
    return text if start is None else "".join(lines[start:])
