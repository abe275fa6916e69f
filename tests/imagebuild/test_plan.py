"""The stage planner of `sequester build` (:mod:`sequester.imagebuild.plan`): expansion and the environment, WORKDIR, USER,
SHELL, RUN, config-only instructions, COPY and ADD, and the steps' key_text (pure: no
images, no processes). The parser: tests/tasks/test_dockerfile_parse.py; stages:
tests/imagebuild/test_graph.py."""

from __future__ import annotations

import pytest
from dockerfile_plans import AMD64, copies, env_of, error, plan, runs

from sequester.tasks.dockerfile_parse import parse_dockerfile
from sequester.imagebuild.plan import DEFAULT_SHELL, stage_graph
from sequester.imagebuild.steps import ConfigStep, RunStep, WorkdirStep
from sequester.images.manifest import ImageConfig, Platform


# --- expansion and the environment ------------------------------------------------------------

def test_env_extends_the_base_images_path():
    steps, config = plan("FROM python\nENV PATH=/opt/bin:$PATH PYTHONPATH=/app:$PYTHONPATH\nRUN true\n")
    assert config.env == ("PATH=/opt/bin:/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8", "PYTHONPATH=/app:")
    assert env_of(steps[-1])["PATH"] == "/opt/bin:/usr/local/bin:/usr/bin:/bin"


def test_env_forms_quotes_and_same_line_semantics():
    _, config = plan('FROM a\nENV A=1\nENV A=2 B=$A C="x y" D=\'$A\' E=${NOPE:-dflt} F=\\$A\n'
                     'ENV LEGACY  hello   "big" world\n'
                     'ENV G=${A}${B}\n')
    env = config.env_map()
    assert (env["A"], env["B"], env["C"], env["D"], env["E"], env["F"]) == ("2", "1", "x y", "$A", "dflt", "$A")
    assert env["LEGACY"] == "hello   big world"
    assert env["G"] == "21"


def test_undefined_variables_expand_to_nothing_and_unset_ones_take_defaults():
    _, config = plan("FROM a\nARG UNSET\nENV A=[$NOPE] B=${UNSET-d1} C=${UNSET:+x} D=${LANG:+has}\n")
    env = config.env_map()
    assert (env["A"], env["B"], env["C"], env["D"]) == ("[]", "d1", "", "has")


def test_required_variable_error_names_the_line():
    message = error("FROM a\n\nWORKDIR ${APP_DIR:?set APP_DIR}\n")
    assert message.startswith("Dockerfile:3: WORKDIR: ") and "set APP_DIR" in message


def test_unterminated_quote_names_the_line():
    assert error('FROM a\nENV A="x\n').startswith("Dockerfile:2: ENV: ")


def test_env_wins_over_arg_and_args_stay_out_of_the_config():
    text = "FROM a\nARG V=from-arg\nARG ONLY=arg\nARG NOVALUE\nENV V=from-env\nRUN true\nWORKDIR /$V/$ONLY\n"
    steps, config = plan(text)
    run = next(s for s in steps if isinstance(s, RunStep))
    assert env_of(run)["V"] == "from-env" and env_of(run)["ONLY"] == "arg"
    assert "NOVALUE" not in env_of(run)  # declared without a value: not set
    assert config.workdir == "/from-env/arg"
    assert "ONLY" not in config.env_map() and config.env_map()["V"] == "from-env"
    assert list(run.env)[-1] == ("ONLY", "arg")  # the config's Env first, then the ARGs


