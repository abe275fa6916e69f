"""Task loading (Terminal-Bench 2 / Harbor layout): task.toml, Dockerfile plan, copies, discovery."""

import hashlib
import io
import os
import tarfile
from pathlib import Path

import pytest

from sequester.errors import SequesterError, TaskError
from sequester.tasks import (DockerfilePlan, Task, TaskConfig, find_tasks, load_task, parse_dockerfile,
                             parse_task_config, resolve_copies)
from sequester.tasks.task_toml import EnvironmentConfig

# --- task.toml ---------------------------------------------------------------------------

OLD_SCHEMA = """
version = "1.0"

[metadata]
author_name = "Ada"
difficulty = "easy"
tags = ["files"]

[verifier]
timeout_sec = 120.0

[agent]
timeout_sec = 300

[environment]
build_timeout_sec = 600.0   # not read, tolerated
cpus = 2
memory = "2G"
storage = "10G"
allow_internet = false

[something_new]
x = 1
"""

NEW_SCHEMA = """
schema_version = "1.1"

[verifier]
timeout_sec = 90
env = { API_URL = "http://127.0.0.1:8000" }

[environment]
docker_image = "python:3.12-slim"
memory_mb = 4096
storage_mb = 512
workdir = "/app"
network_mode = "allowlist"
allowed_hosts = ["pypi.org", "files.pythonhosted.org"]
"""


def test_old_schema_is_normalised():
    config = parse_task_config(OLD_SCHEMA, "task.toml")
    assert isinstance(config, TaskConfig)
    assert config.schema_version == "1.0"
    assert config.verifier.timeout_sec == 120.0 and config.verifier.env == {}
    assert config.agent.timeout_sec == 300.0
    env = config.environment
    assert (env.cpus, env.memory_mb, env.storage_mb) == (2.0, 2048, 10240)
    assert env.allow_internet is False and env.network_mode is None
    assert env.effective_network_mode == "no-network"
    assert config.metadata == {"author_name": "Ada", "difficulty": "easy", "tags": ["files"]}


def test_new_schema():
    config = parse_task_config(NEW_SCHEMA, "task.toml")
    assert config.schema_version == "1.1"
    assert config.verifier.timeout_sec == 90.0
    assert config.verifier.env == {"API_URL": "http://127.0.0.1:8000"}
    env = config.environment
    assert env.docker_image == "python:3.12-slim"
    assert (env.memory_mb, env.storage_mb, env.workdir) == (4096, 512, "/app")
    assert env.effective_network_mode == "allowlist"
    assert env.allowed_hosts == ("pypi.org", "files.pythonhosted.org")


def test_defaults_for_an_empty_file():
    config = parse_task_config("", "task.toml")
    assert config.verifier.timeout_sec == 600.0
    assert config.agent.timeout_sec is None
    assert config.environment == EnvironmentConfig()
    assert config.environment.effective_network_mode == "public"
    assert config.metadata == {} and config.schema_version is None


@pytest.mark.parametrize("text, mb", [("2G", 2048), ("512M", 512), ("1024K", 1), ("512K", 1), ("1.5G", 1536),
                                      ("2GB", 2048), ("2gi", 2048), (" 1T ", 1024 * 1024)])
def test_memory_strings(text, mb):
    config = parse_task_config(f'[environment]\nmemory = "{text}"', "task.toml")
    assert config.environment.memory_mb == mb


def test_old_and_new_size_keys_may_both_be_given_if_they_agree():
    config = parse_task_config('[environment]\nmemory = "1G"\nmemory_mb = 1024', "task.toml")
    assert config.environment.memory_mb == 1024


@pytest.mark.parametrize("environment, mode", [
    ("", "public"),
    ("allow_internet = true", "public"),
    ("allow_internet = false", "no-network"),
    ('network_mode = "no-network"', "no-network"),
    ('allow_internet = true\nnetwork_mode = "no-network"', "no-network"),
    ('allow_internet = false\nnetwork_mode = "allowlist"', "allowlist"),
    ('network_mode = "allowlist"', "allowlist"),
    ('network_mode = "public"', "public"),
])
def test_network_mode_resolution(environment, mode):
    config = parse_task_config(f"[environment]\n{environment}", "task.toml")
    assert config.environment.effective_network_mode == mode


