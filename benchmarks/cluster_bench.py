"""The ray backend's cost per trial, side by side with the local runner, in one run.

    python benchmarks/cluster_bench.py [--rounds 2] [--image-runs 2]

A real two-node Ray cluster on loopback (tests/helpers/ray_cluster.py: two raylets of one
CPU each, token authentication, every process killed at the end) and the local runner,
on the same tasks: the five examples (examples/tasks), agents ``nop`` and ``oracle``.
Every job is ``run_job`` on all five tasks with two trials at a time, ``LocalScheduler(2)``
(the default runner with concurrency 2) and ``RayScheduler(concurrency=2)``, alternately,
``--rounds`` times per agent (20 trials per backend by default), after one unmeasured job
per backend and agent (the nodes' first workers, the verifier's toolchain).

* **Overhead per trial** (the figure to read): for each trial, the driver's time from its
  submission (the scheduler's ``started`` call) to its landing (its result written in the
  job folder and handed to the job), minus the trial's own duration (``result.json``'s
  ``started_at`` to ``finished_at``, taken where it ran). Locally that is a thread's
  hand-off; on Ray it is the task's dispatch, shipping the task and its folder both ways,
  and the landing. Median and maximum over the measured trials.
* Wall time per trial (job wall time / trials) for each agent, and the *throughput*
  overhead per trial: (job wall time - the trials' own durations summed / 2) / trials.
* From ``run_job`` to the first trial's submission (the job's set-up: the scheduler's
  monitor actor, the tasks into the object store).
* Ray's cluster start and the driver's ``ray.init``: informational.
* **Image delivery** on the cluster: a copy of python-csv-stats naming a prebuilt image
  (the trixie test image with the Dockerfile's ``COPY`` as a layer), in a loopback
  registry (Debian's docker-registry); the node pulls it into the store its settings name.
  A trial on an empty store (cold) against a later trial on the same store (warm), their
  ``environment_setup`` phases, next to ``ImageStore.pull`` of the same image on the
  driver into an empty store. Needs skopeo, umoci, docker-registry and the trixie rootfs
  (debootstrap, as root; tests/helpers/images.py): without them the rows say skipped.

Machines are noisy: compare within one run. Both nodes share this machine's CPUs with
the driver (and the local runner its own), so the trials' own durations are printed too.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import secrets
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
EXAMPLES = ROOT / "examples" / "tasks"
CSV_TASK = EXAMPLES / "python-csv-stats"
IMAGE = "sequester-examples/python-csv-stats:1"
CONCURRENCY = 2

# Ray reads its authentication settings once, when it is first imported (as tests/conftest.py
# does for the tests): a token of this run's own, removed at its end. skopeo (the registry
# helper's) wants a private runtime folder too.
_PRIVATE = Path(tempfile.mkdtemp(prefix="seq-cluster-bench-env-"))
if not os.environ.get("RAY_AUTH_TOKEN_PATH"):
    (_PRIVATE / "token").write_text(secrets.token_hex(32))
    (_PRIVATE / "token").chmod(0o600)
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(_PRIVATE / "token"))
if not os.environ.get("XDG_RUNTIME_DIR"):
    (_PRIVATE / "runtime").mkdir(mode=0o700)
    os.environ["XDG_RUNTIME_DIR"] = str(_PRIVATE / "runtime")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from _report import Row, report  # noqa: E402

from sequester.jobs import run_job  # noqa: E402
from sequester.jobs.results import TrialResult  # noqa: E402
from sequester.jobs.schedule import LocalScheduler  # noqa: E402


class Timed:
    """A scheduler with the driver's clock on each trial: when it was submitted (the
    scheduler's ``started`` call) and when it landed (yielded to the job, its result written)."""

    def __init__(self, inner) -> None:
        self.inner, self.runs_here = inner, inner.runs_here
        self.called = time.perf_counter()  # made just before run_job: the job's start
        self.submitted: dict[str, float] = {}
        self.landed: dict[str, float] = {}

    def describe(self) -> dict[str, object]:
        return self.inner.describe()

    def run(self, job, trials, started):
        def mark(name: str) -> None:
            self.submitted[name] = time.perf_counter()
            started(name)

        for result in self.inner.run(job, trials, mark):
            self.landed[result.trial_name] = time.perf_counter()
            yield result

    def stop(self):
        return self.inner.stop()