def test_a_later_arg_wins_in_the_build_but_never_enters_the_config():
    # BuildKit: an ARG with a value sets the build environment when it runs, so it wins
    # over an ENV (or a base image variable) before it; the config keeps the ENV's value.
    steps, config = plan("FROM a\nENV V=from-env\nARG V=from-arg\nARG LANG=xx\nENV X=$V-$LANG\nRUN true\n")
    run = steps[-1]
    assert env_of(run)["V"] == "from-arg" and env_of(run)["LANG"] == "xx"
    assert config.env_map()["X"] == "from-arg-xx"
    assert config.env_map()["V"] == "from-env" and config.env_map()["LANG"] == "C.UTF-8"
    assert [k for k, _ in run.env] == ["PATH", "LANG", "V", "X"]  # the config's names keep their place
    # ``ARG V`` without a value (and no build arg) changes nothing.
    assert env_of(runs("FROM a\nENV V=e\nARG V\nRUN true\n")[0])["V"] == "e"


def test_every_stage_has_a_path():
    _, config = plan("FROM scratch\nENV A=1\n", base=ImageConfig())
    assert config.env == ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "A=1")
    assert plan("FROM a\nENV A=1\n")[1].env_map()["PATH"] == "/usr/local/bin:/usr/bin:/bin"


def test_build_args_override_defaults_and_undeclared_ones_are_ignored():
    text = "FROM a\nARG VERSION=1.0\nARG EMPTY\nRUN true\n"
    run = runs(text, build_args={"VERSION": "2.0", "EMPTY": "", "UNDECLARED": "x"})[0]
    assert env_of(run)["VERSION"] == "2.0" and env_of(run)["EMPTY"] == ""
    assert "UNDECLARED" not in env_of(run)
    assert env_of(runs(text)[0])["VERSION"] == "1.0"


def test_arg_defaults_expand_progressively():
    _, config = plan("FROM a\nARG A=1 B=${A}2\nENV C=$B\n")
    assert config.env_map()["C"] == "12"


def test_global_args_are_only_for_from_unless_redeclared():
    text = "ARG TAG=3.12\nARG OTHER=o\nFROM python:$TAG\nENV T1=[$TAG]\nARG TAG\nENV T2=[$TAG] O=[$OTHER]\n"
    _, config = plan(text)
    env = config.env_map()
    assert (env["T1"], env["T2"], env["O"]) == ("[]", "[3.12]", "[]")
    _, config = plan(text, build_args={"TAG": "3.13"})
    assert config.env_map()["T2"] == "[3.13]"


def test_global_args_expand_with_earlier_global_args():
    df = parse_dockerfile("ARG REG=docker.io\nARG IMAGE=$REG/library/python\nFROM ${IMAGE}:3.12\n", "D")
    assert stage_graph(df, {})[0].base_ref == "docker.io/library/python:3.12"
    assert stage_graph(df, {"REG": "ghcr.io"})[0].base_ref == "ghcr.io/library/python:3.12"
    assert stage_graph(df, {"IMAGE": "alpine"})[0].base_ref == "alpine:3.12"


def test_arg_scope_resets_per_stage():
    text = "FROM a AS one\nARG X=1\nFROM b\nENV Y=[$X]\n"
    assert plan(text)[1].env_map()["Y"] == "[]"


def test_proxy_args_reach_run_without_declaration_but_not_the_cache_key():
    text = "FROM a\nRUN curl x\n"
    plain = runs(text)[0]
    proxied = runs(text, build_args={"HTTP_PROXY": "http://proxy:3128", "no_proxy": "localhost"})[0]
    assert env_of(proxied)["HTTP_PROXY"] == "http://proxy:3128" and env_of(proxied)["no_proxy"] == "localhost"
    assert proxied.key_text == plain.key_text
    _, config = plan(text, build_args={"HTTP_PROXY": "http://proxy:3128"})
    assert "HTTP_PROXY" not in config.env_map()


def test_platform_args():
    text = "FROM --platform=$BUILDPLATFORM alpine AS a\nARG TARGETARCH\nENV ARCH=$TARGETARCH OS=[$TARGETOS]\n"
    _, config = plan(text, base=ImageConfig(platform=Platform("linux", "arm64", "v8")))
    assert (config.env_map()["ARCH"], config.env_map()["OS"]) == ("arm64", "[]")
    df = parse_dockerfile(text, "D")
    assert stage_graph(df, {}, platform=AMD64)[0].platform == "linux/amd64"
    assert stage_graph(df, {"BUILDPLATFORM": "linux/riscv64"}, platform=AMD64)[0].platform == "linux/riscv64"


