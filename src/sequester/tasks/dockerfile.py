"""What a task's Dockerfile does, as data: the base image, files copied in, ENV and WORKDIR.

The plan holds what can be known about the image without building it: the ``FROM`` image
and the effect of ``WORKDIR``, ``ENV``, ``ARG`` and ``COPY``/``ADD`` of local files, with
Docker's rules for line continuations, parser directives, quotes and ``$VAR``. Everything
else (``RUN``, ``USER``, ``COPY --from``, ``ADD`` of a URL or an archive, a second build
stage, ...) changes the image in ways only a build can tell, so it is never skipped
quietly: each becomes an :class:`UnsupportedInstruction` in :attr:`DockerfilePlan.unsupported`
and the caller decides whether the plan is good enough.

A variable the Dockerfile uses but does not define (``ENV PATH=/opt/bin:$PATH``) would
come from the base image; unless ``base_env`` supplies it, the instruction is reported as
unsupported rather than expanded to an empty string. A Dockerfile Docker itself would
refuse (no ``FROM``, ``COPY`` with one argument, an unterminated quote) is a
:class:`TaskError` naming the file and line. Copying is resolved against the build
context separately, by :func:`resolve_copies` (:mod:`.context`).
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass

from sequester.errors import TaskError
from sequester.tasks.context import resolve_copies
from sequester.tasks.dockerfile_syntax import (
    UnknownVariable,
    Variables,
    WordError,
    expand,
    expand_words,
    logical_lines,
    split_instruction,
    split_raw,
)

__all__ = [
    "CopyStep",
    "UnsupportedInstruction",
    "DockerfilePlan",
    "parse_dockerfile",
    "resolve_copies",
    "absolute_path",
]

_ARG_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_REMOTE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# Docker auto-extracts a local tar archive given to ADD (plain, gzip, bzip2, xz, zstd).
_ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tbz", ".tar.xz", ".txz", ".tar.zst", ".tzst")
# Folders every ordinary Linux base image has: a COPY to one of them without a trailing
# slash (``COPY run.sh /usr/local/bin``) lands inside it, as it does in Docker.
_BASE_DIRS = frozenset(
    {
        "/",
        "/bin",
        "/etc",
        "/home",
        "/lib",
        "/media",
        "/mnt",
        "/opt",
        "/root",
        "/run",
        "/sbin",
        "/srv",
        "/tmp",
        "/usr",
        "/usr/bin",
        "/usr/lib",
        "/usr/local",
        "/usr/local/bin",
        "/usr/local/lib",
        "/usr/local/sbin",
        "/usr/local/share",
        "/usr/sbin",
        "/usr/share",
        "/var",
        "/var/lib",
        "/var/log",
        "/var/tmp",
    }
)
_REASONS = {
    "RUN": "runs a command at build time; its effect on the image cannot be known without a build",
    "USER": "changes the user the container runs as",
    "EXPOSE": "declares ports",
    "CMD": "sets the container's default command",
    "ENTRYPOINT": "sets the container's entry point",
    "VOLUME": "declares a volume",
    "HEALTHCHECK": "declares a health check",
    "SHELL": "changes the shell of RUN, CMD and ENTRYPOINT",
    "LABEL": "sets image labels",
    "STOPSIGNAL": "sets the stop signal",
    "ONBUILD": "adds a trigger for images built from this one",
    "MAINTAINER": "sets image metadata (deprecated)",
}


@dataclass(frozen=True)
class CopyStep:
    """One local ``COPY``/``ADD``: context-relative ``sources`` into the absolute ``dest``.

    ``dest_is_dir``: sources go *into* ``dest`` (a trailing ``/``, several sources, ``.``,
    or a folder known to exist: an earlier ``WORKDIR``, a copy into it, a standard folder
    such as ``/usr/local/bin``); otherwise a single file source *becomes* ``dest``.
    """

    sources: tuple[str, ...]
    dest: str
    dest_is_dir: bool
    chown: str | None = None
    chmod: str | None = None
    line: int = 0
    instruction: str = "COPY"


@dataclass(frozen=True)
class UnsupportedInstruction:
    """An instruction whose effect the plan does not reproduce, and why (``line`` is 1-based)."""

    line: int
    instruction: str
    text: str
    reason: str


@dataclass(frozen=True)
class DockerfilePlan:
    """What a Dockerfile does that can be reproduced; ``unsupported`` lists the rest, in order."""

    base_image: str
    workdir: str | None = None
    copies: tuple[CopyStep, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    unsupported: tuple[UnsupportedInstruction, ...] = ()
    source: str = "Dockerfile"

    @property
    def env_map(self) -> dict[str, str]:
        """The ``ENV`` variables as the final image sees them (a later ``ENV`` wins)."""
        return dict(self.env)


def absolute_path(base: str, path: str) -> str:
    """``path`` resolved against the absolute container folder ``base``, normalised."""
    joined = posixpath.normpath(posixpath.join(base, path))
    return "/" + joined.lstrip("/")


def parse_dockerfile(text: str, source: str, *, base_env: Mapping[str, str] | None = None) -> DockerfilePlan:
    """Parse a Dockerfile's text; ``source`` (a path or name) starts every message.

    ``base_env``: the base image's environment, if the caller knows it, for ``$PATH`` and
    the like. Relative paths before any ``WORKDIR`` resolve against ``/``.
    """
    try:
        escape, instructions = logical_lines(text)
    except WordError as exc:
        raise TaskError(f"{source}:{exc}") from None
    parser = _Parser(source, escape, dict(base_env or {}))
    for number, body, full in instructions:
        keyword, rest = split_instruction(body)
        parser.dispatch(number, keyword, rest, full)
    if parser.base_image is None:
        raise TaskError(f"{source}: no FROM instruction")
    return DockerfilePlan(
        parser.base_image,
        parser.workdir,
        tuple(parser.copies),
        tuple(parser.env_steps),
        tuple(parser.unsupported),
        source,
    )


def _parents(path: str) -> set[str]:
    out = {path}
    while path != "/":
        path = posixpath.dirname(path)
        out.add(path)
    return out


class _Parser:
    """The build state while instructions are applied in order (internal, mutable)."""

    def __init__(self, source: str, escape: str, base_env: dict[str, str]) -> None:
        self.source, self.escape = source, escape
        self.base_env = base_env
        self.global_args: dict[str, str | None] = {}
        self.args: dict[str, str | None] = {}
        self.env: dict[str, str] = {}
        self.env_steps: list[tuple[str, str]] = []
        self.base_image: str | None = None
        self.stage = 0
        self.workdir: str | None = None
        self.dirs: set[str] = set(_BASE_DIRS)
        self.copies: list[CopyStep] = []
        self.unsupported: list[UnsupportedInstruction] = []

    def variables(self) -> Variables:
        return {**self.args, **self.env} if self.stage else self.global_args  # ENV wins over ARG

    def fail(self, line: int, message: str) -> TaskError:
        return TaskError(f"{self.source}:{line}: {message}")

    def dispatch(self, line: int, keyword: str, args: str, text: str) -> None:
        def report(reason: str) -> None:
            self.unsupported.append(UnsupportedInstruction(line, keyword, text, reason))

        if self.stage == 0 and keyword not in ("FROM", "ARG"):
            raise self.fail(line, f"{keyword} before the first FROM")
        if self.stage > 1:
            return report("belongs to a later build stage; multi-stage builds are not supported")
        handler = {
            "FROM": self.from_,
            "ARG": self.arg,
            "ENV": self.env_,
            "WORKDIR": self.workdir_,
            "COPY": self.copy,
            "ADD": self.copy,
        }.get(keyword)
        if handler is None:
            return report(_REASONS.get(keyword, "is not a Dockerfile instruction"))
        try:
            reason = handler(line, keyword, args)
        except UnknownVariable as exc:
            reason = f"uses ${exc.name}, which the Dockerfile does not define (it may come from the base image)"
        except WordError as exc:
            raise self.fail(line, f"{keyword}: {exc}") from None
        if reason:
            report(reason)

    def from_(self, line: int, keyword: str, args: str) -> str | None:
        words = [w for w in split_raw(args, self.escape) if not w.startswith("--")]
        if len(words) not in (1, 3) or (len(words) == 3 and words[1].lower() != "as"):
            raise self.fail(line, f"FROM: expected 'FROM image [AS name]', got {args!r}")
        try:
            image = expand(words[0], self.global_args, self.escape)
        except UnknownVariable as exc:
            raise self.fail(line, f"FROM: ${exc.name} is not declared by an ARG before the first FROM") from None
        if not image:
            raise self.fail(line, "FROM: the image name is empty")
        if self.stage:
            self.stage += 1
            return "a second FROM starts another build stage; multi-stage builds are not supported"
        self.base_image, self.stage, self.env = image, 1, dict(self.base_env)
        return None

    def arg(self, line: int, keyword: str, args: str) -> str | None:
        words = split_raw(args, self.escape)
        if not words:
            raise self.fail(line, "ARG: needs a name")
        scope = dict(self.args if self.stage else self.global_args)
        for word in words:
            name, has_default, default = word.partition("=")
            if not _ARG_NAME.match(name):
                raise self.fail(line, f"ARG: {name!r} is not a variable name")
            if has_default:
                scope[name] = expand(default, {**scope, **self.env} if self.stage else scope, self.escape)
            else:  # ``ARG NAME`` inside a stage takes the global default, if there is one
                scope[name] = self.global_args.get(name) if self.stage else None
        if self.stage:
            self.args = scope
        else:
            self.global_args = scope
        return None

    def env_(self, line: int, keyword: str, args: str) -> str | None:
        words = split_raw(args, self.escape)
        if not words or not words[0].split("=", 1)[0]:
            raise self.fail(line, "ENV: needs NAME=value")
        variables = self.variables()  # every value sees the environment from before this line
        if "=" not in words[0]:  # legacy form: ENV NAME the rest of the line
            rest = args[len(words[0]) :].strip()
            if not rest:
                raise self.fail(line, f"ENV: {words[0]!r} has no value")
            pairs = [(words[0], expand(rest, variables, self.escape))]
        else:
            pairs = []
            for word in words:
                name, has_value, raw = word.partition("=")
                if not has_value or not name:
                    raise self.fail(line, f"ENV: {word!r} is not NAME=value")
                pairs.append((name, expand(raw, variables, self.escape)))
        self.env_steps += pairs
        self.env.update(pairs)
        return None

    def workdir_(self, line: int, keyword: str, args: str) -> str | None:
        path = expand(args, self.variables(), self.escape)
        if not path.strip():
            raise self.fail(line, "WORKDIR: needs a path")
        self.workdir = absolute_path(self.workdir or "/", path)
        self.dirs |= _parents(self.workdir)
        return None

    def copy(self, line: int, keyword: str, args: str) -> str | None:
        variables, chown, chmod = self.variables(), None, None
        while args.startswith("--"):
            flag, args = (re.split(r"\s+", args, maxsplit=1) + [""])[:2]
            name, has_value, value = flag[2:].partition("=")
            name = name.lower()
            if name == "from":
                return f"copies from another build stage or image ({flag})"
            if name in ("chown", "chmod"):
                if not has_value or not value:
                    raise self.fail(line, f"{keyword}: --{name} needs a value (--{name}=...)")
                if name == "chown":
                    chown = expand(value, variables, self.escape)
                else:
                    chmod = expand(value, variables, self.escape)
            elif name != "link":  # --link changes how layers are stacked, not what is copied
                return f"the flag --{name} is not supported"
        items = None
        if args.startswith("["):
            try:
                items = json.loads(args)
            except ValueError:
                items = None  # not JSON: Docker reads it in the plain form
            if isinstance(items, list) and all(isinstance(item, str) for item in items):
                items = [expand(item, variables, self.escape, quotes=False) for item in items]
            else:
                items = None
        if items is None:
            items = expand_words(args, variables, self.escape)
        if len(items) < 2:
            raise self.fail(line, f"{keyword}: needs at least one source and a destination")
        sources, dest = items[:-1], items[-1]
        for src in sources:
            if src.startswith("<<"):
                return "creates a file from an inline heredoc"
            if _REMOTE.match(src) or src.startswith("git@"):
                kind = "a git repository" if _is_git(src) else "a URL"
                return f"{keyword} of {kind} ({src}) needs the network at build time"
            if keyword == "ADD" and src.lower().endswith(_ARCHIVE_SUFFIXES):
                return f"ADD would extract the archive {src} into the image"
        if not dest:
            raise self.fail(line, f"{keyword}: the destination is empty")
        absolute = absolute_path(self.workdir or "/", dest)
        into = (
            dest.endswith("/") or len(sources) > 1 or posixpath.basename(dest) in (".", "..") or absolute in self.dirs
        )
        self.copies.append(CopyStep(tuple(sources), absolute, into, chown, chmod, line, keyword))
        self.dirs |= _parents(absolute if into else posixpath.dirname(absolute))
        return None


def _is_git(source: str) -> bool:
    scheme = source.split("://", 1)[0].lower() if "://" in source else ""
    return source.startswith("git@") or scheme in ("git", "ssh") or source.split("#", 1)[0].endswith(".git")
