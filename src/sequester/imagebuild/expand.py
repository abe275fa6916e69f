"""Build-time variables: ARG scopes, ENV, and expansion the way Docker applies them. Pure.

Docker expands ``$VAR`` in most instructions itself (not through a shell), against the
variables visible at that instruction: the environment (the base image's config ``Env``,
then every ``ENV`` so far) and the ``ARG``\\ s declared in the stage (valued by
``--build-arg``, else their default, else the global ARG of the same name); of an ARG and
an ENV (or base image variable) of the same name, the later wins, as in BuildKit (see
:class:`Scope`). A name that is none of these expands to the empty string, as in Docker:
unlike the task loader, the planner knows the base image's environment, so "undefined"
really means undefined.

The lexer itself (quotes, escapes, ``${VAR:-default}``) is :mod:`sequester.tasks.dockerfile_syntax`, shared
with the task loader.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

from sequester.errors import BuildError
from sequester.images.manifest import Platform
from sequester.tasks.dockerfile_parse import Dockerfile, Instruction
from sequester.tasks.dockerfile_syntax import WordError, expand, split_raw

__all__ = ["PROXY_ARGS", "Defined", "Scope", "fail", "platform_args", "global_scope", "name_values"]

# Docker passes these to RUN from --build-arg without an ARG declaring them, and leaves
# them out of the cache key (a proxy is how the builder reaches the network, not part of
# what a step does).
PROXY_ARGS = frozenset(
    {
        "HTTP_PROXY",
        "http_proxy",
        "HTTPS_PROXY",
        "https_proxy",
        "FTP_PROXY",
        "ftp_proxy",
        "NO_PROXY",
        "no_proxy",
        "ALL_PROXY",
        "all_proxy",
    }
)
_ARG_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class Defined(Mapping[str, "str | None"]):
    """Variables in which every name is defined: one nobody set is unset (None).

    :func:`sequester.tasks.dockerfile_syntax.expand` raises ``UnknownVariable`` for a name not in its mapping
    (what the task loader wants); at build time Docker expands such a name to "" instead,
    and ``${NAME-default}`` takes the default.
    """

    def __init__(self, values: Mapping[str, str | None]) -> None:
        self._values = values

    def __getitem__(self, name: str) -> str | None:
        return self._values.get(name)

    def __contains__(self, name: object) -> bool:
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


def fail(source: str, ins: Instruction, message: str) -> BuildError:
    """A :class:`BuildError` naming the file, the line and the instruction."""
    return BuildError(f"{source}:{ins.line}: {ins.keyword}: {message}")


def platform_args(platform: Platform | None) -> dict[str, str]:
    """BuildKit's automatic platform ARGs (TARGETARCH, BUILDPLATFORM, ...).

    sequester builds for the platform it runs on, so the build and target platforms are
    the same. Like Docker, they are global: usable in FROM as they are, inside a stage
    only once an ``ARG TARGETARCH`` redeclares them.
    """
    if platform is None:
        return {}
    out: dict[str, str] = {}
    for prefix in ("TARGET", "BUILD"):
        out.update(
            {
                prefix + "PLATFORM": str(platform),
                prefix + "OS": platform.os,
                prefix + "ARCH": platform.architecture,
                prefix + "VARIANT": platform.variant,
            }
        )
    return out


def _arg_words(ins: Instruction, escape: str) -> list[tuple[str, str | None]]:
    """``ARG A B=x`` as [("A", None), ("B", "x")], the defaults not yet expanded."""
    out: list[tuple[str, str | None]] = []
    for word in split_raw(ins.rest, escape):
        name, has_default, default = word.partition("=")
        if not _ARG_NAME.match(name):
            raise WordError(f"{name!r} is not a variable name")
        out.append((name, default if has_default else None))
    return out


def global_scope(
    df: Dockerfile, build_args: Mapping[str, str], platform: Platform | None = None
) -> dict[str, str | None]:
    """The ARGs before the first FROM (what FROM expands with), plus the platform ARGs.

    Each default is expanded with the global ARGs before it; a ``--build-arg`` replaces
    the default of an ARG it names and is ignored otherwise (Docker only warns).
    """
    # BuildKit lets a --build-arg set the platform ARGs even undeclared (they are its own).
    scope: dict[str, str | None] = {k: build_args.get(k, v) for k, v in platform_args(platform).items()}
    for ins in df.global_args:
        try:
            for name, default in _arg_words(ins, df.escape):
                if name in build_args:
                    scope[name] = build_args[name]
                elif default is not None:
                    scope[name] = expand(default, Defined(scope), df.escape)
                else:  # ``ARG TARGETARCH`` keeps the automatic value; anything else is unset
                    scope[name] = scope.get(name)
        except WordError as exc:
            raise fail(df.source, ins, str(exc)) from None
    return scope


def name_values(rest: str, escape: str, variables: Mapping[str, str | None]) -> list[tuple[str, str]]:
    """ENV's and LABEL's ``k=v k2="v 2"`` (or the legacy ``k the rest``), expanded.

    Docker's parseNameVal: if the first word has no ``=``, it is the legacy form, whose
    value is the rest of the line, blanks included. Every key and value is expanded
    against ``variables`` (the ones from *before* the instruction, for all its pairs).
    """
    words = split_raw(rest, escape)
    if "=" not in words[0]:
        parts = re.split(r"\s+", rest.strip(), maxsplit=1)
        if len(parts) < 2:
            raise WordError(f"{parts[0]!r} has no value (write NAME=value)")
        raw = [(parts[0], parts[1])]
    else:
        raw = []
        for word in words:
            key, has_value, value = word.partition("=")
            if not has_value:
                raise WordError(f"{word!r} is not NAME=value")
            raw.append((key, value))
    out = []
    for key, value in raw:
        name = expand(key, variables, escape)
        if not name:
            raise WordError(f"a name is empty in {rest!r}")
        out.append((name, expand(value, variables, escape)))
    return out


class Scope:
    """The variables of one stage as its instructions are applied in order (mutable).

    Two environments, as in BuildKit: ``env`` is the image config's (the base image's
    ``Env`` and every ``ENV``), which the image keeps; ``build_env`` is what expansion
    and ``RUN`` see: the same, plus every ``ARG`` that has a value. Each instruction sets
    its names in ``build_env`` when it runs, so the later of an ``ENV`` and an ``ARG`` of
    the same name wins there (the usual ``ARG V`` then ``ENV V=...`` gives ENV's value,
    as Docker's documentation says), while ``env`` never holds an ARG.
    """

    def __init__(
        self, escape: str, env: Mapping[str, str], global_args: Mapping[str, str | None], build_args: Mapping[str, str]
    ) -> None:
        self.escape = escape
        self.env: dict[str, str] = dict(env)  # the config's Env, in order
        self.build_env: dict[str, str] = dict(env)  # what expansion and RUN see
        self.args: dict[str, str | None] = {}  # ARGs declared in this stage, in order
        self._global = global_args
        self._build = build_args

    def variables(self) -> Defined:
        return Defined(self.build_env)  # an ARG declared without a value is unset, as any unknown name

    def expand(self, word: str, *, quotes: bool = True) -> str:
        return expand(word, self.variables(), self.escape, quotes=quotes)

    def arg(self, ins: Instruction) -> list[tuple[str, str | None]]:
        """Apply an in-stage ARG; return the (name, value) pairs it declared."""
        out = []
        for name, default in _arg_words(ins, self.escape):
            if name in self._build:
                value: str | None = self._build[name]
            elif default is not None:  # each default sees the ARGs just before it on the line
                value = expand(default, self.variables(), self.escape)
            else:
                value = self._global.get(name)
            self.args[name] = value
            if value is not None:
                self.build_env[name] = value
            out.append((name, value))
        return out

    def set_env(self, ins: Instruction) -> list[tuple[str, str]]:
        """Apply an ENV; return its (name, value) pairs."""
        pairs = name_values(ins.rest, self.escape, self.variables())
        self.env.update(pairs)  # an existing name keeps its place, as in Docker's config Env
        self.build_env.update(pairs)
        return pairs

    def run_env(self) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """RUN's environment: (the config's Env names, then the ARGs' others, each with its
        build value; the undeclared proxy build args, which stay out of the cache key)."""
        env = [(k, self.build_env[k]) for k in self.env]
        env += [(k, v) for k, v in self.build_env.items() if k not in self.env]
        proxies = [
            (k, v) for k, v in self._build.items() if k in PROXY_ARGS and k not in self.args and k not in self.build_env
        ]
        return env, proxies