class Job:
    """One measured job: its trials' results and the driver's times."""

    def __init__(self, timed: Timed, results: list[TrialResult], wall: float):
        self.results, self.wall = results, wall
        self.own = [r.duration_sec or 0.0 for r in results]
        self.overheads = [timed.landed[r.trial_name] - timed.submitted[r.trial_name] - own
                          for r, own in zip(results, self.own)]
        self.setup = min(timed.submitted.values()) - timed.called
        order = sorted(timed.submitted, key=timed.submitted.__getitem__)
        by_name = {r.trial_name: o for r, o in zip(results, self.overheads)}
        self.first_wave = [by_name[name] for name in order[:CONCURRENCY]]  # submitted at the job's start
        self.later = [by_name[name] for name in order[CONCURRENCY:]]

    @property
    def throughput_overhead(self) -> float:
        return (self.wall - sum(self.own) / CONCURRENCY) / len(self.results)


def one_job(tasks: list[Path], agent: str, scheduler, jobs_dir: Path, name: str, **kw) -> Job:
    results: list[TrialResult] = []
    timed = Timed(scheduler)
    started = time.perf_counter()
    run_job(tasks, agent, jobs_dir=jobs_dir, job_name=name, concurrency=CONCURRENCY, scheduler=timed,
            progress=results.append, **kw)
    return Job(timed, results, time.perf_counter() - started)


def scored_as_expected(job: Job, agent: str) -> bool:
    want = 1.0 if agent == "oracle" else 0.0
    return all(r.exception_info is None and r.reward == want for r in job.results)


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


# -- the image task ---------------------------------------------------------------------------------

def task_image(folder: Path) -> str:
    """What python-csv-stats' Dockerfile builds (trixie for its base, its COPY as a layer)."""
    from images import trixie_image
    from registry import run, skopeo

    ref = f"oci:{folder}:csv"
    skopeo("copy", trixie_image(), ref)
    data = (CSV_TASK / "environment" / "data.csv").read_bytes()
    layer = folder.parent / "copy-data.tar"
    with tarfile.open(layer, "w", format=tarfile.PAX_FORMAT) as tar:
        app = tarfile.TarInfo("app")
        app.type, app.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(app)
        csv = tarfile.TarInfo("app/data.csv")
        csv.size, csv.mode = len(data), 0o644
        tar.addfile(csv, io.BytesIO(data))
    run(["umoci", "raw", "add-layer", "--image", f"{folder}:csv", str(layer)])
    run(["umoci", "config", "--image", f"{folder}:csv", "--config.workingdir", "/app"])
    return ref


def image_task(root: Path) -> Path:
    task = root / "python-csv-stats"
    shutil.copytree(CSV_TASK, task)
    toml = task / "task.toml"
    toml.write_text(re.sub(r"(?m)^\[environment\]$", f'[environment]\ndocker_image = "{IMAGE}"', toml.read_text()))
    return task


