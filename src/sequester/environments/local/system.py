"""Starting an episode's sandbox on the system it runs on: the task's image (held in the
store for the episode's life, see :mod:`.image_start`) or the host's (:mod:`.start`),
with its working directory, its limits (:mod:`.limits`) and its GPUs
(:mod:`sequester.sandbox.gpus`). Used by :mod:`.episode`."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from sequester.environments.base import UnsupportedByBackend
from sequester.environments.local.image_start import image_workdir, start_on_image
from sequester.environments.local.limits import finish_limits, make_episode_limits, make_storage_cap
from sequester.environments.local.start import RunningEpisode, start_episode
from sequester.environments.local.state import EpisodeDirs, remove_stale
from sequester.environments.settings import EpisodeSettings, episode_image_store
from sequester.errors import BuildError, EpisodeError, ImageError
from sequester.imagebuild.apt_install import ensure_apt_install
from sequester.imagebuild.builder import BuildOptions
from sequester.imagebuild.runner_libraries import ensure_runner_libraries
from sequester.images.choose import Choice
from sequester.images.stack import image_link, image_path_kind
from sequester.images.store import ImageLease, ImageStore
from sequester.net.build.network import parse_build_network
from sequester.sandbox.cgroups.limits import remove_stale_groups
from sequester.sandbox.gpus import GpuPlan, GpuUnavailable, find_gpus
from sequester.sandbox.idmap import configured_id_map
from sequester.tasks import Task
from sequester.verifier.apt_pins import TASK_INSTALLS_DIR, apt_requests_of_tests
from sequester.verifier.image_python import ImagePython, image_python
from sequester.verifier.tree import runner_tree, tree_libraries
from sequester.verifier.wheels import ensure_task_wheels

__all__ = ["start_system"]

log = logging.getLogger("sequester.environments.local")


def _gpus(task: Task) -> GpuPlan | None:
    """What the view gets for the task's ``gpus`` (:mod:`sequester.sandbox.gpus`), or None."""
    count = task.config.environment.gpus
    if not count:
        return None
    try:
        return find_gpus(count)
    except GpuUnavailable as exc:
        raise UnsupportedByBackend(
            f"{task.name} asks for {count} GPU{'s' * (count != 1)} ([environment] gpus = {count}); "
            f"the local backend cannot give them here: {exc}"
        ) from None


_stale_cleaned: set[Path] = set()
_FAILURE_TTL = 120.0
_install_failed: dict[tuple[str, str], tuple[float, str]] = {}


def _image_python(lease: ImageLease | None, settings: EpisodeSettings) -> ImagePython | None:
    """The image's ``python3`` when the runner carries its version (see
    :mod:`sequester.verifier.image_python`), else None (host mode too)."""
    runner = runner_tree(settings.toolchain_dir)
    if lease is None or runner is None:
        return None
    try:
        versions = {d.name.split("-")[1].rpartition(".")[0] for d in (runner / "python").iterdir()}
    except (OSError, IndexError):
        return None
    return image_python(
        lambda path: image_path_kind(lease.layers, path), lambda path: image_link(lease.layers, path), versions
    )


def _test_installs(
    task: Task, choice: Choice, settings: EpisodeSettings, store: ImageStore
) -> tuple[Path | None, list[str]]:
    """What the tests' ``apt-get install`` lines install (test.sh's and those of the scripts
    the tests run: :func:`~sequester.verifier.apt_pins.apt_requests_of_tests`), prepared on the task's
    pristine image by its own apt (:mod:`sequester.imagebuild.apt_install`) before anything
    starts, or None (no such line, no image, or the runner has them all); and a note when
    it cannot be (the runner's ``apt-get`` then refuses them: a set-up failure, settled by
    the pristine re-run). A failure is not tried again for two minutes."""
    runner = runner_tree(settings.toolchain_dir)
    if task.test_script is None or choice.record is None or runner is None:
        return None, []
    request = apt_requests_of_tests(task.tests_dir)
    request = request.without({p for p in request.packages if (runner / "bin" / p).exists()})
    if not request.packages:
        return None, []
    key = (choice.record.id, " ".join(request.packages))
    when, earlier = _install_failed.get(key, (0.0, ""))
    if not earlier or time.monotonic() - when >= _FAILURE_TTL:
        options = BuildOptions(
            network=parse_build_network(settings.images.build_network, settings.images.build_allowed_hosts),
            timeout=task.config.environment.build_timeout_sec,
            ids=configured_id_map(settings.id_range),
        )
        try:
            tar = ensure_apt_install(
                store,
                choice.record,
                request,
                cache_dir=settings.toolchain_dir / TASK_INSTALLS_DIR,
                options=options,
                runner=runner,
            )
        except (BuildError, ImageError, OSError) as exc:
            earlier = str(exc)
            _install_failed[key] = (time.monotonic(), earlier)
        else:
            # Their libraries, for the runner's loader (an import of opencv after
            # `apt-get install libgl1`): a failure costs those imports, not the install.
            try:
                ensure_runner_libraries(store, choice.record, tar, provided=tree_libraries(runner))
            except (BuildError, ImageError, OSError) as exc:
                log.warning("%s: the libraries of the tests' installs are not the runner's: %s", task.name, exc)
                return tar, [f"the libraries of the tests' apt-get install are not the runner's: {str(exc)[-300:]}"]
            return tar, []
    log.warning(
        "%s: test.sh's apt-get install of %s could not be prepared: %s", task.name, " ".join(request.packages), earlier
    )
    return None, [f"the tests' apt-get install of {' '.join(request.packages)} could not be prepared: {earlier[-300:]}"]


