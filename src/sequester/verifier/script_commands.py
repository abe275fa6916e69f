"""A shell script's simple commands, read without running or expanding anything. Pure.

What :mod:`.wheel_pins` (the uv and pip pins) and :mod:`.apt_pins` (the ``apt-get install``
packages) read a test script with: each simple command as its words, and the program a
command runs once the assignments, keywords and wrappers before it (``sudo``, ``env``,
``timeout``, ...) are set aside.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator

__all__ = ["commands", "program_words"]

_SEPARATOR = set("();<>|&")
_SKIPPED = {
    "if",
    "then",
    "else",
    "elif",
    "do",
    "while",
    "until",
    "!",
    "{",
    "time",
    "exec",
    "command",
    "nohup",
    "builtin",
    "xargs",
}
_SUDO_VALUE = {"-u", "-g", "-C", "-D", "-h", "-p", "-r", "-t", "-U", "-T", "--user", "--group"}
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def commands(script: str) -> Iterator[list[str]]:
    """The simple commands of ``script`` as words (nothing expanded): backslash continuations
    joined, a quote left open on one line closed by a later one; a line that never
    balances (an apostrophe in a here-document) is skipped."""
    lines = script.replace("\\\r\n", " ").replace("\\\n", " ").splitlines()
    i = 0
    current: list[str]
    while i < len(lines):
        j, chunk, words = i, lines[i], None
        while words is None:
            try:
                lexer = shlex.shlex(chunk, posix=True, punctuation_chars=True)
                lexer.whitespace_split = True
                words = list(lexer)
            except ValueError:  # an open quote
                j += 1
                if j >= len(lines) or j - i > 200:
                    break
                chunk += "\n" + lines[j]
        if words is None:
            i += 1
            continue
        i, current = j + 1, []
        for word in [*words, ";"]:
            if word and set(word) <= _SEPARATOR:
                if current:
                    yield current
                current = []
            else:
                current.append(word)


def program_words(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """The assignments before a command's program, and its words from the program on
    (keywords, ``sudo``, ``env``'s and ``timeout``'s options and arguments set aside)."""
    assigned: dict[str, str] = {}
    while words:
        head = words[0]
        if _ASSIGNMENT.match(head):
            name, _, value = head.partition("=")
            assigned[name] = value
            words = words[1:]
        elif head in _SKIPPED:
            words = words[1:]
        elif head == "sudo":  # and its options (sudo -E, sudo -u root)
            i = 1
            while i < len(words) and words[i].startswith("-") and words[i] != "--":
                i += 2 if words[i] in _SUDO_VALUE else 1
            words = words[i + (i < len(words) and words[i] == "--") :]
        elif head in ("env", "timeout"):  # their options and assignments, and timeout's duration
            i = 1
            while i < len(words) and (words[i].startswith("-") or _ASSIGNMENT.match(words[i])):
                if _ASSIGNMENT.match(words[i]):
                    name, _, value = words[i].partition("=")
                    assigned[name] = value
                i += 2 if words[i] in ("-u", "-s", "-k", "--signal", "--kill-after", "--unset", "-C") else 1
            words = words[i + (head == "timeout") :]
        else:
            break
    return assigned, words