@pytest.mark.parametrize("text, message", [
    ('[verifier]\ntimeout_sec = "abc"', "task.toml: [verifier] timeout_sec: 'abc' is not a positive number"),
    ("[verifier]\ntimeout_sec = 0", "task.toml: [verifier] timeout_sec: 0 is not a positive number"),
    ("[verifier]\ntimeout_sec = -5.0", "task.toml: [verifier] timeout_sec: -5.0 is not a positive number"),
    ("[verifier]\ntimeout_sec = true", "task.toml: [verifier] timeout_sec: True is not a positive number"),
    ("[verifier]\ntimeout_sec = nan", "task.toml: [verifier] timeout_sec: nan is not a positive number"),
    ("[verifier]\nenv = { A = 1 }", "task.toml: [verifier] env.A: 1 is not a string"),
    ('[verifier]\nenv = "A=1"', "task.toml: [verifier] env: 'A=1' is not a table"),
    ("[agent]\ntimeout_sec = -1", "task.toml: [agent] timeout_sec: -1 is not a positive number"),
    ('[environment]\nmemory = "lots"', "task.toml: [environment] memory: 'lots' is not a size"),
    ('[environment]\nmemory = "2048"', "task.toml: [environment] memory: '2048' is not a size"),
    ("[environment]\nmemory = 2048", "task.toml: [environment] memory: 2048 is not a size"),
    ('[environment]\nmemory = "0G"', "task.toml: [environment] memory: '0G' is not a positive size"),
    ('[environment]\nstorage = "ten gigs"', "task.toml: [environment] storage: 'ten gigs' is not a size"),
    ('[environment]\nmemory_mb = "2G"', "task.toml: [environment] memory_mb: '2G' is not a positive whole number"),
    ("[environment]\nmemory_mb = 1.5", "task.toml: [environment] memory_mb: 1.5 is not a positive whole number"),
    ("[environment]\nstorage_mb = 0", "task.toml: [environment] storage_mb: 0 is not a positive whole number"),
    ('[environment]\nmemory = "1G"\nmemory_mb = 512',
     "task.toml: [environment] memory = '1G' and memory_mb = 512 disagree"),
    ('[environment]\ncpus = "2"', "task.toml: [environment] cpus: '2' is not a positive number"),
    ('[environment]\ndocker_image = 3', "task.toml: [environment] docker_image: 3 is not an image name"),
    ('[environment]\nworkdir = "app"', "task.toml: [environment] workdir: 'app' is not an absolute path"),
    ('[environment]\nallow_internet = "yes"', "task.toml: [environment] allow_internet: 'yes' is not true or false"),
    ('[environment]\nnetwork_mode = "open"', "task.toml: [environment] network_mode: 'open' is not one of"),
    ('[environment]\nnetwork_mode = "public"\nallowed_hosts = ["a.com"]',
     "task.toml: [environment] allowed_hosts: only allowed with network_mode = 'allowlist'"),
    ('[environment]\nallowed_hosts = ["a.com"]', "task.toml: [environment] allowed_hosts: only allowed"),
    ('[environment]\nnetwork_mode = "allowlist"\nallowed_hosts = "a.com"',
     "task.toml: [environment] allowed_hosts: 'a.com' is not a list"),
    ('[environment]\nnetwork_mode = "allowlist"\nallowed_hosts = ["a b"]',
     "task.toml: [environment] allowed_hosts[0]: 'a b' is not a host name"),
    ('[environment]\nallow_internet = false\nnetwork_mode = "public"',
     "task.toml: [environment] network_mode: 'public' contradicts allow_internet = false"),
    ("verifier = 3", "task.toml: [verifier]: 3 is not a table"),
    ("metadata = []", "task.toml: [metadata]: [] is not a table"),
    ("version = 1", "task.toml: version: 1 is not a string"),
    ('version = "1.0"\nschema_version = "2.0"', "task.toml: version = '1.0' and schema_version = '2.0' disagree"),
])
def test_config_errors_name_the_file_and_field(text, message):
    with pytest.raises(TaskError) as err:
        parse_task_config(text, "task.toml")
    assert str(err.value).startswith(message)


def test_invalid_toml_names_the_file_and_the_parser_message():
    with pytest.raises(TaskError, match=r"^/x/hello/task.toml: not valid TOML: .*line 2") as err:
        parse_task_config("[verifier]\ntimeout_sec = = 3\n", "/x/hello/task.toml")
    assert isinstance(err.value, SequesterError) and isinstance(err.value, ValueError)


# --- Dockerfile --------------------------------------------------------------------------


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


# --- resolve_copies ----------------------------------------------------------------------


