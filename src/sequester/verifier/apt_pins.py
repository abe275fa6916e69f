"""Which Debian packages a task's test script installs with ``apt-get``/``apt``. Pure.

Every ``apt-get install`` / ``apt install`` of the script, read with
:mod:`.script_commands`: the packages named literally (``gcc``, ``primer3``,
``libgl1:amd64``, ``vim=2:9.0*`` is not literal), and ``--no-install-recommends`` and
``--reinstall`` when a line gives them. What is not literal (``$PKGS``, globs) is never prepared: the runner's
``apt-get`` then refuses it, a set-up failure the host settles (see
:mod:`sequester.environments.verdict`).

The host installs the packages ahead, with the task's pristine image's own ``apt`` and
sources (:mod:`sequester.imagebuild.apt_install`); the runner's ``apt-get`` applies the
result when the script asks (:mod:`.shims`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sequester.verifier.script_commands import commands, program_words

__all__ = ["AptRequest", "apt_requests", "apt_requests_of_tests", "TASK_INSTALLS_DIR"]

TASK_INSTALLS_DIR = "task-installs"  # below the toolchain folder: the prepared installs, hidden from episodes

_PACKAGE = re.compile(r"^[a-z0-9][a-z0-9+.-]*(?::[a-z0-9-]+)?(?:=[A-Za-z0-9.+:~-]+)?$")
# apt-get's options that take a value.
_VALUE = {"-o", "--option", "-c", "--config-file", "-t", "--target-release", "--default-release", "-a"}


@dataclass(frozen=True)
class AptRequest:
    """What a test script's ``apt-get install`` lines ask for."""

    packages: tuple[str, ...] = ()  # named literally, in the order first named
    not_literal: tuple[str, ...] = ()  # as written: never prepared
    no_recommends: bool = False  # a line said --no-install-recommends
    reinstall: bool = False  # a line said --reinstall (the package's files written again)

    def without(self, provided: set[str]) -> AptRequest:
        """The request less the packages in ``provided`` (what the runner itself has)."""
        kept = tuple(p for p in self.packages if p not in provided)
        return AptRequest(kept, self.not_literal, self.no_recommends, self.reinstall)


def apt_requests(script: str) -> AptRequest:
    """The packages ``script``'s ``apt-get``/``apt`` install lines name (see the module)."""
    packages: list[str] = []
    odd: list[str] = []
    no_recommends = reinstall = False
    for command in commands(script):
        _, words = program_words(command)
        if not words or os.path.basename(words[0]) not in ("apt-get", "apt"):
            continue
        sub: str | None = None
        named: list[str] = []
        flags: list[str] = []
        i, args = 0, words[1:]
        while i < len(args):
            arg, i = args[i], i + 1
            if arg.startswith("-"):
                flags.append(arg)
                if arg in _VALUE:
                    i += 1
            elif sub is None:
                sub = arg
            else:
                named.append(arg)
        if sub != "install":
            continue
        no_recommends |= "--no-install-recommends" in flags
        reinstall |= "--reinstall" in flags
        for name in named:
            (packages if _PACKAGE.match(name) else odd).append(name)
    return AptRequest(tuple(dict.fromkeys(packages)), tuple(dict.fromkeys(odd)), no_recommends, reinstall)


# An apt command inside another language's string: asked to answer yes (-y, --yes,
# --assume-yes), as unattended commands are (prose such as "make sure apt install works"
# is not one).
_EMBEDDED = re.compile(r"\bapt(?:-get)?[ \t]+[^'\"`\n;&|()#]*")
_ASSUME_YES = re.compile(r"(?:^|\s)(?:-[a-zA-Z]*y[a-zA-Z]*|--yes|--assume-yes)(?:\s|$)")
_FILE_LIMIT = 1 << 20  # bytes of one file read
_FILES_LIMIT = 500  # files of the tests' folder read


def merged(requests: Iterable[AptRequest]) -> AptRequest:
    """One request for all of ``requests``."""
    packages: list[str] = []
    odd: list[str] = []
    no_recommends = reinstall = False
    for r in requests:
        packages += r.packages
        odd += r.not_literal
        no_recommends |= r.no_recommends
        reinstall |= r.reinstall
    return AptRequest(tuple(dict.fromkeys(packages)), tuple(dict.fromkeys(odd)), no_recommends, reinstall)


def apt_requests_of_tests(tests_dir: Path) -> AptRequest:
    """What every text file of a task's tests installs with apt: ``test.sh`` and the scripts
    the tests write and run (a shell script in a Python test's string, a ``verify.sh``):
    the first :data:`_FILES_LIMIT` files, :data:`_FILE_LIMIT` bytes of each, no link followed."""
    found: list[AptRequest] = []
    files = sorted(p for p in tests_dir.rglob("*") if p.is_file() and not p.is_symlink())[:_FILES_LIMIT]
    for path in files:
        try:
            with open(path, "rb") as f:
                data = f.read(_FILE_LIMIT)
        except OSError:
            continue
        if b"\0" in data or b"apt" not in data:
            continue
        text = data.decode(errors="replace")
        found.append(apt_requests(text))
        # A command inside another language's string (a Python test's os.system("apt-get
        # install ..."), a here-document): each apt command of a line, read on its own.
        found += [apt_requests(m[0]) for m in _EMBEDDED.finditer(text) if _ASSUME_YES.search(m[0])]
    return merged(found)