def image_rows(root: Path, runs: int, scheduler_for) -> list[Row]:
    """Cold and warm trials on the image under the ray backend (or why they were skipped)."""
    import pytest  # the test helpers skip with pytest's exception when a tool or the rootfs is missing

    from registry import missing_tools, running_registry

    from sequester.config import load_config
    from sequester.images import ImageStore

    root.mkdir(parents=True, exist_ok=True)
    missing = missing_tools("skopeo", "umoci", "docker-registry")
    if missing:
        return [("image delivery (cold / warm pull on a node)", "skipped", "", f"needs {', '.join(missing)}", True)]
    try:
        ref = task_image(root / "layout")
        task = image_task(root / "tasks")
        cold, warm, cold_setup, warm_setup, pulls, ok = [], [], [], [], [], True
        with running_registry(root / "registry") as registry:
            digest = registry.push(ref, IMAGE)
            for i in range(runs):
                config = root / f"config-{i}.toml"
                config.write_text(f'[images]\nsource = "prebuilt"\nstore_dir = "store-{i}"\n'
                                  f'mirrors = {{ "docker.io" = "{registry.host}" }}\ninsecure = ["{registry.host}"]\n')
                settings = load_config(config).episodes
                for label, times, setups in (("cold", cold, cold_setup), ("warm", warm, warm_setup)):
                    job = one_job([task], "oracle", scheduler_for(), root / "jobs", f"image-{label}-{i}",
                                  settings=settings)
                    (result,) = job.results
                    ok &= (scored_as_expected(job, "oracle") and (result.system or {}).get("digest") == digest)
                    times.append(result.duration_sec or 0.0)
                    setups.append(result.environment_setup.duration_sec or 0.0)
                # The reference: the same pull on the driver, into an empty store.
                from dataclasses import replace
                images = replace(settings.images, store_dir=root / f"driver-store-{i}")
                started = time.perf_counter()
                ImageStore(images).pull(IMAGE)
                pulls.append(time.perf_counter() - started)
    except pytest.skip.Exception as exc:
        return [("image delivery (cold / warm pull on a node)", "skipped", "", str(exc.msg)[:80], True)]
    med = statistics.median
    return [
        ("image trial on a node, cold (empty store: pulled)", f"{med(cold):.2f} s", f"warm (in the store): "
         f"{med(warm):.2f} s", "report", ok),
        ("  its environment_setup, cold / warm", f"{med(cold_setup):.2f} s", f"{med(warm_setup):.2f} s",
         "report", ok),
        ("  cold - warm setup (the node's pull)", f"{med(cold_setup) - med(warm_setup):.2f} s",
         f"ImageStore.pull on the driver: {med(pulls):.2f} s", "report", True),
    ]


