"""``docker build`` without a daemon: the one place that composes a build.

1. parse the Dockerfile (:mod:`sequester.tasks.dockerfile_parse`) and find the stages the result needs
   (:mod:`.plan`; a stage nothing uses is not built, as with BuildKit);
2. plan every needed stage on its base (an image from the store or pulled, an earlier
   stage, or ``scratch``) and key every step (:mod:`sequester.images.build_cache`): pure, nothing runs;
3. carry out, in order, each step whose layer is not in the cache (:mod:`.execute`), on
   the layers below it; commit its folder as a layer (:mod:`.layer`);
4. record the last stage as an image of the store (:mod:`.record`).

A step that fails is a :class:`~sequester.errors.BuildError` naming the Dockerfile's line, its
exit status and the tail of its output; the whole build shares one deadline
(:class:`~sequester.errors.BuildTimeout`). The store's ``gc.lock`` is held shared throughout, so
no prune removes a layer under a build.
"""

from __future__ import annotations

import fcntl
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from sequester.errors import BuildError
from sequester.imagebuild.context import context_sources
from sequester.imagebuild.execute import StepContext, execute_step
from sequester.imagebuild.layer import commit_layer, drop_mount_stubs
from sequester.imagebuild.plan import StagePlanner, needed_stages, stage_graph
from sequester.imagebuild.record import built_layer, write_built_image
from sequester.imagebuild.steps import ConfigStep, CopyStep, RunStep, Step, WorkdirStep
from sequester.images.build_cache import BuildCache, base_key, step_key
from sequester.images.manifest import ImageConfig
from sequester.images.records import ImageRecord, LayerRef, hex_of
from sequester.images.store import ImageStore
from sequester.net.build.network import BuildNetwork
from sequester.sandbox.idmap import IdMap
from sequester.tasks.dockerfile_parse import parse_dockerfile

__all__ = ["BuildOptions", "StepReport", "BuildResult", "BuildReporter", "build_image"]

log = logging.getLogger("sequester.imagebuild")

# The mount points bwrap makes for a step's own view: never part of the step's layer.
_STUBS = ("proc", "dev", "opt", "opt/sequester-verifier")


@dataclass(frozen=True)
class BuildOptions:
    no_cache: bool = False
    network: BuildNetwork = field(default_factory=BuildNetwork)
    timeout: float | None = None
    build_args: Mapping[str, str] = field(default_factory=dict)
    # The ids a RUN step maps (sandbox.idmap): the same as the caller's episodes, so that
    # useradd and chown leave real owners in the layers; None: the caller alone (chown is
    # then a no-op, as podman's ignore_chown_errors).
    ids: IdMap | None = None


@dataclass(frozen=True)
class StepReport:
    stage: str  # "stage-1" or its AS name, as docker build prints it
    number: int  # 1-based within the stage
    total: int
    line: int
    text: str
    cached: bool
    seconds: float = 0.0

    def title(self) -> str:
        return f"[{self.stage} {self.number}/{self.total}] {self.text}"


@dataclass(frozen=True)
class BuildResult:
    record: ImageRecord
    steps: tuple[StepReport, ...]
    seconds: float

    @property
    def cached(self) -> bool:
        """Nothing ran: every layer came from the cache."""
        return all(s.cached for s in self.steps)


class BuildReporter(Protocol):
    def step(self, report: StepReport, done: bool) -> None:
        """A step starts (``done`` False, only for steps that run) or is finished."""

    def output(self, data: bytes) -> None:
        """Bytes a running step wrote."""


class _Quiet:
    def step(self, report: StepReport, done: bool) -> None:
        pass

    def output(self, data: bytes) -> None:
        pass


@dataclass
class _Planned:
    """One step of a stage with its key and, once known, its layer."""

    step: Step
    key: str
    content: str = ""
    layer: str | None = None  # hex of the layer folder


@dataclass
class _Stage:
    index: int
    label: str
    base_layers: tuple[Path, ...]
    base_refs: tuple[LayerRef, ...]
    config: ImageConfig
    planned: list[_Planned]
    final_key: str
    parent: int | None = None  # FROM <this earlier stage>
    base_name: str = "scratch"  # what FROM names, resolved (for progress)
    line: int = 0
    built: bool = False