# --- WORKDIR, USER, SHELL, RUN ----------------------------------------------------------------

def test_workdir_is_relative_to_the_previous_one():
    steps, config = plan("FROM a\nWORKDIR app\nWORKDIR src/../lib/\nENV D=data\nWORKDIR $D\nWORKDIR /srv\n",
                         base=ImageConfig(workdir="/home"))
    assert [s.path for s in steps if isinstance(s, WorkdirStep)] == ["/home/app", "/home/app/lib",
                                                                      "/home/app/lib/data", "/srv"]
    assert config.workdir == "/srv"


def test_user_is_expanded_and_carried():
    steps, config = plan("FROM a\nARG UID=1000\nUSER $UID:$UID\nWORKDIR /w\nRUN id\nCOPY a b\n")
    workdir, run, copy = (s for s in steps if not isinstance(s, ConfigStep))
    assert (workdir.user, run.user, copy.user, config.user) == ("1000:1000",) * 4
    assert runs("FROM a\nRUN id\n", base=ImageConfig(user="nobody"))[0].user == "nobody"


def test_run_shell_form_is_not_expanded_and_exec_form_is_as_is():
    first, second = runs('FROM a\nENV X=1\nRUN echo $X "quoted"  &&  ls\nRUN ["echo", "$X"]\n')
    assert first.argv == ("/bin/sh", "-c", 'echo $X "quoted"  &&  ls')
    assert second.argv == ("echo", "$X")
    assert first.workdir == "/" and first.network is None


def test_run_network_flag():
    assert runs("FROM a\nRUN --network=none make\n")[0].network == "none"


def test_shell_changes_later_runs_and_shell_form_cmd():
    steps, config = plan('FROM a\nRUN one\nSHELL ["/bin/bash", "-eo", "pipefail", "-c"]\nRUN two\n'
                         'CMD serve --port 80\nENTRYPOINT ["tini", "--"]\n')
    one, two = (s for s in steps if isinstance(s, RunStep))
    assert one.argv == ("/bin/sh", "-c", "one")
    assert two.argv == ("/bin/bash", "-eo", "pipefail", "-c", "two")
    assert config.shell == ("/bin/bash", "-eo", "pipefail", "-c")
    assert config.cmd == ("/bin/bash", "-eo", "pipefail", "-c", "serve --port 80")
    assert config.entrypoint == ("tini", "--")


def test_shell_of_the_base_image():
    base = ImageConfig(shell=("/bin/bash", "-c"))
    steps, config = plan("FROM a\nRUN x\n", base=base)
    assert steps[0].argv == ("/bin/bash", "-c", "x") and config.shell == ("/bin/bash", "-c")
    assert plan("FROM a\nRUN x\n")[1].shell == ()  # no SHELL anywhere: none recorded
    assert DEFAULT_SHELL == ("/bin/sh", "-c")


def test_entrypoint_resets_inherited_cmd_only():
    base = ImageConfig(cmd=("python3",), entrypoint=("/docker-entrypoint.sh",))
    assert plan('FROM a\nENTRYPOINT ["/run.sh"]\n', base=base)[1].cmd == ()
    assert plan('FROM a\nCMD ["x"]\nENTRYPOINT ["/run.sh"]\n', base=base)[1].cmd == ("x",)
    _, config = plan('FROM a\nENTRYPOINT ["/run.sh"]\nCMD ["y"]\n', base=base)
    assert (config.entrypoint, config.cmd) == (("/run.sh",), ("y",))
    _, config = plan("FROM a\nENV A=1\n", base=base)
    assert (config.entrypoint, config.cmd) == (("/docker-entrypoint.sh",), ("python3",))
    assert plan("FROM a\nCMD []\n", base=base)[1].cmd == ()