def make_files(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def context(tmp_path):
    ctx = tmp_path / "environment"
    make_files(ctx, {"Dockerfile": "FROM x\n", "a.txt": "a", "b.txt": "b", "src/main.py": "m",
                     "src/pkg/__init__.py": "", "src/pkg/mod.py": "x"})
    (ctx / "src" / "empty").mkdir()
    return ctx


def resolved(text, ctx):
    return [(str(host.relative_to(ctx.resolve())), dest)
            for host, dest in resolve_copies(parse_dockerfile(text, "Dockerfile"), ctx)]


def test_resolve_copies_follows_dockers_rules(context):
    pairs = resolved(
        "FROM x\n"
        "WORKDIR /app\n"
        "COPY a.txt .\n"              # into the working directory
        "COPY a.txt /etc/conf\n"      # a single file becomes the destination
        "COPY src /app/code\n"        # a directory: its contents
        "COPY *.txt /data\n"          # a wildcard matching several files: a directory
        "COPY src/pkg/m?d.py b.txt /lib/\n",
        context,
    )
    assert pairs == [
        ("a.txt", "/app/a.txt"),
        ("a.txt", "/etc/conf"),
        ("src", "/app/code"),
        ("src/empty", "/app/code/empty"),
        ("src/main.py", "/app/code/main.py"),
        ("src/pkg", "/app/code/pkg"),
        ("src/pkg/__init__.py", "/app/code/pkg/__init__.py"),
        ("src/pkg/mod.py", "/app/code/pkg/mod.py"),
        ("a.txt", "/data/a.txt"),
        ("b.txt", "/data/b.txt"),
        ("src/pkg/mod.py", "/lib/mod.py"),
        ("b.txt", "/lib/b.txt"),
    ]


def test_resolve_copies_whole_context(context):
    pairs = resolved("FROM x\nCOPY . /app/\n", context)
    assert pairs[0] == (".", "/app")
    assert ("Dockerfile", "/app/Dockerfile") in pairs and ("src/pkg/mod.py", "/app/src/pkg/mod.py") in pairs


@pytest.mark.parametrize("text, message", [
    ("FROM x\nCOPY ../secret /s\n", "Dockerfile:2: source '../secret' is outside the build context"),
    ("FROM x\n\nCOPY src/../../secret /s\n", "Dockerfile:3: source 'src/../../secret' is outside the build context"),
    ("FROM x\nCOPY .. /s/\n", "Dockerfile:2: source '..' is outside the build context"),
    ("FROM x\nCOPY /etc/passwd /s\n", "Dockerfile:2: source '/etc/passwd' is an absolute path"),
    ("FROM x\nCOPY missing.txt /s\n", "Dockerfile:2: source 'missing.txt' does not exist in the build context"),
    ("FROM x\nCOPY *.nothing /s/\n", "Dockerfile:2: source '*.nothing' matches nothing in the build context"),
])
def test_resolve_copies_refuses_sources_outside_or_missing(context, text, message):
    (context.parent / "secret").write_text("s")
    with pytest.raises(TaskError) as err:
        resolve_copies(parse_dockerfile(text, "Dockerfile"), context)
    assert str(err.value).startswith(message)


def test_a_symlink_source_pointing_outside_is_refused(context, tmp_path):
    (tmp_path / "secret").write_text("s")
    (context / "link").symlink_to(tmp_path / "secret")
    with pytest.raises(TaskError, match=r"^Dockerfile:2: source 'link': .* outside the build context"):
        resolve_copies(parse_dockerfile("FROM x\nCOPY link /s\n", "Dockerfile"), context)
    with pytest.raises(TaskError, match=r"^Dockerfile:2: source '\*': .*link.* outside the build context"):
        resolve_copies(parse_dockerfile("FROM x\nCOPY * /s/\n", "Dockerfile"), context)


def test_a_symlink_inside_a_copied_directory_pointing_outside_is_refused(context, tmp_path):
    (tmp_path / "outside").mkdir()
    (context / "src" / "pkg" / "escape").symlink_to(tmp_path / "outside")
    with pytest.raises(TaskError, match=r"^Dockerfile:3: source 'src': .*escape.* outside the build context"):
        resolve_copies(parse_dockerfile("FROM x\n\nCOPY src /app\n", "Dockerfile"), context)


def test_symlinked_directory_outside_cannot_be_reached_by_a_path_through_it(context, tmp_path):
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "f").write_text("x")
    (context / "door").symlink_to(tmp_path / "outside")
    with pytest.raises(TaskError, match="outside the build context"):
        resolve_copies(parse_dockerfile("FROM x\nCOPY door/f /f\n", "Dockerfile"), context)


