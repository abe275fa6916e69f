"""A task's Dockerfile planned, not built (:mod:`sequester.tasks.dockerfile`, pure): its
syntax, ARG and ENV, COPY and WORKDIR, the instructions it cannot reproduce, and every
error naming the file and the line."""

import pytest

from sequester.errors import TaskError
from sequester.tasks import DockerfilePlan, parse_dockerfile


def parse(text, **kw) -> DockerfilePlan:
    return parse_dockerfile(text, "env/Dockerfile", **kw)


def unsupported(plan):
    return [(u.line, u.instruction) for u in plan.unsupported]


def test_continuations_comments_directives_and_case():
    plan = parse(
        "# syntax=docker/dockerfile:1\n"     # 1
        "# a comment\n"                      # 2
        "from python:3.12 AS base\n"         # 3
        "\n"                                 # 4
        "Copy a \\\n"                        # 5
        "   # a comment inside the continuation\n"
        "\n"
        "     b /dest/\n"                    # 8
        "workdir /app   \n"                  # 9
        "COPY c \\  \n"                      # 10: whitespace after the backslash
        "  d\n"
    )
    assert plan.base_image == "python:3.12"
    assert plan.workdir == "/app"
    first, second = plan.copies
    assert (first.sources, first.dest, first.dest_is_dir, first.line) == (("a", "b"), "/dest", True, 5)
    assert (second.sources, second.dest, second.dest_is_dir, second.line) == (("c",), "/app/d", False, 10)
    assert plan.unsupported == ()


def test_escape_directive():
    plan = parse("# escape=`\nFROM x\nENV A=1 `\n    B=2\nWORKDIR /a\\b\n")
    assert plan.env == (("A", "1"), ("B", "2"))
    assert plan.workdir == "/a\\b"  # a backslash is an ordinary character now


def test_arg_substitution():
    plan = parse(
        "ARG BASE=python\n"
        "ARG TAG=3.12\n"
        "FROM ${BASE}:$TAG\n"
        "ARG TAG\n"                     # re-declared in the stage: takes the global default
        "ARG ROOT=/srv\n"
        "ARG SUB=${ROOT}/app\n"
        "ARG EMPTY\n"                   # declared without a value: known to be unset
        "ARG UID\n"
        "WORKDIR $SUB\n"
        'COPY --chown=${UID:-1000}:1000 src/$TAG/ "${SUB}/v${TAG}/"\n'
        "ENV VERSION=$TAG LABEL=x${EMPTY:-none}y OTHER=${EMPTY}z\n"
        "COPY --chown=$USER_ID f /f\n"  # USER_ID is not defined anywhere: it may come from the base image
    )
    assert plan.base_image == "python:3.12"
    assert plan.workdir == "/srv/app"
    (copy,) = plan.copies
    assert copy.sources == ("src/3.12/",) and copy.dest == "/srv/app/v3.12" and copy.dest_is_dir
    assert copy.chown == "1000:1000" and copy.line == 10
    assert plan.env == (("VERSION", "3.12"), ("LABEL", "xnoney"), ("OTHER", "z"))
    assert unsupported(plan) == [(12, "COPY")]
    assert "$USER_ID" in plan.unsupported[0].reason


def test_global_arg_is_not_visible_in_the_stage_without_redeclaration():
    plan = parse("ARG V=1\nFROM x\nWORKDIR /v$V\n")
    assert plan.workdir is None
    assert unsupported(plan) == [(3, "WORKDIR")]
    assert "$V" in plan.unsupported[0].reason


def test_undefined_variables_are_reported_unless_the_base_env_is_given():
    text = 'FROM x\nENV PATH="/opt/tool/bin:$PATH"\n'
    plan = parse(text)
    assert plan.env == () and unsupported(plan) == [(2, "ENV")]
    assert "base image" in plan.unsupported[0].reason
    plan = parse(text, base_env={"PATH": "/usr/bin:/bin"})
    assert plan.env == (("PATH", "/opt/tool/bin:/usr/bin:/bin"),)
    assert plan.unsupported == ()


