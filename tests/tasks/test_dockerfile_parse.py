"""The Dockerfile parser of `sequester build` (:mod:`sequester.tasks.dockerfile_parse`): structure, flags, and every parse error
naming its file and line (pure: no images, no processes)."""

from __future__ import annotations

import pytest

from sequester.errors import BuildError
from sequester.tasks.dockerfile_parse import Dockerfile, Instruction, exec_form, parse_dockerfile
from sequester.errors import ImageError
from sequester.tasks.dockerfile_syntax import WordError


# --- parse: structure ------------------------------------------------------------------------

def test_structure():
    df = parse_dockerfile("# syntax=docker/dockerfile:1\n"
                          "ARG PY=3.12\n"
                          "FROM --platform=$BUILDPLATFORM python:${PY}-slim AS Build\n"
                          "RUN   pip install \\\n"
                          "  # a comment inside the continuation\n"
                          "      numpy\n"
                          "\n"
                          "FROM debian:12\n"
                          "COPY --FROM=build --link /out /out\n", "ctx/Dockerfile")
    assert isinstance(df, Dockerfile)
    assert df.source == "ctx/Dockerfile" and df.escape == "\\"
    assert [a.rest for a in df.global_args] == ["PY=3.12"]
    first, second = df.stages
    assert (first.index, first.name, first.base, first.platform, first.line) == (
        0, "build", "python:${PY}-slim", "$BUILDPLATFORM", 3)
    assert first.instructions == (Instruction(4, "RUN", (), "pip install       numpy",
                                              "RUN   pip install       numpy"),)
    assert (second.name, second.base, second.platform, second.line) == (None, "debian:12", None, 8)
    copy = second.instructions[0]
    assert copy.flags == (("from", "build"), ("link", None))
    assert copy.flag("from") == "build" and copy.flag("chown") is None
    assert copy.rest == "/out /out"


def test_escape_directive_and_quoted_flags():
    df = parse_dockerfile("# escape=`\nFROM alpine\nRUN echo a `\n  b\nCOPY --chown=\"app:app\" a /b\n", "D")
    assert df.escape == "`"
    run, copy = df.stages[0].instructions
    assert run.rest == "echo a   b"
    assert copy.flags == (("chown", "app:app"),)


def test_lone_double_dash_ends_the_flags():
    ins = parse_dockerfile("FROM a\nRUN --network=none -- --not-a-flag\n", "D").stages[0].instructions[0]
    assert ins.flags == (("network", "none"),) and ins.rest == "--not-a-flag"


def test_keywords_are_case_insensitive_and_supported_flags_accepted():
    df = parse_dockerfile("from a as B\nrun --network=default true\nadd --link=false --chmod=644 "
                          "--checksum=sha256:" + "a" * 64 + " https://x/y /y\n"
                          "healthcheck --interval=1m30s --timeout=5s --start-period=0s --retries=3 CMD true\n", "D")
    assert [i.keyword for i in df.stages[0].instructions] == ["RUN", "ADD", "HEALTHCHECK"]
    assert df.stages[0].name == "b"


def test_exec_form():
    assert exec_form('["a", "b c"]') == ["a", "b c"]
    assert exec_form("[ -f x ] && y") is None  # not JSON: the shell form
    assert exec_form("echo [1]") is None
    with pytest.raises(WordError, match="not of strings"):
        exec_form('["a", 1]')


# --- parse: errors ---------------------------------------------------------------------------

PARSE_ERRORS = [
    ("", 1, "no FROM"),
    ("ARG A=1\n# only args\nARG B\n", 3, "no FROM"),
    ("RUN true\nFROM a\n", 1, "RUN before the first FROM"),
    ("ENV A=1\nFROM a\n", 1, "ENV before the first FROM"),
    ("FROM a\nFOO bar\n", 2, "unknown instruction 'FOO'"),
    ("FROM a\nONBUILD RUN true\n", 2, "ONBUILD is not supported"),
    ("FROM a\nRUN --mount=type=cache,target=/root/.cache pip install x\n", 2, "RUN --mount"),
    ("FROM a\nRUN --security=insecure true\n", 2, "RUN --security"),
    ("FROM a\nRUN --network=host curl x\n", 2, "RUN --network=host is refused"),
    ("FROM a\nRUN --network=bridge true\n", 2, "--network=bridge is not a network mode"),
    ("FROM a\nRUN <<EOF\necho hi\nEOF\n", 2, "heredoc"),
    ("FROM a\nRUN cat <<'EOF' > /x\nhi\nEOF\n", 2, "heredoc"),
    ("FROM a\nCOPY <<EOF /etc/x\nhi\nEOF\n", 2, "COPY with a heredoc"),
    ("FROM a\nWORKDIR --x /app\n", 2, "WORKDIR: unknown flag --x"),
    ("FROM a\nCOPY --foo=1 a b\n", 2, "COPY: unknown flag --foo"),
    ("FROM a\nADD --from=b a b\n", 2, "ADD: unknown flag --from"),
    ("FROM --foo=1 a\n", 1, "FROM: unknown flag --foo"),
    ("FROM a\nADD --keep-git-dir https://x/y.git /y\n", 2, "ADD --keep-git-dir is not supported"),
    ("FROM a\nCOPY --parents a/b /c/\n", 2, "COPY --parents"),
    ("FROM a\nCOPY --from a b\n", 2, "COPY: --from needs a value"),
    ("FROM a\nCOPY --chown=a --chown=b a b\n", 2, "--chown is given twice"),
    ("FROM a\nCOPY --link=maybe a b\n", 2, "--link takes true or false"),
    ("FROM a\nHEALTHCHECK --interval=often CMD true\n", 2, "--interval=often is not a duration"),
    ("FROM a\nHEALTHCHECK --retries=x CMD true\n", 2, "--retries=x is not a whole number"),
    ("FROM a AS one\nFROM b AS ONE\n", 2, "'one' is already used by stage 0"),
    ("FROM a AS 1st\n", 1, "'1st' is not a valid stage name"),
    ("FROM a AS b/c\n", 1, "is not a valid stage name"),
    ("FROM a b\n", 1, "FROM: expected 'FROM image [AS name]'"),
    ("FROM a AS\n", 1, "FROM: expected"),
    ("FROM a\nSHELL /bin/bash -c\n", 2, "SHELL needs a non-empty JSON array"),
    ("FROM a\nSHELL []\n", 2, "SHELL needs a non-empty JSON array"),
    ("FROM a\nWORKDIR\n", 2, "WORKDIR needs arguments"),
    ("# escape=x\nFROM a\n", 1, "escape directive"),
]


@pytest.mark.parametrize(("text", "line", "message"), PARSE_ERRORS)
def test_parse_errors_name_the_file_and_line(text, line, message):
    with pytest.raises(BuildError) as info:
        parse_dockerfile(text, "Dockerfile")
    assert str(info.value).startswith(f"Dockerfile:{line}: ")
    assert message in str(info.value)


def test_build_error_is_an_image_error():
    assert issubclass(BuildError, ImageError) and issubclass(BuildError, ValueError)
