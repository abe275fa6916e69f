"""A Dockerfile read into stages of instructions, as Docker's parser reads it. Pure.

This is the *structural* pass, done once for the whole file before anything is built:
line continuations and parser directives (by :func:`sequester.tasks.dockerfile_syntax.logical_lines`, shared with
the task loader), each instruction's keyword and leading ``--flags``, and the split into
build stages at every ``FROM``. Nothing is expanded here: ``$VAR`` depends on build
arguments and on the base image's environment, which only the planner (:mod:`sequester.imagebuild.plan`)
knows.

What is checked here is what Docker checks at parse time, for every stage whether or not
it is built: unknown instructions and flags, stage names, and the BuildKit features
sequester refuses (``RUN --mount``, heredocs, ``ONBUILD``), so that a build fails before
its first step rather than an hour in.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from sequester.errors import BuildError
from sequester.tasks.dockerfile_syntax import HEREDOC, WordError, logical_lines, split_instruction

__all__ = ["Instruction", "Stage", "Dockerfile", "parse_dockerfile", "exec_form", "KEYWORDS"]

KEYWORDS = frozenset(
    {
        "ADD",
        "ARG",
        "CMD",
        "COPY",
        "ENTRYPOINT",
        "ENV",
        "EXPOSE",
        "FROM",
        "HEALTHCHECK",
        "LABEL",
        "MAINTAINER",
        "ONBUILD",
        "RUN",
        "SHELL",
        "STOPSIGNAL",
        "USER",
        "VOLUME",
        "WORKDIR",
    }
)
_STAGE_NAME = re.compile(r"^[a-z][a-z0-9\-_.]*$")  # Docker's validStageName, applied after lower-casing
_DURATION = re.compile(r"^(?:\d+(?:\.\d+)?(?:ns|us|µs|ms|s|m|h))+$")  # a Go time.Duration, as HEALTHCHECK takes

# The flags each instruction takes: True for a boolean flag (``--link``, ``--link=false``),
# False for one that needs ``=value``. Any other flag is an error, as in Docker.
_FLAGS: dict[str, dict[str, bool]] = {
    "FROM": {"platform": False},
    "RUN": {"network": False},
    "COPY": {"from": False, "chown": False, "chmod": False, "link": True},
    "ADD": {"chown": False, "chmod": False, "link": True, "checksum": False},
    "HEALTHCHECK": {
        "interval": False,
        "timeout": False,
        "start-period": False,
        "start-interval": False,
        "retries": False,
    },
}
# Flags Docker (BuildKit) knows but sequester does not do: refused by name, so the message
# says "not supported" rather than the misleading "unknown flag".
_REFUSED_FLAGS = {
    ("RUN", "mount"): "RUN --mount (cache, bind, secret and ssh mounts) is a BuildKit feature sequester does not "
    "support; copy what the step needs with COPY instead",
    ("RUN", "security"): "RUN --security is a BuildKit feature sequester does not support",
    ("RUN", "device"): "RUN --device is a BuildKit feature sequester does not support",
    ("COPY", "parents"): "COPY --parents is a BuildKit feature sequester does not support",
    ("COPY", "exclude"): "COPY --exclude is a BuildKit feature sequester does not support",
    ("ADD", "exclude"): "ADD --exclude is a BuildKit feature sequester does not support",
    ("ADD", "keep-git-dir"): "ADD --keep-git-dir is not supported (sequester does not ADD git repositories)",
    ("ADD", "unpack"): "ADD --unpack is a BuildKit feature sequester does not support",
}


@dataclass(frozen=True)
class Instruction:
    """One instruction: its first line, keyword, leading flags and the arguments after them."""

    line: int
    keyword: str  # upper-case
    flags: tuple[tuple[str, str | None], ...]  # ("from", "builder"); None for a bare --flag
    rest: str  # the arguments after the flags, as written
    text: str  # the whole instruction, continuations joined

    def flag(self, name: str) -> str | None:
        """The value of ``--name`` (None when absent or bare)."""
        return next((value for key, value in self.flags if key == name), None)


@dataclass(frozen=True)
class Stage:
    """The instructions from one ``FROM`` to the next."""

    index: int
    name: str | None  # the AS name, lower-cased (Docker matches stage names case-insensitively)
    base: str  # FROM's image word, not expanded (global ARGs apply: see plan.stage_graph)
    platform: str | None  # FROM --platform, not expanded
    line: int
    instructions: tuple[Instruction, ...]


@dataclass(frozen=True)
class Dockerfile:
    source: str  # the path or name every message starts with
    escape: str  # "\\" or "`" (the escape directive)
    global_args: tuple[Instruction, ...]  # the ARGs before the first FROM
    stages: tuple[Stage, ...]


def parse_dockerfile(text: str, source: str) -> Dockerfile:
    """Split ``text`` into global ARGs and stages; a :class:`BuildError` names ``source:line``."""
    try:
        escape, lines = logical_lines(text)
    except WordError as exc:  # its message already starts with the line number
        raise BuildError(f"{source}:{exc}") from None
    global_args: list[Instruction] = []
    stages: list[Stage] = []
    names: dict[str, int] = {}
    # The stage being read: its index, name, base, platform and FROM's line.
    current: tuple[int, str | None, str, str | None, int] | None = None
    body: list[Instruction] = []

    def close() -> None:
        if current is not None:
            stages.append(Stage(*current, instructions=tuple(body)))

    for number, joined, _full in lines:
        ins = _instruction(source, number, joined)
        if ins.keyword == "FROM":
            close()
            base, name, platform = _from(source, ins)
            if name is not None:
                if name in names:
                    raise BuildError(
                        f"{source}:{ins.line}: FROM: the stage name {name!r} is already used by stage {names[name]}"
                    )
                names[name] = len(stages)
            current, body = (len(stages), name, base, platform, ins.line), []
        elif current is None:
            if ins.keyword != "ARG":
                raise BuildError(
                    f"{source}:{ins.line}: {ins.keyword} before the first FROM (only ARG may come before it)"
                )
            global_args.append(ins)
        else:
            body.append(ins)
    close()
    if not stages:
        raise BuildError(
            f"{source}:{lines[-1][0] if lines else 1}: no FROM instruction (a Dockerfile must "
            f"start from an image, or FROM scratch)"
        )
    return Dockerfile(source, escape, tuple(global_args), tuple(stages))


def exec_form(rest: str) -> list[str] | None:
    """``rest`` as a JSON array of strings (Docker's exec form), or None if it is not JSON.

    As in Docker, text that is not JSON at all is the shell form, but a JSON array with
    something other than strings in it is an error (:class:`WordError`), not a command.
    """
    rest = rest.strip()
    if not rest.startswith("["):
        return None
    try:
        value = json.loads(rest)
    except ValueError:
        return None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise WordError(f"{rest} is a JSON array, but not of strings")
    return value


def _instruction(source: str, line: int, joined: str) -> Instruction:
    """One logical line as an Instruction, with the checks Docker makes at parse time."""
    keyword, after = split_instruction(joined)
    word = joined.split(None, 1)[0]
    fail = f"{source}:{line}: "
    if keyword == "ONBUILD":
        raise BuildError(fail + "ONBUILD is not supported")
    if keyword not in KEYWORDS:
        raise BuildError(fail + f"unknown instruction {word!r}")
    words, rest = _split_flags(after)
    flags: list[tuple[str, str | None]] = []
    for flag in words:
        name, has_value, value = flag[2:].partition("=")
        name = name.lower()
        flags.append((name, value if has_value else None))
        _check_flag(fail, keyword, name, value if has_value else None, [n for n, _ in flags[:-1]])
    if keyword in ("RUN", "COPY", "ADD"):
        # logical_lines already took the heredoc's body out of the instruction stream; the
        # same test on the same words tells which instructions it did that for.
        heredoc = next((w for w in joined.split()[1:] if HEREDOC.match(w)), None)
        if heredoc is not None:
            raise BuildError(
                fail + f"{keyword} with a heredoc ({heredoc}) is not supported; put the text in a file "
                f"of the build context and COPY it"
            )
    if not rest:
        raise BuildError(fail + f"{keyword} needs arguments")
    if keyword == "SHELL":
        try:
            shell = exec_form(rest)
        except WordError:
            shell = None
        if not shell:
            raise BuildError(
                fail + f'SHELL needs a non-empty JSON array of strings, e.g. ["/bin/bash", "-c"] (got {rest!r})'
            )
    return Instruction(line, keyword, tuple(flags), rest, joined)


def _check_flag(fail: str, keyword: str, name: str, value: str | None, seen: list[str]) -> None:
    """Docker's per-instruction flag rules (BFlags), and sequester's refusals."""
    if (keyword, name) in _REFUSED_FLAGS:
        raise BuildError(fail + _REFUSED_FLAGS[(keyword, name)])
    allowed = _FLAGS.get(keyword, {})
    if name not in allowed:
        raise BuildError(fail + f"{keyword}: unknown flag --{name}")
    if name in seen:
        raise BuildError(fail + f"{keyword}: --{name} is given twice")
    if allowed[name]:
        if value is not None and value.lower() not in ("true", "false"):
            raise BuildError(fail + f"{keyword}: --{name} takes true or false, not {value!r}")
        return
    if not value:
        raise BuildError(fail + f"{keyword}: --{name} needs a value (--{name}=...)")
    if keyword == "RUN":  # --network
        if value == "host":
            raise BuildError(fail + "RUN --network=host is refused: a build step never gets the host's network")
        if value not in ("default", "none"):
            raise BuildError(fail + f"RUN: --network={value} is not a network mode (default or none)")
    elif keyword == "HEALTHCHECK":
        if name == "retries" and not value.isdigit():
            raise BuildError(fail + f"HEALTHCHECK: --retries={value} is not a whole number")
        if name != "retries" and not _DURATION.match(value):
            raise BuildError(fail + f"HEALTHCHECK: --{name}={value} is not a duration (e.g. 30s, 1m30s)")


def _from(source: str, ins: Instruction) -> tuple[str, str | None, str | None]:
    """FROM's image word, its stage name and --platform (Docker splits on blanks, no quotes)."""
    words = ins.rest.split()
    if len(words) not in (1, 3) or (len(words) == 3 and words[1].lower() != "as"):
        raise BuildError(f"{source}:{ins.line}: FROM: expected 'FROM image [AS name]', got {ins.rest!r}")
    name = words[2].lower() if len(words) == 3 else None
    if name is not None and not _STAGE_NAME.match(name):
        raise BuildError(
            f"{source}:{ins.line}: FROM: {words[2]!r} is not a valid stage name (a letter, then "
            f"letters, digits, '-', '_' or '.')"
        )
    return words[0], name, ins.flag("platform")


def _split_flags(text: str) -> tuple[list[str], str]:
    """The leading ``--flag`` words of ``text`` and the text after them (Docker's
    ``extractBuilderFlags``: quotes in a flag word are removed, ``\\`` escapes one
    character whatever the escape directive, a lone ``--`` ends the flags)."""
    words: list[str] = []
    pos, n = 0, len(text)
    while True:
        while pos < n and text[pos].isspace():
            pos += 1
        if not text.startswith("--", pos):
            return words, text[pos:].strip()
        word: list[str] = []
        quote: str | None = None
        while pos < n and (quote is not None or not text[pos].isspace()):
            c = text[pos]
            if quote is None and c in "'\"":
                quote = c
            elif c == quote:
                quote = None
            elif c == "\\" and pos + 1 < n:
                pos += 1
                word.append(text[pos])
            else:
                word.append(c)
            pos += 1
        if "".join(word) == "--":
            return words, text[pos:].strip()
        words.append("".join(word))