def test_json_array_of_non_strings_is_an_error():
    assert error('FROM a\nCMD ["a", 1]\n').startswith("Dockerfile:2: CMD: ")


# --- config-only instructions -----------------------------------------------------------------

def test_labels_ports_volumes_healthcheck_stopsignal():
    base = ImageConfig(labels=("org.base=1", "keep=yes"), exposed_ports=("22/tcp",), volumes=("/base",))
    _, config = plan('FROM a\nARG V=2.0\nLABEL version="$V" "com.example.name"="my app" org.base=2\n'
                     "LABEL legacy the rest\nMAINTAINER Ada <ada@example.com>\n"
                     "EXPOSE 80 53/udp 8000-8002 80/TCP\nENV P=9000\nEXPOSE $P\n"
                     'VOLUME ["/data", "/var/$V"]\nVOLUME /cache /tmp/x\nSTOPSIGNAL SIGINT\n'
                     "HEALTHCHECK --interval=5s CMD curl -f http://localhost/ || exit 1\n", base=base)
    assert config.labels == ("org.base=2", "keep=yes", "version=2.0", "com.example.name=my app",
                             "legacy=the rest", "maintainer=Ada <ada@example.com>")
    assert config.exposed_ports == ("22/tcp", "80/tcp", "53/udp", "8000/tcp", "8001/tcp", "8002/tcp", "9000/tcp")
    assert config.volumes == ("/base", "/data", "/var/2.0", "/cache", "/tmp/x")
    assert config.stop_signal == "SIGINT"
    assert config.healthcheck == ("CMD-SHELL", "curl -f http://localhost/ || exit 1")


def test_healthcheck_forms():
    assert plan('FROM a\nHEALTHCHECK CMD ["pg_isready", "-U", "x"]\n')[1].healthcheck == ("CMD", "pg_isready",
                                                                                           "-U", "x")
    assert plan("FROM a\nHEALTHCHECK NONE\n", base=ImageConfig(healthcheck=("CMD", "x")))[1].healthcheck == ("NONE",)
    assert plan("FROM a\nENV A=1\n", base=ImageConfig(healthcheck=("CMD", "x")))[1].healthcheck == ("CMD", "x")


@pytest.mark.parametrize(("text", "message"), [
    ("FROM a\nEXPOSE http\n", "EXPOSE: 'http' is not a port"),
    ("FROM a\nEXPOSE 80/icmp\n", "not tcp, udp or sctp"),
    ("FROM a\nEXPOSE 70000\n", "is not a port or range"),
    ("FROM a\nEXPOSE 90-80\n", "is not a port or range"),
    ("FROM a\nVOLUME [\"\"]\n", "VOLUME: a volume path is empty"),
    ("FROM a\nSTOPSIGNAL SIGNOPE\n", "STOPSIGNAL: 'SIGNOPE' is not a signal"),
    ("FROM a\nHEALTHCHECK NONE extra\n", "HEALTHCHECK NONE takes no arguments"),
    ("FROM a\nHEALTHCHECK --retries=3 NONE\n", "HEALTHCHECK NONE takes no arguments"),
    ("FROM a\nHEALTHCHECK curl x\n", "expected NONE or CMD"),
    ("FROM a\nHEALTHCHECK CMD\n", "CMD needs a command"),
    ("FROM a\nLABEL =x\n", "LABEL: a name is empty"),
    ("FROM a\nENV NAME\n", "ENV: 'NAME' has no value"),
    ("FROM a\nENV A=1 B\n", "ENV: 'B' is not NAME=value"),
    ("FROM a\nARG 1BAD=x\n", "ARG: '1BAD' is not a variable name"),
    ("FROM a\nRUN []\n", "RUN: needs a command"),
    ("FROM a\nWORKDIR $NOTHING\n", "WORKDIR: '$NOTHING' expands to nothing"),
])
def test_config_errors(text, message):
    assert error(text).startswith("Dockerfile:2: ")
    assert message in error(text)