def test_copy_json_and_plain_forms():
    plan = parse(
        "FROM x\n"
        "WORKDIR /app\n"
        'COPY ["my file.txt", "dest dir/"]\n'
        'COPY --chown=app:app --chmod=0755 ["run.sh", "/usr/bin/run"]\n'
        "COPY --link a b c/\n"
        "ADD one.txt two.txt ./\n"
        "COPY [not json /x\n"   # not JSON: the plain form
    )
    steps = [(c.instruction, c.sources, c.dest, c.dest_is_dir, c.chown, c.chmod) for c in plan.copies]
    assert steps == [
        ("COPY", ("my file.txt",), "/app/dest dir", True, None, None),
        ("COPY", ("run.sh",), "/usr/bin/run", False, "app:app", "0755"),
        ("COPY", ("a", "b"), "/app/c", True, None, None),
        ("ADD", ("one.txt", "two.txt"), "/app", True, None, None),
        ("COPY", ("[not", "json"), "/x", True, None, None),
    ]


def test_destination_directory_rules():
    plan = parse(
        "FROM x\n"
        "COPY f /app\n"             # /app does not exist yet: the file becomes /app
        "WORKDIR /srv/data\n"
        "COPY f .\n"                # '.' is the working directory
        "COPY f /srv\n"             # /srv exists (parent of a WORKDIR)
        "COPY f /srv/data\n"        # exists (WORKDIR)
        "COPY f ../other\n"         # relative to WORKDIR, a new name: a file
        "COPY f /usr/local/bin\n"   # a folder every base image has
        "COPY f /opt/tool/\n"       # trailing slash
        "COPY f /opt/tool\n"        # known since the previous copy
        "COPY f g /many\n"          # several sources
    )
    assert [(c.dest, c.dest_is_dir) for c in plan.copies] == [
        ("/app", False), ("/srv/data", True), ("/srv", True), ("/srv/data", True), ("/srv/other", False),
        ("/usr/local/bin", True), ("/opt/tool", True), ("/opt/tool", True), ("/many", True),
    ]


def test_relative_workdir_resolves_against_the_previous_one():
    plan = parse("FROM x\nWORKDIR app\nWORKDIR sub/dir\nWORKDIR ../up\nCOPY f rel/\n")
    assert plan.workdir == "/app/sub/up"
    assert plan.copies[0].dest == "/app/sub/up/rel"
    assert parse("FROM x\n").workdir is None


def test_env_forms():
    plan = parse(
        "FROM x\n"
        'ENV A=1 B="two words" C=\'single $quoted\'\n'
        "ENV LEGACY value with  spaces\n"
        "ENV D=$A E=${B}! F=\\$A\n"
        "ENV A=2 G=$A\n"            # values see the environment from before the line
        "ENV EMPTY=\n"
    )
    assert plan.env == (
        ("A", "1"), ("B", "two words"), ("C", "single $quoted"),
        ("LEGACY", "value with  spaces"),
        ("D", "1"), ("E", "two words!"), ("F", "$A"),
        ("A", "2"), ("G", "1"),
        ("EMPTY", ""),
    )
    assert plan.env_map["A"] == "2"


