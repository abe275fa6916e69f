"""Starting an episode on an image: the view of its layers (:mod:`.image_view`), its
config (``Env``, ``WorkingDir``, ``User``), the init from the verifier's runner.

The image was built from the task's Dockerfile (that is what a prebuilt ``docker_image``
is), so nothing of the Dockerfile is applied again; the task's folder is not in the view.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Sequence
from pathlib import Path

from sequester.environments.local.image_view import (
    OVERLAY_OPTIONS_LIMIT,
    overlay_option_bytes,
    plan_image_view,
    upper_folders,
)
from sequester.environments.local.layers import view_points
from sequester.environments.local.resolv import place_etc_file, place_resolv_conf
from sequester.environments.local.start import INIT_SCRIPT, RunningEpisode, launch_init
from sequester.environments.local.state import EpisodeDirs
from sequester.environments.local.view import AGENT_LOG_POINTS
from sequester.environments.settings import EpisodeSettings, episode_id_map
from sequester.errors import ImageError, SandboxError
from sequester.guard import seccomp
from sequester.images import ImageLease
from sequester.images.stack import OPAQUE_XATTR, image_path_kind, merge_tops, resolve_user
from sequester.images.synth import DEFAULT_PATH
from sequester.net.episode.layout import hosts_file
from sequester.sandbox.argv import CONTAINER_CAPS, Identity, SandboxSpec
from sequester.sandbox.cgroups.limits import LimitGroups
from sequester.sandbox.gpus import GpuPlan
from sequester.sandbox.mounts import MountKind
from sequester.tasks import Task
from sequester.verifier.layout import RUNNER_MOUNT
from sequester.verifier.tree import runner_tree

__all__ = ["start_on_image", "image_workdir", "image_shell"]

_SYS_CPU = Path("/sys/devices/system/cpu")


def image_workdir(task: Task, lease: ImageLease, override: str | None) -> str:
    """The agent's working directory: the caller's, else task.toml's, else the image's
    ``WorkingDir``, else the Dockerfile's ``WORKDIR``, else ``/`` (as Docker)."""
    return override or task.config.environment.workdir or lease.record.config.workdir or task.default_workdir or "/"


def image_shell(runner_bin: str) -> tuple[str, ...]:
    """The agent's shell: the image's own bash when it has one, else the runner's (which
    runs anywhere: its own loader and libraries)."""
    script = (
        'for b in /bin/bash /usr/bin/bash /usr/local/bin/bash; do [ -x "$b" ] && exec "$b" --noprofile '
        f"--norc /dev/fd/3; done; exec {runner_bin}/bash --noprofile --norc /dev/fd/3"
    )
    return (f"{runner_bin}/bash", "--noprofile", "--norc", "-c", script)


def _make_upper(dirs: EpisodeDirs, layers: Sequence[Path]) -> None:
    """The writable layer and the folders it holds before the start (:func:`upper_folders`),
    and the runner skeleton: the runner's mount point below a copy of the image's folder
    there (its mode and times; ``0755`` where the image has none)."""
    kinds = {t.name: "dir" if t.kind == "dir" else "other" for t in merge_tops(layers)}
    for folder in (dirs.upper_root, dirs.work_root):
        folder.mkdir(parents=True, exist_ok=True)
    top = RUNNER_MOUNT.parts[1]
    mount_point = dirs.runner_skeleton / str(RUNNER_MOUNT).lstrip("/")
    mount_point.mkdir(mode=0o755, parents=True)
    for folder in (dirs.runner_skeleton, *mount_point.parents):
        if folder.is_relative_to(dirs.runner_skeleton):
            os.chmod(folder, 0o755)
    for layer in reversed(layers):  # the topmost layer that has something there decides
        try:
            st = os.lstat(layer / top)
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(st.st_mode):
            os.chmod(dirs.runner_skeleton / top, stat.S_IMODE(st.st_mode))
            os.utime(dirs.runner_skeleton / top, ns=(st.st_atime_ns, st.st_mtime_ns))
        break
    for name, (mode, opaque) in upper_folders(kinds).items():
        path = dirs.upper_root / name
        path.mkdir(exist_ok=True)
        os.chmod(path, mode)
        if opaque:
            os.setxattr(path, OPAQUE_XATTR, b"y")