def build_image(
    store: ImageStore,
    dockerfile: Path,
    context: Path,
    *,
    name: str | None = None,
    options: BuildOptions = BuildOptions(),
    runner: Path | None = None,
    reporter: BuildReporter | None = None,
    proxy_factory: Callable[[], object] | None = None,
) -> BuildResult:
    """Build ``dockerfile`` with ``context``; the image is recorded in ``store`` as ``name``."""
    started = time.monotonic()
    reporter = reporter or _Quiet()
    try:
        text = dockerfile.read_text(errors="strict")
    except (OSError, UnicodeDecodeError) as exc:
        raise BuildError(f"{dockerfile}: cannot read the Dockerfile ({exc})") from None
    source = str(dockerfile)
    df = parse_dockerfile(text, source)
    graph = stage_graph(df, options.build_args)
    order = needed_stages(graph)
    names = {s.name: s.index for s in df.stages if s.name}
    cache = BuildCache(store.root)
    deadline = started + options.timeout if options.timeout else None
    if proxy_factory is None and options.network.mode != "none":
        proxy_factory = _default_proxy_factory(options.network)
    with store.lock("gc.lock", fcntl.LOCK_SH):
        stages: dict[int, _Stage] = {}
        for index in order:
            stages[index] = _plan_stage(store, df, graph[index], stages, names, context, source, options, cache)
        ctx = StepContext(
            source=source,
            context=context,
            runner=runner,
            proxy_factory=proxy_factory,
            deadline=deadline,
            on_output=reporter.output,
            ids=options.ids,
        )
        reports: list[StepReport] = []

        def ensure(index: int) -> tuple[Path, ...]:
            stage = stages[index]
            if not stage.built:
                reports.extend(_run_stage(store, stage, ctx, cache, options, reporter, ensure, stages))
                stage.built = True
            return stage.base_layers + tuple(
                store.layer_dir(p.layer) for p in stage.planned if p.layer and not _empty(store, p.layer)
            )

        ctx.stage_layers = ensure
        ctx.image_layers = lambda ref: _image_layers(store, ref)
        last = stages[order[-1]]
        ensure(last.index)
        refs = list(last.base_refs) + [
            built_layer(p.layer, _layer_bytes(store, p.layer))
            for p in last.planned
            if p.layer and not _empty(store, p.layer)
        ]
        record = write_built_image(store, last.config, refs, name=name, source=f"dockerfile:{dockerfile}")
    log.info(
        "built %s from %s in %.2f s (%d steps, %d cached)",
        name or record.short_id,
        dockerfile,
        time.monotonic() - started,
        len(reports),
        sum(r.cached for r in reports),
    )
    return BuildResult(record, tuple(reports), time.monotonic() - started)


def _plan_stage(
    store: ImageStore,
    df,
    base,
    stages: dict[int, _Stage],
    names: dict[str, int],
    context: Path,
    source: str,
    options: BuildOptions,
    cache: BuildCache,
) -> _Stage:
    parent = None
    layers: tuple[Path, ...] = ()
    refs: tuple[LayerRef, ...] = ()
    if base.base_stage is not None:  # FROM <earlier stage>: its layers are known once it is built
        parent = base.base_stage
        config, key = stages[parent].config, base_key("stage", stages[parent].final_key, ids=options.ids)
    elif base.base_ref in (None, "scratch"):
        config, key = ImageConfig(), base_key("scratch", "", ids=options.ids)
    else:
        record = store.get(base.base_ref)
        lease = store.lease(record)  # checks that its layers are there
        lease.release()
        layers, refs, config = lease.layers, record.layers, record.config
        key = base_key("image", record.id, ids=options.ids)
    planner = StagePlanner(df, base.index, config, options.build_args, names)
    planned: list[_Planned] = []
    for step in planner.steps():
        content = _content(store, step, stages, context, source) + _network_key(step, options)
        key = step_key(key, step.key_text, content)
        planned.append(_Planned(step, key, content))
    label = df.stages[base.index].name or f"stage-{base.index}"
    if parent is not None:
        base_name = stages[parent].label
    elif base.base_ref in (None, "scratch"):
        base_name = "scratch"
    else:
        base_name = f"{(record.names or (base.base_ref,))[0]}@{record.digest}"
    return _Stage(
        base.index,
        label,
        layers,
        refs,
        planner.config(),
        planned,
        key,
        parent=parent,
        base_name=base_name,
        line=df.stages[base.index].line,
    )


def _content(store: ImageStore, step: Step, stages: dict[int, _Stage], context: Path, source: str) -> str:
    """What a copy's key must also cover: the files it copies, or what they come from."""
    if not isinstance(step, CopyStep):
        return ""
    if step.from_stage is not None:
        if step.from_stage not in stages:
            raise BuildError(
                f"{source}:{step.line}: COPY --from={step.from_stage}: that stage is not built before this one"
            )
        return "stage " + stages[step.from_stage].final_key
    if step.from_image is not None:
        return "image " + store.get(step.from_image).id
    local = tuple(s for s in step.sources if not (step.add and s.startswith(("http://", "https://"))))
    if not local:
        return ""
    return "context " + context_sources(step, context, source).digest