def test_unsupported_instructions_are_reported_with_line_numbers():
    plan = parse(
        "FROM ubuntu:24.04\n"                          # 1
        "RUN apt-get update && \\\n"                   # 2
        "    apt-get install -y curl\n"
        "USER app\n"                                   # 4
        "EXPOSE 8080\n"                                # 5
        'CMD ["bash"]\n'                               # 6
        'ENTRYPOINT ["/bin/sh"]\n'                     # 7
        "VOLUME /data\n"                               # 8
        "HEALTHCHECK CMD true\n"                       # 9
        'SHELL ["/bin/bash", "-c"]\n'                  # 10
        'LABEL a="b"\n'                                # 11
        "STOPSIGNAL SIGTERM\n"                         # 12
        "ONBUILD COPY . /x\n"                          # 13
        "COPY --from=builder /out /app/\n"             # 14
        "ADD https://example.com/tool.tgz /opt/\n"     # 15
        "ADD https://github.com/org/repo.git /src\n"   # 16
        "ADD git@github.com:org/repo.git /src\n"       # 17
        "ADD vendor.tar.gz /opt/\n"                    # 18
        "COPY --parents a/b /x/\n"                     # 19
        "FRMO typo\n"                                  # 20
        "RUN <<EOF\n"                                  # 21
        "WORKDIR /not-an-instruction\n"
        "COPY secret /\n"
        "EOF\n"
        "COPY <<EOF /etc/motd\n"                       # 25
        "hello\n"
        "EOF\n"
        "COPY ok /ok\n"                                # 28
        "FROM alpine\n"                                # 29
        "COPY later /later\n"                          # 30
        "WORKDIR /later\n"                             # 31
    )
    assert unsupported(plan) == [
        (2, "RUN"), (4, "USER"), (5, "EXPOSE"), (6, "CMD"), (7, "ENTRYPOINT"), (8, "VOLUME"), (9, "HEALTHCHECK"),
        (10, "SHELL"), (11, "LABEL"), (12, "STOPSIGNAL"), (13, "ONBUILD"), (14, "COPY"), (15, "ADD"), (16, "ADD"),
        (17, "ADD"), (18, "ADD"), (19, "COPY"), (20, "FRMO"), (21, "RUN"), (25, "COPY"), (29, "FROM"), (30, "COPY"),
        (31, "WORKDIR"),
    ]
    reasons = {u.line: u.reason for u in plan.unsupported}
    assert "--from" in reasons[14] and "URL" in reasons[15] and "git" in reasons[16] and "git" in reasons[17]
    assert "archive" in reasons[18] and "--parents" in reasons[19] and "not a Dockerfile instruction" in reasons[20]
    assert "heredoc" in reasons[25] and "multi-stage" in reasons[29] and "multi-stage" in reasons[30]
    assert plan.unsupported[0].text == "RUN apt-get update && \\\n    apt-get install -y curl"
    assert "COPY secret /" in plan.unsupported[18].text  # the heredoc body belongs to the RUN
    # Only the one plain COPY of the first stage is applied; nothing after the second FROM.
    assert [(c.sources, c.dest) for c in plan.copies] == [(("ok",), "/ok")]
    assert plan.base_image == "ubuntu:24.04" and plan.workdir is None


@pytest.mark.parametrize("text, message", [
    ("", "env/Dockerfile: no FROM instruction"),
    ("# only a comment\n", "env/Dockerfile: no FROM instruction"),
    ("ARG X=1\nCOPY a b\nFROM x\n", "env/Dockerfile:2: COPY before the first FROM"),
    ("FROM\n", "env/Dockerfile:1: FROM: expected"),
    ("FROM $NOPE\n", "env/Dockerfile:1: FROM: $NOPE is not declared"),
    ("FROM x\nCOPY onlyone\n", "env/Dockerfile:2: COPY: needs at least one source and a destination"),
    ("FROM x\nCOPY --chown a b\n", "env/Dockerfile:2: COPY: --chown needs a value"),
    ("FROM x\nWORKDIR\n", "env/Dockerfile:2: WORKDIR: needs a path"),
    ('FROM x\n\nWORKDIR "/app\n', "env/Dockerfile:3: WORKDIR: unterminated \" quote"),
    ("FROM x\nENV A=${B\n", "env/Dockerfile:2: ENV: missing '}'"),
    ("FROM x\nARG B=1\nENV A=${B/x/y}\n", "env/Dockerfile:3: ENV: unsupported substitution"),
    ("FROM x\nARG B\nENV A=${B:?required}\n", "env/Dockerfile:3: ENV: $B: required"),
    ("FROM x\nARG B\nENV A=${B?}\n", "env/Dockerfile:3: ENV: $B: is not set"),
    ("FROM x\nENV LONELY\n", "env/Dockerfile:2: ENV: 'LONELY' has no value"),
    ("FROM x\nENV A=1 B\n", "env/Dockerfile:2: ENV: 'B' is not NAME=value"),
    ("FROM x\nARG 1BAD=2\n", "env/Dockerfile:2: ARG: '1BAD' is not a variable name"),
])
def test_dockerfile_errors_name_the_file_and_line(text, message):
    with pytest.raises(TaskError) as err:
        parse(text)
    assert str(err.value).startswith(message)
