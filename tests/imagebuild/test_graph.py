"""The stages of `sequester build` (:mod:`sequester.imagebuild.graph`): the stage graph, which stages a target needs, a stage
built on another, and realistic Terminal-Bench-2 style Dockerfiles, one and several stages
(pure: no images, no processes)."""

from __future__ import annotations

import pytest
from dockerfile_plans import AMD64, BASE, env_of, error, plan

from sequester.errors import BuildError
from sequester.tasks.dockerfile_parse import parse_dockerfile
from sequester.imagebuild.plan import StageBase, StagePlanner, needed_stages, stage_graph, stage_names, target_stage
from sequester.imagebuild.steps import CopyStep
from sequester.images.manifest import ImageConfig


# --- stages -----------------------------------------------------------------------------------

MULTI = """\
ARG BASE=python:3.12-slim
FROM ${BASE} AS deps
RUN pip install numpy
FROM node:20 AS unused
RUN npm ci
FROM scratch AS tools
COPY --from=0 /etc/os-release /
FROM deps AS test
COPY --from=unused /x /y
FROM deps AS final
COPY --from=TOOLS /bin/tool /usr/bin/
COPY --from=busybox:1.36 /bin/busybox /bin/
COPY --from=tools /bin/other /usr/bin/
"""


def test_stage_graph():
    df = parse_dockerfile(MULTI, "D")
    graph = stage_graph(df, {"BASE": "python:3.13"})
    assert graph[0] == StageBase(0, "python:3.13", None, ())
    assert graph[1] == StageBase(1, "node:20", None, ())
    assert graph[2] == StageBase(2, "scratch", None, (0,))
    assert graph[3] == StageBase(3, None, 0, (1,))
    assert graph[4] == StageBase(4, None, 0, (2, "busybox:1.36"))
    assert needed_stages(graph) == [0, 2, 4]  # the last stage by default; 1 and 3 are not built
    assert needed_stages(graph, 3) == [0, 1, 3]
    assert needed_stages(graph, 1) == [1]
    assert stage_names(df) == {"deps": 0, "unused": 1, "tools": 2, "test": 3, "final": 4}
    assert target_stage(df, "TEST") == 3 and target_stage(df, "4") == 4
    with pytest.raises(BuildError, match="no stage is named 'nope'"):
        target_stage(df, "nope")
    with pytest.raises(BuildError):
        needed_stages(graph, 9)
    assert needed_stages([]) == []


def test_from_names_only_earlier_stages():
    df = parse_dockerfile("FROM ubuntu AS ubuntu\nFROM later AS first\nFROM ubuntu\nFROM alpine AS later\n", "D")
    graph = stage_graph(df, {})
    assert (graph[0].base_ref, graph[0].base_stage) == ("ubuntu", None)   # itself: the image
    assert (graph[1].base_ref, graph[1].base_stage) == ("later", None)    # a later stage: an image, as in Docker
    assert (graph[2].base_ref, graph[2].base_stage) == (None, 0)
    assert needed_stages(graph) == [3]


def test_from_errors():
    message = error("ARG X\nFROM $X\n")
    assert message.startswith("Dockerfile:2: FROM: ") and "expands to nothing" in message


def test_stage_from_stage_inherits_the_config_given():
    df = parse_dockerfile("FROM a AS one\nENV A=1\nWORKDIR /w\nFROM one\nRUN pwd\n", "D")
    first = StagePlanner(df, 0, BASE, {}, stage_names(df))
    list(first.steps())
    second = StagePlanner(df, 1, first.config(), {}, stage_names(df))
    run = next(iter(second.steps()))
    assert run.workdir == "/w" and env_of(run)["A"] == "1"


def test_planner_rejects_a_missing_stage():
    df = parse_dockerfile("FROM a\n", "D")
    with pytest.raises(BuildError):
        StagePlanner(df, 3, BASE, {}, {})