def start_on_image(
    task: Task,
    workdir: str,
    dirs: EpisodeDirs,
    settings: EpisodeSettings,
    lease: ImageLease,
    limits: LimitGroups | None = None,
    resolv_conf: str | None = None,
    *,
    gpus: GpuPlan | None = None,
    above: Sequence[Path] = (),
) -> RunningEpisode:
    """The episode's init on the image's view; ``resolv_conf``: the agent's
    ``/etc/resolv.conf`` (an episode with a network), a regular file in the writable layer
    over whatever the image has there (never followed: an image's link stays as it is).
    ``above``: sealed layers of a checkpoint to start on (:mod:`.checkpoint`), lowest
    first: their ``/etc/hosts`` and ``/etc/resolv.conf`` are the episode's as they were."""
    record = lease.record
    layers = (*lease.layers, *above)
    runner = runner_tree(settings.toolchain_dir)
    if runner is None:
        raise SandboxError(
            "an episode on an image needs the verifier's runner (its init and last-resort shell "
            "come from it), and it could not be built: see the log"
        )
    runner_top = RUNNER_MOUNT.parts[1]
    if (
        image_path_kind(lease.layers, f"/{runner_top}") == "dir"
        and image_path_kind(lease.layers, str(RUNNER_MOUNT)) != "none"
    ):
        raise ImageError(f"image {record.short_id} has {RUNNER_MOUNT}, where the verifier's runner is mounted")
    fresh = {workdir.strip("/").split("/")[0]} if workdir != "/" else set()
    uid, gid, home = resolve_user(layers, record.config.user)
    mounts = plan_image_view(
        layers,
        dirs,
        toolchain=runner,
        new_tops=fresh,
        sys_cpu=_SYS_CPU if _SYS_CPU.is_dir() else None,
        volumes=record.config.volumes,
    )
    for op in mounts:
        if op.kind is MountKind.OVERLAY and overlay_option_bytes(op) > OVERLAY_OPTIONS_LIMIT:
            raise ImageError(
                f"image {record.short_id} is made of {len(op.lowers)} layers, more than one overlay "
                f"mount can name ({overlay_option_bytes(op)} bytes of options, at most "
                f"{OVERLAY_OPTIONS_LIMIT}); flatten the image (e.g. 'skopeo copy' after a squash)"
            )
    _make_upper(dirs, layers)
    dirs.make_agent_logs(p.name for p in AGENT_LOG_POINTS)
    placed = False
    etc_here = image_path_kind(layers, "/etc") in ("dir", "none")
    lower_etc = [layer / "etc" for layer in reversed(layers) if (layer / "etc").is_dir()]
    if above:  # the sealed layer has them as the episode had them
        placed = resolv_conf is not None and etc_here
    elif etc_here:  # Docker's /etc/hosts: the episode's hostname resolves without DNS
        place_etc_file(
            dirs.upper_root / "etc",
            "hosts",
            hosts_file(task.name[:63] or "sequester", resolv_conf is not None),
            like=lower_etc[0] if lower_etc else None,
        )
    if resolv_conf is not None and etc_here and not above:
        place_resolv_conf(dirs.upper_root / "etc", resolv_conf, like=lower_etc[0] if lower_etc else None)
        placed = True
    image_env = record.config.env_map()
    env = {"PATH": DEFAULT_PATH.split("=", 1)[1], "HOME": home or "/root", "TERM": "xterm", **image_env, "PWD": workdir}
    if "HOSTNAME" not in image_env:
        env["HOSTNAME"] = task.name[:63] or "sequester"
    env.update(gpus.env if gpus else ())
    gpu_ops = gpus.mount_ops() if gpus else ()
    runner_bin = f"{RUNNER_MOUNT}/bin"
    caps = CONTAINER_CAPS if uid == 0 else ()
    ids, why = episode_id_map(settings)
    spec = SandboxSpec(
        mounts=(*mounts, *gpu_ops),
        command=(f"{runner_bin}/bash", "--noprofile", "--norc", "-c", INIT_SCRIPT),
        env={"PATH": runner_bin},
        cwd=Path("/"),
        identity=Identity.ROOT,
        id_map=ids,
        caps=caps,
        uid=uid,
        gid=gid,
        hostname=task.name[:63] or "sequester",
        as_pid_1=True,
        readonly_root=False,
        seccomp=seccomp.compile_filter("agent"),  # the init too: ptrace of PID 1 gains nothing
    )
    started, freezer = launch_init(spec, limits=limits)
    names = ", ".join(record.names[:2]) or record.short_id
    notes = [f"image {names} ({record.digest}): the agent's view is the image's layers plus a writable layer"]
    if record.config.user:
        notes.append(f"the agent runs as the image's User {record.config.user!r} (uid {uid}, gid {gid})")
    if why:
        notes.append(why)
    timeout = task.config.agent.timeout_sec
    return RunningEpisode(
        task,
        workdir,
        dirs,
        started,
        freezer,
        env,
        time.monotonic() + timeout if timeout else None,
        notes=notes,
        runner=runner,
        view_points=view_points(
            [*(op.dest for op in (*mounts, *gpu_ops)), *([Path("/etc/hosts")] if etc_here else [])]
        ),
        image=record,
        lease=lease,
        shell_argv=image_shell(runner_bin),
        agent_caps=caps,
        id_map=ids,
        agent_ids=(uid, gid) if ids is not None and uid != 0 else None,
        resolv_placed=placed,
        above=tuple(above),
    )
