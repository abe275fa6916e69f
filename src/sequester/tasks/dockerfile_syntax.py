"""Dockerfile syntax as Docker reads it: directives, continuations, heredocs, words, ``$VAR``.

Docker does not run a shell to read ``WORKDIR``, ``COPY``, ``ENV`` or ``ARG``; it applies a
small shell-like lexer of its own. It is reproduced here (rather than borrowing
:mod:`shlex`) because the two disagree exactly where Dockerfiles are written loosely:
``$VAR`` inside double quotes, a backslash before an ordinary character, an ``ARG``
declared without a value.

A variable maps to its value, or to ``None`` when it was declared (``ARG NAME``) but never
given one. A name that is not in the mapping at all raises :class:`UnknownVariable`: its
value would come from the base image, which only a build can see.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = [
    "HEREDOC",
    "split_instruction",
    "UnknownVariable",
    "WordError",
    "Variables",
    "logical_lines",
    "split_raw",
    "expand",
    "expand_words",
]

Variables = Mapping[str, "str | None"]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DIRECTIVE = re.compile(r"^#\s*([A-Za-z][A-Za-z0-9_-]*)\s*=\s*(.*?)\s*$")
HEREDOC = re.compile(r"^\d*<<(-?)([\"']?)([A-Za-z0-9_.-]+)\2$")
_OPERATORS = (":-", ":+", ":?", "-", "+", "?")


class UnknownVariable(Exception):
    """A ``$NAME`` that the Dockerfile does not define (internal; the parser reports it)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class WordError(Exception):
    """A word Docker itself would refuse: an unterminated quote, a bad ``${...}``."""


def logical_lines(text: str) -> tuple[str, list[tuple[int, str, str]]]:
    """The escape character, and (first line number, instruction with continuations joined,
    original text including heredoc bodies) for each instruction, comments left out.

    Parser directives (``# syntax=...``, ``# escape=`...``) count only at the very top.
    """
    lines = text.removeprefix("\ufeff").splitlines()
    escape, i = "\\", 0
    while i < len(lines) and (directive := _DIRECTIVE.match(lines[i])):
        if directive[1].lower() == "escape":
            if directive[2] not in ("\\", "`"):
                raise WordError(f"{i + 1}: escape directive: {directive[2]!r} is not \\ or `")
            escape = directive[2]
        i += 1
    out = []
    while i < len(lines):
        number, body, full = i + 1, lines[i], [lines[i]]
        i += 1
        if not body.strip() or body.lstrip().startswith("#"):
            continue
        while body.rstrip().endswith(escape):
            body = body.rstrip()[:-1]
            while i < len(lines) and (not lines[i].strip() or lines[i].lstrip().startswith("#")):
                full.append(lines[i])  # comments and blank lines inside a continuation are dropped
                i += 1
            if i == len(lines):
                break
            body += lines[i]
            full.append(lines[i])
            i += 1
        body = body.strip()
        if not body:
            continue
        keyword = body.split(None, 1)[0].upper()
        if keyword in ("RUN", "COPY", "ADD"):  # BuildKit heredocs: the body lines are not instructions
            for word in body.split()[1:]:
                if heredoc := HEREDOC.match(word):
                    while i < len(lines):
                        full.append(lines[i])
                        i += 1
                        if (full[-1].lstrip("\t") if heredoc[1] else full[-1]) == heredoc[3]:
                            break
        out.append((number, body, "\n".join(full)))
    return escape, out


def split_instruction(line: str) -> tuple[str, str]:
    """A logical line (as :func:`logical_lines` gives it: stripped, never empty) as its
    keyword, upper-cased, and the rest of the line."""
    word, *tail = line.split(None, 1)
    return word.upper(), tail[0].strip() if tail else ""