# -- main -------------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="measured jobs per backend and agent (5 trials each)")
    parser.add_argument("--image-runs", type=int, default=2, help="cold/warm image trial pairs")
    args = parser.parse_args()

    import ray_cluster
    from sequester.cluster import RayScheduler

    rows: list[Row] = []
    tmp = Path(tempfile.mkdtemp(prefix="seq-cluster-bench-"))
    cluster = None
    try:
        started = time.perf_counter()
        cluster = ray_cluster.start_cluster(cpus_per_node=1, nodes=2)
        cluster_start = time.perf_counter() - started
        started = time.perf_counter()
        ray = ray_cluster.join(cluster)
        connect = time.perf_counter() - started

        def ray_scheduler() -> RayScheduler:
            return RayScheduler(cluster.address, concurrency=CONCURRENCY)

        backends = {"local": lambda: LocalScheduler(CONCURRENCY), "ray": ray_scheduler}
        jobs: dict[tuple[str, str], list[Job]] = {(b, a): [] for b in backends for a in ("nop", "oracle")}
        first: dict[str, Job] = {}
        expected = True
        for round_ in range(args.rounds + 1):  # round 0: unmeasured
            for agent in ("nop", "oracle"):
                for backend, make in backends.items():
                    job = one_job([EXAMPLES], agent, make(), tmp / "jobs", f"{backend}-{agent}-{round_}")
                    expected &= scored_as_expected(job, agent) and len(job.results) == 5
                    if round_ == 0:
                        first.setdefault(backend, job)
                    else:
                        jobs[(backend, agent)].append(job)
        nodes = {r.node["node_id"] for js in jobs.values() for j in js for r in j.results if r.node}

        def pooled(backend: str, agent: str | None = None) -> list[Job]:
            return [j for (b, a), js in jobs.items() if b == backend and agent in (None, a) for j in js]

        def overheads(backend: str) -> list[float]:
            return [o for j in pooled(backend) for o in j.overheads]

        def wall_per_trial(backend: str, agent: str) -> float:
            js = pooled(backend, agent)
            return sum(j.wall for j in js) / sum(len(j.results) for j in js)

        def median_of(backend: str, what) -> float:
            return statistics.median(what(j) for j in pooled(backend))

        ray_o, local_o = overheads("ray"), overheads("local")
        n = len(ray_o)
        rows += [
            ("Ray cluster start (2 nodes x 1 CPU, ray start)", f"{cluster_start:.1f} s", "", "informational", True),
            ("driver connect (ray.init)", f"{connect:.2f} s", "", "informational", True),
            ("first job on the fresh cluster: overhead per trial (median)",
             ms(statistics.median(first["ray"].overheads)), f"local: {ms(statistics.median(first['local'].overheads))}",
             "informational", True),
            (f"overhead per trial: submission->landing - own duration (median, {n} trials)",
             ms(statistics.median(ray_o)), f"local runner: {ms(statistics.median(local_o))}", "ray <= 1 s",
             statistics.median(ray_o) <= 1.0),
            ("  the same, maximum", ms(max(ray_o)), f"local runner: {ms(max(local_o))}", "report", True),
            ("  the job's first two trials / the later ones (median)",
             f"{ms(statistics.median(o for j in pooled('ray') for o in j.first_wave))} / "
             f"{ms(statistics.median(o for j in pooled('ray') for o in j.later))}",
             f"local runner: {ms(statistics.median(o for j in pooled('local') for o in j.first_wave))} / "
             f"{ms(statistics.median(o for j in pooled('local') for o in j.later))}", "report", True),
            ("throughput overhead per trial: (wall - sum(own)/2) / n (median job)",
             ms(median_of("ray", lambda j: j.throughput_overhead)),
             f"local runner: {ms(median_of('local', lambda j: j.throughput_overhead))}", "report", True),
            ("job set-up: run_job -> first submission (median job)", ms(median_of("ray", lambda j: j.setup)),
             f"local runner: {ms(median_of('local', lambda j: j.setup))}", "report", True),
        ]
        for agent in ("nop", "oracle"):
            r, loc = wall_per_trial("ray", agent), wall_per_trial("local", agent)
            own_r = statistics.median(o for j in pooled("ray", agent) for o in j.own)
            own_l = statistics.median(o for j in pooled("local", agent) for o in j.own)
            rows.append((f"wall time per trial, {agent} (own duration, median)", f"{r:.2f} s ({own_r:.2f} s)",
                         f"local runner: {loc:.2f} s ({own_l:.2f} s)", f"report: ratio {r / loc:.2f}", True))
        rows.append(("every trial scored as expected (oracle 1, nop 0), both nodes used",
                     "yes" if expected and len(nodes) == 2 else f"NO ({len(nodes)} node(s))", "", "all",
                     expected and len(nodes) == 2))
        rows += image_rows(tmp / "image", args.image_runs, ray_scheduler)
        ray.shutdown()
    finally:
        try:
            import ray as _ray

            _ray.shutdown()
        finally:
            if cluster is not None:
                ray_cluster.stop_cluster(cluster)
            from images import remove_tree  # an ordinary user's rootless layers are read-only folders

            remove_tree(tmp)
            shutil.rmtree(_PRIVATE, ignore_errors=True)
    return report(f"ray backend vs the local runner ({args.rounds} rounds x 2 agents x 5 example tasks per backend, "
                  f"{CONCURRENCY} at a time; 2 nodes x 1 CPU on this machine)", rows)


if __name__ == "__main__":
    sys.exit(main())