def _network_key(step: Step, options: BuildOptions) -> str:
    """A step that can reach the network is keyed by what it could reach: a layer a
    ``public`` build fetched must not serve an ``allowlist`` or ``none`` build."""
    uses = (isinstance(step, RunStep) and step.network != "none") or (
        isinstance(step, CopyStep) and step.add and any(s.startswith(("http://", "https://")) for s in step.sources)
    )
    if not uses:
        return ""
    network = options.network
    return f"\nnetwork {network.mode} {' '.join(sorted(network.allowed_hosts)) if network.mode == 'allowlist' else ''}"


def _image_layers(store: ImageStore, ref: str) -> tuple[Path, ...]:
    lease = store.lease(store.get(ref))
    lease.release()
    return lease.layers


def _run_stage(
    store: ImageStore,
    stage: _Stage,
    ctx: StepContext,
    cache: BuildCache,
    options: BuildOptions,
    reporter: BuildReporter,
    ensure,
    stages: dict[int, _Stage],
) -> list[StepReport]:
    if stage.parent is not None:  # FROM <earlier stage>: its layers are this stage's base
        stage.base_layers = ensure(stage.parent)
        parent_stage = stages[stage.parent]
        stage.base_refs = parent_stage.base_refs + tuple(
            built_layer(p.layer, _layer_bytes(store, p.layer))
            for p in parent_stage.planned
            if p.layer and not _empty(store, p.layer)
        )
    layers = list(stage.base_layers)
    reports = []
    total = len(stage.planned) + 1  # FROM is step 1, as docker build counts
    reporter.step(StepReport(stage.label, 1, total, stage.line, f"FROM {stage.base_name}", cached=True), True)
    for number, planned in enumerate(stage.planned, 2):
        step = planned.step
        report = StepReport(stage.label, number, total, step.line, step.text, cached=True)
        if isinstance(step, ConfigStep):
            reports.append(report)
            reporter.step(report, True)
            continue
        hit = None if options.no_cache else _cached_layer(store, cache, planned.key)
        if hit is not None:
            planned.layer = hit
        else:
            if isinstance(step, CopyStep) and step.from_stage is not None:
                ensure(step.from_stage)
            reporter.step(report, False)
            began = time.monotonic()
            planned.layer = _execute(store, step, layers, planned.key, ctx, fresh=options.no_cache)
            cache.record(planned.key, planned.layer)
            report = StepReport(
                stage.label, number, total, step.line, step.text, cached=False, seconds=time.monotonic() - began
            )
        reports.append(report)
        reporter.step(report, True)
        if not _empty(store, planned.layer):
            layers.append(store.layer_dir(planned.layer))
    return reports


def _cached_layer(store: ImageStore, cache: BuildCache, key: str) -> str | None:
    """The layer of the step keyed ``key``: the cache's entry, else the folder named by
    the key itself (only a commit of that very step makes one; after a prune, a layer an
    image still uses is still this step's result)."""
    hit = cache.lookup(key)
    if hit is not None and store.layer_dir(hit).is_dir():
        return hit
    if store.layer_dir(key).is_dir():
        cache.record(key, key)
        return key
    return None


def _execute(
    store: ImageStore,
    step: RunStep | CopyStep | WorkdirStep,
    lowers: list[Path],
    key: str,
    ctx: StepContext,
    *,
    fresh: bool,
) -> str:
    """Run ``step`` and commit its layer; the layer's hex name."""
    tmp = Path(tempfile.mkdtemp(prefix="build-", dir=store.root / "tmp"))
    try:
        upper, work = tmp / "upper", tmp / "work"
        execute_step(step, lowers, upper, work, ctx)
        drop_mount_stubs(upper, lowers, _STUBS)
        name = key if not fresh else hex_of(step_key(key, f"fresh {time.time_ns()}"))
        commit_layer(upper, store.root / "layers", name)
        return name
    finally:
        _remove(tmp)


def _remove(path: Path) -> None:
    from sequester.sandbox.idspace import remove_mapped_tree

    try:
        remove_mapped_tree(path)
    except OSError:
        shutil.rmtree(path, ignore_errors=True)


def _empty(store: ImageStore, layer_hex: str | None) -> bool:
    if layer_hex is None:
        return True
    try:
        return not any(store.layer_dir(layer_hex).iterdir())
    except OSError:
        return True


def _layer_bytes(store: ImageStore, layer_hex: str) -> int:
    import json

    try:
        return int(json.loads((store.root / "layers" / f"{layer_hex}.json").read_text())["bytes"])
    except (OSError, ValueError, KeyError):
        return 0


def _default_proxy_factory(network: BuildNetwork) -> Callable[[], object]:
    from sequester.net.build.network import index_hosts
    from sequester.net.build.proxy import BuildProxy

    hosts = index_hosts()
    return lambda: BuildProxy(network, index_hosts=hosts)