def test_symlinks_inside_the_context_are_fine(context):
    (context / "alias.txt").symlink_to("a.txt")
    (context / "src" / "pkg" / "link.py").symlink_to("mod.py")
    pairs = resolved("FROM x\nCOPY alias.txt /x/\nCOPY src/pkg /p\n", context)
    assert pairs[0] == ("a.txt", "/x/alias.txt")  # followed, keeps its own name
    host = resolve_copies(parse_dockerfile("FROM x\nCOPY src/pkg /p\n", "Dockerfile"), context)
    links = [(h.name, d) for h, d in host if h.is_symlink()]
    assert links == [("link.py", "/p/link.py")]  # inside a directory: listed as the link itself


def test_add_of_an_archive_is_refused_by_content(context):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("inner.txt")
        tar.addfile(info, io.BytesIO(b""))
    (context / "data.bin").write_bytes(buffer.getvalue())
    plan = parse_dockerfile("FROM x\nADD data.bin /opt/\nCOPY data.bin /copy/\n", "Dockerfile")
    assert plan.unsupported == ()  # the name does not say it is an archive
    with pytest.raises(TaskError, match=r"^Dockerfile:2: ADD data.bin: .*archive Docker would extract"):
        resolve_copies(plan, context)
    plan = parse_dockerfile("FROM x\nADD a.txt /opt/\nCOPY data.bin /copy/\n", "Dockerfile")
    assert [d for _, d in resolve_copies(plan, context)] == ["/opt/a.txt", "/copy/data.bin"]


def test_dockerignore_and_special_files_are_refused(context):
    os.mkfifo(context / "src" / "fifo")
    with pytest.raises(TaskError, match="fifo is not a file, directory or symlink"):
        resolve_copies(parse_dockerfile("FROM x\nCOPY src /app\n", "Dockerfile"), context)
    (context / ".dockerignore").write_text("*.txt\n")
    with pytest.raises(TaskError, match=r"\.dockerignore: \.dockerignore is not supported"):
        resolve_copies(parse_dockerfile("FROM x\nCOPY a.txt /app\n", "Dockerfile"), context)


# --- task directories --------------------------------------------------------------------

DOCKERFILE = "FROM python:3.12-slim\nWORKDIR /app\nCOPY app.py .\n"


def make_task(root: Path, name: str = "hello", **overrides) -> Path:
    files = {
        "instruction.md": "Write hello.txt.\n",
        "task.toml": OLD_SCHEMA,
        "environment/Dockerfile": DOCKERFILE,
        "environment/app.py": "print('hi')\n",
        "tests/test.sh": "#!/bin/sh\npytest /tests\n",
        "tests/test_outputs.py": "def test_x():\n    pass\n",
        "solution/solve.sh": "#!/bin/sh\necho hello > hello.txt\n",
    }
    files.update(overrides)
    task = root / name
    make_files(task, {k: v for k, v in files.items() if v is not None})
    return task


def test_load_task(tmp_path):
    task = load_task(make_task(tmp_path))
    assert isinstance(task, Task)
    assert task.name == "hello" and task.path == tmp_path / "hello"
    assert task.instruction == "Write hello.txt.\n"
    assert task.config.environment.memory_mb == 2048
    assert task.dockerfile is not None and task.dockerfile.base_image == "python:3.12-slim"
    assert task.dockerfile.source == str(tmp_path / "hello" / "environment" / "Dockerfile")
    assert task.default_workdir == "/app"
    assert task.tests_dir == tmp_path / "hello" / "tests"
    assert task.test_script == tmp_path / "hello" / "tests" / "test.sh"
    assert task.test_files == (tmp_path / "hello" / "tests" / "test_outputs.py",)
    assert task.environment_dir == tmp_path / "hello" / "environment"
    assert task.solution_dir == tmp_path / "hello" / "solution" and task.has_solution
    assert resolve_copies(task.dockerfile, task.environment_dir) == [
        (task.environment_dir / "app.py", "/app/app.py")]


def test_optional_parts(tmp_path):
    path = make_task(tmp_path, **{"environment/Dockerfile": None, "environment/app.py": None,
                                  "solution/solve.sh": None, "tests/test.sh": None})
    task = load_task(path)
    assert task.dockerfile is None and task.default_workdir is None
    assert task.test_script is None and not task.has_solution
    assert load_task(make_task(tmp_path, "only-sh", **{"tests/test_outputs.py": None})).test_script is not None