def start_system(
    task: Task,
    choice: Choice,
    settings: EpisodeSettings,
    extra_hidden: tuple[Path, ...],
    workdir: str | None,
    resolv_conf: str | None = None,
    *,
    installs_of: RunningEpisode | None = None,
    above: tuple[Path, ...] = (),
) -> RunningEpisode:
    """The episode's sandbox up on ``choice``'s system (nothing of it is left on failure);
    ``workdir`` overrides the working directory (:class:`EpisodeError` if not absolute);
    ``resolv_conf``: the agent's ``/etc/resolv.conf`` when the episode has a network.
    GPUs the task asks for that this host cannot give: :class:`UnsupportedByBackend`,
    before anything starts. ``above``: a checkpoint's sealed layers to start on (an
    episode on an image only)."""
    if above and choice.record is None:
        raise EpisodeError("a checkpoint's layers need an episode on an image (host mode has none)")
    gpus = _gpus(task)
    # The wheels the test script pins beyond the runner's, fetched once on the host before
    # anything starts: a pin that cannot be had costs no agent run.
    wheels = ensure_task_wheels(task, settings.toolchain_dir)
    store = episode_image_store(settings)
    install_notes: list[str] = []
    if installs_of is not None:  # a verifier's environment for that episode: its decision, not a new one
        installs = installs_of.installs
    else:
        installs, install_notes = _test_installs(task, choice, settings, store)
    lease = store.lease(choice.record) if choice.record is not None else None
    try:
        if lease is not None:
            chosen = image_workdir(task, lease, workdir)
        else:
            chosen = workdir or task.config.environment.workdir or task.default_workdir or str(task.path)
        if not chosen.startswith("/"):
            raise EpisodeError(f"workdir {chosen!r} is not an absolute path")
        if settings.state_dir not in _stale_cleaned:
            remove_stale(settings.state_dir)
            remove_stale_groups()
            _stale_cleaned.add(settings.state_dir)
        dirs = EpisodeDirs.create(settings.state_dir)
        quota, storage_why = make_storage_cap(task, dirs.root)
        limits, why = make_episode_limits(task, max_processes=settings.max_processes)
        try:
            if lease is not None:
                run = start_on_image(task, chosen, dirs, settings, lease, limits, resolv_conf, gpus=gpus, above=above)
            else:
                run = start_episode(task, chosen, dirs, settings, extra_hidden, limits, resolv_conf, gpus=gpus)
        except BaseException:
            if limits is not None:
                limits.remove()
            dirs.remove()
            if quota is not None:
                quota.remove()
            raise
    except BaseException:
        if lease is not None:
            lease.release()
        raise
    run.wheels = wheels
    run.installs = installs
    run.image_python = _image_python(lease, settings)
    if run.image_python is not None:
        run.notes.append(
            f"the tests' python3 is the verifier's Python {run.image_python.version} (the image's is "
            f"{run.image_python.where}), finding the image's packages after its own"
        )
    run.notes += install_notes
    run.gpus = gpus
    run.storage_quota = quota
    if gpus is not None:
        env = task.config.environment
        run.notes += [f"{gpus.describe()} bound into the view", *gpus.notes]
        if env.gpu_types:
            run.notes.append(
                f"[environment] gpu_types = {list(env.gpu_types)} not checked: the first {env.gpus} GPUs are bound"
            )
    run.notes[:0] = list(choice.notes)
    run.notes += finish_limits(task, run, limits, why, max_processes=settings.max_processes, storage_why=storage_why)
    return run