def test_config_fields():
    _, config = plan("FROM a\nWORKDIR /app\nUSER 1000\nCMD [\"x\"]\n",
                     base=ImageConfig(env=("A=1",), diff_ids=("sha256:" + "1" * 64,), platform=AMD64))
    assert config == ImageConfig(env=("A=1", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"),
                                 workdir="/app", user="1000", cmd=("x",), platform=AMD64)


def test_config_before_steps_plans_everything():
    df = parse_dockerfile("FROM a\nENV A=1\n", "D")
    assert StagePlanner(df, 0, BASE, {}, {}).config().env_map()["A"] == "1"


def test_errors_in_unused_stage_do_not_fail_the_graph():
    df = parse_dockerfile("FROM a AS broken\nWORKDIR ${X:?nope}\nFROM b\nRUN true\n", "D")
    graph = stage_graph(df, {})
    assert needed_stages(graph) == [1]


# --- realistic Terminal-Bench-2 style Dockerfiles ---------------------------------------------

TB2_PYTHON = """\
FROM ghcr.io/laude-institute/t-bench/python-3-13:20250620

ENV DEBIAN_FRONTEND=noninteractive \\
    PYTHONUNBUFFERED=1 \\
    PIP_NO_CACHE_DIR="1"

RUN apt-get update && apt-get install -y --no-install-recommends \\
        curl \\
        git \\
        # build tools for the wheels
        build-essential \\
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app

RUN pip install --no-cache-dir numpy==1.26.4 "pandas>=2.0" pytest==8.3.3

COPY . /app
COPY ./data/ /app/data/
RUN chmod +x /app/run.sh
"""


def test_tb2_python_task():
    steps, config = plan(TB2_PYTHON)
    kinds = [type(s).__name__ for s in steps]
    assert kinds == ["ConfigStep", "RunStep", "WorkdirStep", "RunStep", "CopyStep", "CopyStep", "RunStep"]
    apt = steps[1]
    assert apt.line == 7 and apt.argv[:2] == ("/bin/sh", "-c")
    assert "build-essential" in apt.argv[2] and "# build tools" not in apt.argv[2]
    assert apt.argv[2].startswith("apt-get update && apt-get install -y --no-install-recommends")
    assert apt.workdir == "/"
    assert steps[3].argv[2] == 'pip install --no-cache-dir numpy==1.26.4 "pandas>=2.0" pytest==8.3.3'
    assert steps[3].workdir == "/app"
    assert (steps[4].sources, steps[4].dest, steps[4].dest_is_dir) == ((".",), "/app", False)
    assert (steps[5].sources, steps[5].dest, steps[5].dest_is_dir) == (("./data/",), "/app/data", True)
    assert config.env_map()["PIP_NO_CACHE_DIR"] == "1" and config.env_map()["PATH"].startswith("/usr/local/bin")
    assert config.workdir == "/app"
    assert env_of(steps[6])["DEBIAN_FRONTEND"] == "noninteractive"


TB2_MULTI = """\
# syntax=docker/dockerfile:1.4
ARG UBUNTU=24.04
FROM ubuntu:${UBUNTU} AS builder
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \\
 && apt-get install -y gcc make \\
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY src/ ./
RUN make -j"$(nproc)" && make install PREFIX=/opt/tool

FROM ubuntu:${UBUNTU}
LABEL org.opencontainers.image.title="tool" maintainer="bench@example.com"
RUN useradd -m -u 1000 agent
COPY --from=builder --chown=agent:agent /opt/tool /opt/tool
ENV PATH="/opt/tool/bin:${PATH}"
USER agent
WORKDIR /home/agent
EXPOSE 8080
CMD ["bash"]
"""


def test_tb2_multi_stage_task():
    df = parse_dockerfile(TB2_MULTI, "environment/Dockerfile")
    graph = stage_graph(df, {})
    assert [g.base_ref for g in graph] == ["ubuntu:24.04", "ubuntu:24.04"]
    assert needed_stages(graph) == [0, 1]
    builder = StagePlanner(df, 0, BASE, {}, stage_names(df))
    steps = list(builder.steps())
    assert env_of(steps[1])["DEBIAN_FRONTEND"] == "noninteractive"
    assert "DEBIAN_FRONTEND" not in builder.config().env_map()
    assert steps[3].dest == "/src" and steps[3].dest_is_dir
    final = StagePlanner(df, 1, BASE, {}, stage_names(df))
    steps = list(final.steps())
    copy = steps[2]
    assert (copy.from_stage, copy.chown, copy.dest) == (0, "agent:agent", "/opt/tool")
    config = final.config()
    assert config.env_map()["PATH"] == "/opt/tool/bin:/usr/local/bin:/usr/bin:/bin"
    assert (config.user, config.workdir, config.cmd, config.exposed_ports) == ("agent", "/home/agent", ("bash",),
                                                                               ("8080/tcp",))
    assert config.labels == ("org.opencontainers.image.title=tool", "maintainer=bench@example.com")
    assert steps[-3].user == "agent"  # the WORKDIR is made as the USER


def test_tb2_misc_forms():
    steps, config = plan('FROM python:3.11-slim\n'
                         'ENV LC_ALL=C.UTF-8 \\\n    APP_HOME=/opt/app\n'
                         'WORKDIR ${APP_HOME}\n'
                         'COPY requirements.txt .\n'
                         'RUN pip install -r requirements.txt\n'
                         'COPY --chmod=755 entrypoint.sh /entrypoint.sh\n'
                         'ADD https://example.com/data.csv ./data/\n'
                         'ENTRYPOINT ["/entrypoint.sh"]\n')
    req, entry, data = (s for s in steps if isinstance(s, CopyStep))
    assert (req.dest, req.dest_is_dir) == ("/opt/app", True)
    assert (entry.dest, entry.chmod) == ("/entrypoint.sh", "755")
    assert data.add and data.dest == "/opt/app/data" and data.dest_is_dir
    assert config.entrypoint == ("/entrypoint.sh",) and config.cmd == ()