@pytest.mark.parametrize("signal", ["SIGTERM", "term", "9", "SIGRTMIN+3", "RTMAX-1", "SIGKILL"])
def test_stop_signals(signal):
    assert plan(f"FROM a\nSTOPSIGNAL {signal}\n")[1].stop_signal == signal


# --- COPY and ADD ---------------------------------------------------------------------------

def test_copy_destinations():
    steps = copies("FROM a\nCOPY a /abs\nWORKDIR /app\nCOPY a rel\nCOPY a dir/\nCOPY a .\nCOPY a b c\n"
                   "COPY a ../up/x\nCOPY a ./x/.\n")
    assert [(s.dest, s.dest_is_dir) for s in steps] == [
        ("/abs", False), ("/app/rel", False), ("/app/dir", True), ("/app", True), ("/app/c", True),
        ("/up/x", False), ("/app/x", True)]
    assert steps[4].sources == ("a", "b")
    assert not steps[0].add and steps[0].from_stage is None and steps[0].from_image is None


def test_copy_sources_are_expanded_with_quotes_removed():
    first, second = copies('FROM a\nENV SRC=src D=/opt\nCOPY "my file" $SRC/*.py ${D}/\n'
                           'COPY ["$SRC/a b", "/dst dir/"]\n')
    assert first.sources == ("my file", "src/*.py") and first.dest == "/opt" and first.dest_is_dir
    assert second.sources == ("src/a b",) and second.dest == "/dst dir" and second.dest_is_dir


def test_copy_chown_chmod():
    step = copies("FROM a\nARG U=app\nCOPY --chown=$U:$U --chmod=0755 run.sh /usr/local/bin/\n")[0]
    assert (step.chown, step.chmod) == ("app:app", "0755")
    assert error("FROM a\nCOPY --chmod=u+x a b\n").startswith("Dockerfile:2: COPY: --chmod=u+x is not an octal")
    assert "--chmod=999" in error("FROM a\nCOPY --chmod=999 a b\n")


def test_copy_from_stages_and_images():
    text = ("FROM golang AS build\nRUN go build\nFROM alpine AS assets\nRUN true\nFROM debian\n"
            "COPY --from=BUILD /out /a\nCOPY --from=1 /x /b\nCOPY --from=nginx:1.25 /etc/nginx /c\n")
    first, second, third = copies(text)
    assert (first.from_stage, first.from_image) == (0, None)
    assert (second.from_stage, second.from_image) == (1, None)
    assert (third.from_stage, third.from_image) == (None, "nginx:1.25")


@pytest.mark.parametrize("text", [
    "FROM a\nFROM b\nCOPY --from=1 /x /y\n",        # itself, by number
    "FROM a\nFROM b\nCOPY --from=5 /x /y\n",        # no such stage
    "FROM a\nFROM b AS me\nCOPY --from=me /x /y\n",  # itself, by name
    "FROM a\nFROM b\nCOPY --from=later /x /y\nFROM c AS later\n",  # BuildKit builds stages in order
])
def test_copy_from_must_be_an_earlier_stage(text):
    message = error(text)
    assert message.startswith("Dockerfile:3: COPY: ") and "it must be defined before this one" in message


def test_copy_from_is_not_expanded():
    message = error("ARG IMG=alpine\nFROM a\nARG IMG\nCOPY --from=$IMG /x /y\n")
    assert message.startswith("Dockerfile:4: COPY: ") and "variables are not expanded in --from" in message


def test_add_urls_and_checksum():
    digest = "sha256:" + "0123456789abcdef" * 4
    step = copies(f"FROM a\nADD --checksum={digest} https://example.com/x.tar.gz /opt/\n")[0]
    assert step.add and step.sources == ("https://example.com/x.tar.gz",) and step.checksum == digest
    assert digest in step.key_text
    assert copies("FROM a\nADD http://x/file /f\n")[0].sources == ("http://x/file",)


