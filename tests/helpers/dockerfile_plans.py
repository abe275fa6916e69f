"""Planning one stage of a Dockerfile in a test: the shared helpers of
tests/imagebuild/test_plan.py and test_graph.py (pure: no images, no processes)."""

from __future__ import annotations

import pytest

from sequester.errors import BuildError
from sequester.tasks.dockerfile_parse import parse_dockerfile
from sequester.imagebuild.plan import StagePlanner, stage_graph, stage_names
from sequester.imagebuild.steps import CopyStep, RunStep
from sequester.images.manifest import ImageConfig, Platform

AMD64 = Platform("linux", "amd64")
BASE = ImageConfig(env=("PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8"), platform=AMD64)


def plan(text: str, base: ImageConfig = BASE, build_args: dict[str, str] | None = None, stage: int = -1):
    """(steps, config) of one stage (default: the last)."""
    df = parse_dockerfile(text, "Dockerfile")
    index = stage % len(df.stages)
    planner = StagePlanner(df, index, base, build_args or {}, stage_names(df))
    return list(planner.steps()), planner.config()


def runs(text: str, **kw) -> list[RunStep]:
    return [s for s in plan(text, **kw)[0] if isinstance(s, RunStep)]


def copies(text: str, **kw) -> list[CopyStep]:
    return [s for s in plan(text, **kw)[0] if isinstance(s, CopyStep)]


def env_of(step: RunStep) -> dict[str, str]:
    return dict(step.env)


def error(text: str, **kw) -> str:
    with pytest.raises(BuildError) as info:
        df = parse_dockerfile(text, "Dockerfile")
        stage_graph(df, kw.get("build_args", {}), platform=AMD64)
        plan(text, **kw)
    return str(info.value)
