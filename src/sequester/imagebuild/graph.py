"""The stages of a Dockerfile: what each starts from, what it copies from, which to build. Pure.

``docker build`` builds the target stage (the last, or ``--target``) and, like BuildKit,
only the stages it depends on: through ``FROM <earlier stage>`` and ``COPY --from``. The
builder asks :func:`stage_graph` once, pulls the images the needed stages start from or
copy from, and builds the stages in :func:`needed_stages`'s order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sequester.errors import BuildError
from sequester.imagebuild.expand import Defined, fail, global_scope
from sequester.images.manifest import Platform, host_platform
from sequester.tasks.dockerfile_parse import Dockerfile, Instruction
from sequester.tasks.dockerfile_syntax import WordError, expand

__all__ = ["StageBase", "stage_graph", "stage_names", "target_stage", "needed_stages", "resolve_from"]


@dataclass(frozen=True)
class StageBase:
    """What one stage starts from and which other stages (or images) it copies from."""

    index: int
    base_ref: str | None  # the expanded image reference, or "scratch"; None: base_stage
    base_stage: int | None  # FROM <an earlier stage's name>
    copies_from: tuple[int | str, ...]  # COPY --from: stage indexes and image references, first use first
    platform: str | None = None  # FROM --platform, expanded


def stage_names(df: Dockerfile) -> dict[str, int]:
    """Each named stage's index, by its (lower-case) name."""
    return {stage.name: stage.index for stage in df.stages if stage.name is not None}


def target_stage(df: Dockerfile, target: str) -> int:
    """``docker build --target``: a stage's name (any case) or index."""
    names = stage_names(df)
    if target.lower() in names:
        return names[target.lower()]
    if target.isdigit() and int(target) < len(df.stages):
        return int(target)
    raise BuildError(f"{df.source}: no stage is named {target!r} (stages: {', '.join(names) or 'none named'})")


def stage_graph(df: Dockerfile, build_args: Mapping[str, str], *, platform: Platform | None = None) -> list[StageBase]:
    """Every stage's base and COPY --from sources. FROM expands with the global ARGs only
    (and the platform ARGs of ``platform``, the build's: by default this host's), as in Docker."""
    scope = global_scope(df, build_args, platform or host_platform())
    names = stage_names(df)
    out = []
    for stage in df.stages:
        head = Instruction(stage.line, "FROM", (), stage.base, f"FROM {stage.base}")
        try:
            base = expand(stage.base, Defined(scope), df.escape)
            plat = (expand(stage.platform, Defined(scope), df.escape) if stage.platform else "") or None
        except WordError as exc:
            raise fail(df.source, head, str(exc)) from None
        if not base:
            raise fail(df.source, head, f"the image {stage.base!r} expands to nothing")
        earlier = names.get(base.lower())
        copies = _copies_from(df, stage.index, names)
        # Only a stage defined before this one is a stage: ``FROM ubuntu AS ubuntu`` is the image.
        if earlier is not None and earlier < stage.index:
            out.append(StageBase(stage.index, None, earlier, copies, plat))
        else:
            out.append(StageBase(stage.index, "scratch" if base.lower() == "scratch" else base, None, copies, plat))
    return out


def _copies_from(df: Dockerfile, index: int, names: Mapping[str, int]) -> tuple[int | str, ...]:
    found: list[int | str] = []
    for ins in df.stages[index].instructions:
        if ins.keyword == "COPY" and (value := ins.flag("from")) is not None:
            source = resolve_from(df, ins, index, value, names)
            if source not in found:
                found.append(source)
    return tuple(found)


def resolve_from(df: Dockerfile, ins: Instruction, index: int, value: str, names: Mapping[str, int]) -> int | str:
    """COPY --from's value in stage ``index``: an earlier stage's index, or an image reference.

    As in Docker, the value is not expanded (BuildKit refuses a variable in it, and so does
    this), and a stage can only copy from one before it (BuildKit builds stages in order).
    """
    if "$" in value:
        raise fail(
            df.source,
            ins,
            f"--from={value}: variables are not expanded in --from (as in Docker); define "
            f"a stage with FROM and a global ARG instead, and copy from that",
        )
    if value.lower() in names or value.isdigit():
        other = names[value.lower()] if value.lower() in names else int(value)
        if other >= index:
            raise fail(
                df.source,
                ins,
                f"--from={value}: cannot copy from stage {other}, it must be defined before this one (stage {index})",
            )
        return other
    return value


def needed_stages(graph: list[StageBase], target: int | None = None) -> list[int]:
    """The stages ``target`` (default: the last) needs, itself included, in build order.

    Every dependency is an earlier stage (:func:`stage_graph` sees to it), so the order is
    the Dockerfile's.
    """
    if not graph:
        return []
    target = len(graph) - 1 if target is None else target
    if not 0 <= target < len(graph):
        raise BuildError(f"there is no stage {target} (the Dockerfile has {len(graph)})")
    needed, todo = set(), [target]
    while todo:
        stage = todo.pop()
        if stage not in needed:
            needed.add(stage)
            node = graph[stage]
            todo += [d for d in (node.base_stage, *node.copies_from) if isinstance(d, int)]
    return sorted(needed)