@pytest.mark.parametrize(("text", "message"), [
    ("FROM a\nADD --checksum=md5:abc https://x/y /y\n", "--checksum=md5:abc is not sha256"),
    ("FROM a\nADD --checksum=sha256:" + "a" * 64 + " local.tar /y\n", "--checksum needs exactly one http(s) URL"),
    ("FROM a\nADD https://github.com/a/b.git /src\n", "adding a git repository is not supported"),
    ("FROM a\nADD git@github.com:a/b.git /src\n", "adding a git repository is not supported"),
    ("FROM a\nADD https://github.com/a/b.git#main /src\n", "git repository"),
    ("FROM a\nADD ftp://x/y /y\n", "ADD downloads only http and https"),
    ("FROM a\nCOPY https://x/y /y\n", "COPY does not download; use ADD"),
    ("FROM a\nCOPY onlyone\n", "COPY: needs at least one source and a destination"),
    ("FROM a\nCOPY --chown=$NOPE a b\n", "--chown=$NOPE expands to nothing"),
])
def test_copy_errors(text, message):
    assert error(text).startswith("Dockerfile:2: ")
    assert message in error(text)


# --- key_text -------------------------------------------------------------------------------

def keys(text: str, **kw) -> list[str]:
    return [s.key_text for s in plan(text, **kw)[0]]


def test_key_text_ignores_spelling():
    a = keys("FROM a\nENV A=1 B=2\nRUN make\nCOPY a b /dst/\nWORKDIR /app\nLABEL x=y\nEXPOSE 80\n")
    b = keys("from a\n# a comment\n\nENV   A=1    B=\"2\"   \n\n  RUN make  \nCOPY [\"a\", \"b\", \"/dst/\"]\n"
             "# another\nworkdir /app/\nLABEL \"x\"=y\nEXPOSE 80/tcp\n")
    assert a == b


def test_key_text_follows_what_the_step_sees():
    base = keys("FROM a\nENV A=1\nRUN make\n")
    assert keys("FROM a\nENV A=2\nRUN make\n")[1] != base[1]                      # an ENV value RUN inherits
    assert keys("FROM a\nENV A=1\nRUN make\n", base=ImageConfig(env=("X=1",)))[1] != base[1]  # the base's Env
    assert keys("FROM a\nENV A=1\nWORKDIR /x\nRUN make\n")[2] != base[1]           # the folder
    assert keys("FROM a\nENV A=1\nUSER me\nRUN make\n")[2] != base[1]              # the user
    assert keys("FROM a\nENV A=1\nRUN --network=none make\n")[1] != base[1]        # the network
    assert keys("FROM a\nENV A=1\nRUN make all\n")[1] != base[1]                   # the command
    args = "FROM a\nARG V=1\nRUN make\n"
    assert keys(args)[1] != keys(args, build_args={"V": "2"})[1]                   # a build arg RUN sees
    assert keys(args)[1] == keys(args, build_args={"OTHER": "2"})[1]               # one nothing declares
    copy = "FROM a\nARG M=644\nCOPY --chmod=$M a /b\n"
    assert keys(copy)[1] != keys(copy, build_args={"M": "600"})[1]


def test_copy_key_text_has_everything_but_the_text():
    step = copies("FROM a\nCOPY --from=img --chown=1:2 --chmod=600 a /b/\n")[0]
    for part in ('"sources":["a"]', '"dest":"/b"', '"dest_is_dir":true', '"from_image":"img"', '"chown":"1:2"',
                 '"chmod":"600"', '"op":"COPY"'):
        assert part in step.key_text
    assert "--from" not in step.key_text


def test_key_text_is_deterministic():
    text = "FROM a\nARG Z=1 A=2\nENV B=1 A=2\nRUN x\nHEALTHCHECK --timeout=3s --interval=5s CMD x\n"
    assert keys(text) == keys(text)
    assert all(k.startswith("{") for k in keys(text))