@pytest.mark.parametrize("overrides, message", [
    ({"instruction.md": None}, "hello/instruction.md: missing"),
    ({"instruction.md": "  \n"}, "hello/instruction.md: empty"),
    ({"task.toml": None}, "hello/task.toml: missing"),
    ({"task.toml": "[verifier]\ntimeout_sec = 'abc'\n"}, "hello/task.toml: [verifier] timeout_sec: 'abc'"),
    ({"tests/test.sh": None, "tests/test_outputs.py": None}, "hello/tests: missing"),
    ({"tests/test.sh": None, "tests/test_outputs.py": None, "tests/helper.py": ""},
     "hello/tests: has neither test.sh nor a test_*.py file"),
    ({"environment/Dockerfile": "FROM x\nCOPY\n"}, "hello/environment/Dockerfile:2: COPY: needs"),
])
def test_load_task_errors_name_the_file(tmp_path, overrides, message):
    path = make_task(tmp_path, **overrides)
    with pytest.raises(TaskError) as err:
        load_task(path)
    assert str(err.value).startswith(str(tmp_path / message))


def test_load_task_refuses_non_utf8_and_files_outside_the_task(tmp_path):
    path = make_task(tmp_path)
    (path / "instruction.md").write_bytes(b"caf\xe9\n")
    with pytest.raises(TaskError, match=r"instruction.md: not UTF-8 text"):
        load_task(path)
    (tmp_path / "secret").write_text("host secret\n")
    (path / "instruction.md").unlink()
    (path / "instruction.md").symlink_to(tmp_path / "secret")
    with pytest.raises(TaskError, match=r"hello/instruction.md: resolves to .*secret, outside the task directory"):
        load_task(path)
    with pytest.raises(TaskError, match=r"nowhere: does not exist"):
        load_task(tmp_path / "nowhere")


def test_find_tasks_single_task_and_folder_of_tasks(tmp_path):
    suite = tmp_path / "suite"
    for name in ("zeta", "alpha", "mid"):
        make_task(suite, name)
    (suite / ".git").mkdir()
    (suite / "README.md").write_text("not a task")
    single = make_task(tmp_path / "extra", "solo")
    tasks = find_tasks([suite, single])
    assert [t.name for t in tasks] == ["alpha", "mid", "zeta", "solo"]
    assert [t.name for t in find_tasks([str(single)])] == ["solo"]


def test_find_tasks_errors(tmp_path):
    make_task(tmp_path / "a", "same")
    make_task(tmp_path / "b", "same")
    with pytest.raises(TaskError, match=r"b/same: duplicate task name 'same' \(also .*a/same\)"):
        find_tasks([tmp_path / "a", tmp_path / "b"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(TaskError, match=r"empty: neither a task \(no task.toml\) nor a folder of tasks"):
        find_tasks([tmp_path / "empty"])
    with pytest.raises(TaskError, match=r"missing: does not exist"):
        find_tasks([tmp_path / "missing"])
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(TaskError, match=r"file.txt: not a directory"):
        find_tasks([tmp_path / "file.txt"])
    broken = make_task(tmp_path, "no-toml", **{"task.toml": None})
    with pytest.raises(TaskError, match=r"no-toml/task.toml: missing"):
        find_tasks([broken])
    make_task(tmp_path / "mixed", "good")
    (tmp_path / "mixed" / "broken").mkdir()
    with pytest.raises(TaskError, match=r"mixed/broken/task.toml: missing"):
        find_tasks([tmp_path / "mixed"])


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under root: kind, mode, size, mtime and a content hash (files) or target (links)."""
    out = {}
    for folder, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(folder) / name
            st = path.lstat()
            if path.is_symlink():
                detail = os.readlink(path)
            elif path.is_file():
                detail = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                detail = sorted(os.listdir(path))
            out[str(path.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns, detail)
    return out


def test_loading_leaves_the_task_directory_byte_identical(tmp_path):
    suite = tmp_path / "suite"
    path = make_task(suite, **{"environment/Dockerfile": DOCKERFILE + "COPY . /src/\nRUN make\n",
                               "environment/data/blob.bin": "\x00\x01binary"})
    (path / "environment" / "alias.py").symlink_to("app.py")
    make_task(suite, "second")
    before = snapshot(tmp_path)
    task = load_task(path)
    find_tasks([suite])
    resolve_copies(task.dockerfile, task.environment_dir)
    assert (task.test_script, task.has_solution, task.test_files) != (None, False, ())
    assert snapshot(tmp_path) == before