def split_raw(text: str, escape: str = "\\") -> list[str]:
    """Split on unquoted blanks, keeping quotes and escapes in the words (Docker's first pass)."""
    words: list[str] = []
    current: list[str] = []
    quote = None
    i = 0
    while i < len(text):
        c = text[i]
        if c == escape and quote != "'" and i + 1 < len(text):
            current += [c, text[i + 1]]
            i += 2
            continue
        if quote is None and c in " \t":
            if current:
                words.append("".join(current))
                current = []
        else:
            if c == quote:
                quote = None
            elif quote is None and c in "'\"":
                quote = c
            current.append(c)
        i += 1
    if quote is not None:
        raise WordError(f"unterminated {quote} quote in {text!r}")
    if current:
        words.append("".join(current))
    return words


def expand(text: str, variables: Variables, escape: str = "\\", *, quotes: bool = True) -> str:
    """One word: quotes removed (if ``quotes``), escapes and variables applied, blanks kept."""
    return _process(text, variables, escape, split=False, quotes=quotes)[0]


def expand_words(text: str, variables: Variables, escape: str = "\\") -> list[str]:
    """Words split on unquoted blanks, each with quotes removed and variables applied."""
    return _process(text, variables, escape, split=True, quotes=True)


def _process(text: str, variables: Variables, escape: str, *, split: bool, quotes: bool) -> list[str]:
    words: list[str] = []
    current: list[str] = []
    started = False
    quote: str | None = None
    i = 0
    while i < len(text):
        c = text[i]
        if quote == "'":
            if c == "'":
                quote = None
            else:
                current.append(c)
            i += 1
        elif c == escape and i + 1 < len(text):
            following = text[i + 1]
            if quote == '"' and following not in ('"', "$", escape):
                current.append(c)  # inside double quotes only ", $ and the escape are special
            current.append(following)
            started = True
            i += 2
        elif c == "$":
            value, i = _variable(text, i, variables, escape)
            current.append(value)
            started = True
        elif quotes and quote is None and c in "'\"":
            quote = c
            started = True
            i += 1
        elif quotes and quote == '"' and c == '"':
            quote = None
            i += 1
        elif split and quote is None and c in " \t":
            if started:
                words.append("".join(current))
                current, started = [], False
            i += 1
        else:
            current.append(c)
            started = True
            i += 1
    if quote is not None:
        raise WordError(f"unterminated {quote} quote in {text!r}")
    if started or not split:
        words.append("".join(current))
    return words


def _variable(text: str, i: int, variables: Variables, escape: str) -> tuple[str, int]:
    """Expand the ``$NAME`` or ``${...}`` at ``text[i]``; return the value and the next index."""
    if text.startswith("${", i):
        end, depth, j = -1, 1, i + 2
        while j < len(text):
            if text[j] == escape:
                j += 2
                continue
            if text.startswith("${", j):
                depth, j = depth + 1, j + 2
                continue
            if text[j] == "}":
                depth -= 1
                if depth == 0:
                    end = j
                    break
            j += 1
        if end < 0:
            raise WordError(f"missing '}}' in {text[i:]!r}")
        return _substitute(text[i + 2 : end], variables, escape), end + 1
    match = _NAME.match(text, i + 1)
    if not match:
        return "$", i + 1
    return _lookup(match[0], variables) or "", match.end()


def _lookup(name: str, variables: Variables) -> str | None:
    if name not in variables:
        raise UnknownVariable(name)
    return variables[name]


def _substitute(inner: str, variables: Variables, escape: str) -> str:
    match = _NAME.match(inner)
    if not match:
        raise WordError(f"bad substitution '${{{inner}}}'")
    name, rest = match[0], inner[match.end() :]
    value = _lookup(name, variables)
    if not rest:
        return value or ""
    op = next((o for o in _OPERATORS if rest.startswith(o)), None)
    if op is None:
        raise WordError(f"unsupported substitution '${{{inner}}}' (only :- :+ :? - + ? are known)")
    word = rest[len(op) :]
    missing = value is None or (op.startswith(":") and value == "")
    if op in (":-", "-"):
        return expand(word, variables, escape) if missing else value or ""
    if op in (":+", "+"):
        return "" if missing else expand(word, variables, escape)
    if missing:
        raise WordError(f"${name}: {expand(word, variables, escape) or 'is not set'}")
    return value or ""
