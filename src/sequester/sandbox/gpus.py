"""NVIDIA GPUs for a sandbox, as the NVIDIA container toolkit gives them to a container.

A task asks for ``[environment] gpus = N``. Where the host has a CDI specification of its
GPUs (the Container Device Interface, cncf-tags/container-device-interface; the toolkit's
``nvidia-ctk cdi generate`` writes one under ``/etc/cdi`` or ``/var/run/cdi``), it is the
authority, as for podman, containerd or Docker with CDI: devices ``0`` .. ``N-1`` of kind
``nvidia.com/gpu`` are requested, and the spec's ``containerEdits`` (those of the spec and
those of each requested device) say what the sandbox gets:

* ``deviceNodes``: each bound at its ``path`` from its ``hostPath`` (else the same path);
* ``mounts``: each ``hostPath`` bound at ``containerPath``, read-only whatever its options
  (the driver's libraries and programs; a socket on a read-only mount still connects);
* ``env``: variables of the agent's environment;
* ``hooks``: the toolkit's ``create-symlinks`` (``--link TARGET::LINK``) becomes symlinks
  and ``update-ldcache`` (``--folder DIR``) an ``ldconfig`` of those folders in the view;
  any other hook cannot be run by a sandbox that is not an OCI runtime and is named in
  the notes.

Without a spec: the host's own ``/dev/nvidia<i>`` (``i`` < N), ``/dev/nvidiactl``,
``/dev/nvidia-uvm``, ``/dev/nvidia-uvm-tools``, ``/dev/nvidia-modeset``, and the driver's
libraries as the host's loader lists them (``ldconfig -p``: ``libcuda``, ``libnvidia-*``,
...) with its programs (``nvidia-smi``, ...), each bound at its own path, and an
``ldconfig`` of their folders: what ``nvidia-container-cli list`` gives a container.

Fewer GPUs than asked (none at all on most machines) is :class:`GpuUnavailable`, whose
message names the task's ``gpus``: the trial is refused before anything starts. No
allocation between concurrent sandboxes: each gets the first N, as ``docker run --gpus N``.

The planning functions are pure (texts and listings in, a :class:`GpuPlan` out); only
:func:`find_gpus` looks at the host.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sequester.errors import SandboxError
from sequester.sandbox.mounts import MountKind, MountOp

__all__ = [
    "CDI_DIRS",
    "DRIVER_PROGRAMS",
    "CdiSpec",
    "GpuPlan",
    "GpuUnavailable",
    "available_gpus",
    "find_gpus",
    "parse_cdi_spec",
    "parse_ldconfig",
    "plan_from_cdi",
    "plan_from_host",
]

CDI_DIRS = (Path("/etc/cdi"), Path("/var/run/cdi"))
CDI_KIND = "nvidia.com/gpu"
_CONTROL_DEVICES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
_GPU_DEVICE = re.compile(r"^nvidia(\d+)$")
# The driver's libraries and programs, as libnvidia-container lists them for a container.
_DRIVER_LIBS = re.compile(
    r"^(libcuda|libcudadebugger|libnvidia-[a-z0-9-]+|libnvcuvid|libnvoptix|libGLX_nvidia|libEGL_nvidia|"
    r"libGLESv[12]_CM_nvidia|libGLESv2_nvidia|libvdpau_nvidia)\.so(\.|$)"
)
DRIVER_PROGRAMS = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)


class GpuUnavailable(SandboxError):
    """The task asks for more GPUs than this host can give a sandbox."""


@dataclass(frozen=True)
class CdiSpec:
    """One CDI specification file: its kind, its devices' edits by name, the common edits."""

    source: str
    kind: str
    devices: Mapping[str, Mapping[str, Any]]
    edits: Mapping[str, Any]


@dataclass(frozen=True)
class GpuPlan:
    """What a sandbox gets for its GPUs. ``devices``: ``(host path, path inside)`` of each
    device node; ``mounts``: ``(host path, path inside)`` of the driver's files (bound
    read-only, whatever the spec's options); ``env``: variables;
    ``links``: ``(target, link)`` symlinks to make; ``ldconfig``: folders whose libraries
    the loader's cache must list (``ldconfig`` in the view); ``notes``: what of the spec
    was not applied; ``source``: where it came from (for the trial's notes)."""

    count: int
    source: str
    devices: tuple[tuple[Path, Path], ...] = ()
    mounts: tuple[tuple[Path, Path], ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    links: tuple[tuple[str, Path], ...] = ()
    ldconfig: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())

    def describe(self) -> str:
        return f"{self.count} GPU{'s' if self.count != 1 else ''} from {self.source}"

    def mount_ops(self) -> tuple[MountOp, ...]:
        """The sandbox's mounts for them, after its own ``/dev``: device nodes usable, every
        file of the driver read-only (a socket there still connects), the symlinks. Pure."""
        return (
            *(MountOp(MountKind.DEV_BIND, inside, source=host) for host, inside in self.devices),
            *(MountOp(MountKind.READONLY, inside, source=host) for host, inside in self.mounts),
            *(MountOp(MountKind.SYMLINK, link, target=target) for target, link in self.links),
        )


def _load_text(text: str, source: str) -> Any:
    """A spec's text: JSON, or YAML (the toolkit's default)."""
    stripped = text.lstrip()
    if stripped.startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise GpuUnavailable(f"{source}: not a valid CDI specification ({exc})") from None
    try:
        import yaml
    except ImportError:  # pragma: no cover - a declared dependency
        raise GpuUnavailable(f"{source}: a YAML CDI specification needs PyYAML") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise GpuUnavailable(f"{source}: not a valid CDI specification ({exc})") from None


def parse_cdi_spec(text: str, source: str) -> CdiSpec:
    """One CDI specification (JSON or YAML), checked as far as it is used. Pure."""
    data = _load_text(text, source)
    if not isinstance(data, dict) or not isinstance(data.get("kind"), str) or "cdiVersion" not in data:
        raise GpuUnavailable(f"{source}: not a CDI specification (no cdiVersion and kind)")
    devices: dict[str, Mapping[str, Any]] = {}
    for device in data.get("devices") or []:
        if not isinstance(device, dict) or not isinstance(device.get("name"), str):
            raise GpuUnavailable(f"{source}: a device without a name")
        edits = device.get("containerEdits") or {}
        if not isinstance(edits, dict):
            raise GpuUnavailable(f"{source}: device {device['name']!r}: containerEdits is not a table")
        devices[device["name"]] = edits
    edits = data.get("containerEdits") or {}
    if not isinstance(edits, dict):
        raise GpuUnavailable(f"{source}: containerEdits is not a table")
    return CdiSpec(source, data["kind"], devices, edits)


def _absolute(value: Any, what: str, source: str) -> Path:
    if not isinstance(value, str) or not value.startswith("/") or ".." in value.split("/"):
        raise GpuUnavailable(f"{source}: {what} {value!r} is not an absolute path")
    return Path(value)


def _hook_args(hook: Mapping[str, Any], flag: str) -> list[str]:
    """The values of ``--flag VALUE`` / ``--flag=VALUE`` in a hook's args."""
    args = [a for a in hook.get("args") or [] if isinstance(a, str)]
    found = []
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            found.append(args[i + 1])
        elif arg.startswith(flag + "="):
            found.append(arg.split("=", 1)[1])
    return found


def _apply_edits(edits: Mapping[str, Any], source: str, plan: dict[str, list[Any]]) -> None:
    for node in edits.get("deviceNodes") or []:
        inside = _absolute(node.get("path"), "device path", source)
        host = _absolute(node.get("hostPath") or node.get("path"), "device hostPath", source)
        plan["devices"].append((host, inside))
    for mount in edits.get("mounts") or []:
        host = _absolute(mount.get("hostPath"), "mount hostPath", source)
        inside = _absolute(mount.get("containerPath"), "mount containerPath", source)
        plan["mounts"].append((host, inside))
    for entry in edits.get("env") or []:
        if not isinstance(entry, str) or "=" not in entry:
            raise GpuUnavailable(f"{source}: env entry {entry!r} is not NAME=VALUE")
        name, value = entry.split("=", 1)
        plan["env"].append((name, value))
    for hook in edits.get("hooks") or []:
        args = [a for a in hook.get("args") or [] if isinstance(a, str)]
        if "create-symlinks" in args:
            for link in _hook_args(hook, "--link"):
                target, sep, path = link.partition("::")
                if not sep:
                    raise GpuUnavailable(f"{source}: create-symlinks link {link!r} is not TARGET::LINK")
                plan["links"].append((target, _absolute(path, "symlink", source)))
        elif "update-ldcache" in args:
            plan["ldconfig"] += [str(_absolute(f, "ldcache folder", source)) for f in _hook_args(hook, "--folder")]
        else:
            name = " ".join(str(a) for a in args[:3]) or str(hook.get("path"))
            plan["notes"].append(f"the CDI hook {hook.get('hookName', '?')} {name!r} of {source} was not run")
    for key in ("additionalGIDs", "intelRdt", "netDevices"):
        if edits.get(key):
            plan["notes"].append(f"the CDI edit {key} of {source} was not applied")


def plan_from_cdi(specs: Sequence[CdiSpec], count: int) -> GpuPlan:
    """The first ``count`` GPUs (devices ``0`` .. ``count-1`` of kind ``nvidia.com/gpu``)
    of ``specs``, with the edits of their spec. Raises :class:`GpuUnavailable`. Pure."""
    for spec in specs:
        if spec.kind != CDI_KIND:
            continue
        indexes = sorted(int(name) for name in spec.devices if name.isdigit())
        if indexes[:count] != list(range(count)):
            raise GpuUnavailable(
                f"{spec.source} lists {len(indexes)} {CDI_KIND} device{'s' if len(indexes) != 1 else ''} "
                f"by index, fewer than {count}"
            )
        plan: dict[str, list[Any]] = {k: [] for k in ("devices", "mounts", "env", "links", "ldconfig", "notes")}
        _apply_edits(spec.edits, spec.source, plan)
        for index in range(count):
            _apply_edits(spec.devices[str(index)], spec.source, plan)
        return GpuPlan(
            count,
            f"the CDI specification {spec.source}",
            tuple(dict.fromkeys(plan["devices"])),
            tuple(dict.fromkeys(plan["mounts"])),
            tuple(dict.fromkeys(plan["env"])),
            tuple(dict.fromkeys(plan["links"])),
            tuple(dict.fromkeys(plan["ldconfig"])),
            tuple(dict.fromkeys(plan["notes"])),
        )
    raise GpuUnavailable(f"no CDI specification of kind {CDI_KIND} ({', '.join(s.source for s in specs)})")


def parse_ldconfig(text: str) -> list[Path]:
    """The library paths of ``ldconfig -p``'s listing (``name (flags) => path``). Pure."""
    found = []
    for line in text.splitlines():
        _, arrow, path = line.partition(" => ")
        if arrow and path.strip().startswith("/"):
            found.append(Path(path.strip()))
    return found


def plan_from_host(
    dev_names: Iterable[str],
    libraries: Iterable[Path],
    programs: Iterable[Path],
    count: int,
    *,
    dev: Path = Path("/dev"),
) -> GpuPlan:
    """Without a CDI spec: the host's device nodes (``dev_names``: the names in ``/dev``),
    the driver's libraries among ``libraries`` (``ldconfig -p``) and ``programs`` that
    exist, each at its own path. Raises :class:`GpuUnavailable`. Pure."""
    names = set(dev_names)
    gpus = sorted(int(m[1]) for n in names if (m := _GPU_DEVICE.match(n)))
    if gpus[:count] != list(range(count)):
        have = f"only {len(gpus)} GPU device{'s' * (len(gpus) != 1)} (/dev/nvidia<N>)" if gpus else "no /dev/nvidia<N>"
        raise GpuUnavailable(f"no CDI specification under {' or '.join(map(str, CDI_DIRS))}, and {have}")
    if "nvidiactl" not in names:
        raise GpuUnavailable("/dev/nvidia<N> without /dev/nvidiactl: the NVIDIA driver is not loaded")
    nodes = [f"nvidia{i}" for i in range(count)] + [n for n in _CONTROL_DEVICES if n in names]
    libs = [p for p in dict.fromkeys(libraries) if _DRIVER_LIBS.match(p.name)]
    return GpuPlan(
        count,
        "the host's /dev/nvidia* and driver libraries (no CDI specification)",
        tuple((dev / n, Path("/dev") / n) for n in nodes),
        tuple((p, p) for p in [*libs, *programs]),
        ldconfig=tuple(dict.fromkeys(str(p.parent) for p in libs)),
    )


def _cdi_specs(dirs: Sequence[Path]) -> list[CdiSpec]:
    specs = []
    for folder in dirs:
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            continue
        for name in names:
            if name.endswith((".json", ".yaml", ".yml")):
                path = folder / name
                try:
                    text = path.read_text()
                except OSError as exc:
                    raise GpuUnavailable(f"{path}: cannot be read ({exc.strerror})") from None
                specs.append(parse_cdi_spec(text, str(path)))
    return specs


def find_gpus(count: int, *, cdi_dirs: Sequence[Path] | None = None, dev: Path = Path("/dev")) -> GpuPlan:
    """What this host can give a sandbox for ``count`` GPUs (see the module); raises
    :class:`GpuUnavailable` saying why not."""
    specs = _cdi_specs(CDI_DIRS if cdi_dirs is None else cdi_dirs)
    if any(s.kind == CDI_KIND for s in specs):
        return plan_from_cdi(specs, count)
    try:
        names = os.listdir(dev)
    except OSError:
        names = []
    libraries: list[Path] = []
    if any(_GPU_DEVICE.match(n) for n in names):
        try:
            listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            listing = ""
        libraries = parse_ldconfig(listing)
    programs = [Path("/usr/bin") / p for p in DRIVER_PROGRAMS if (Path("/usr/bin") / p).is_file()]
    return plan_from_host(names, libraries, programs, count, dev=dev)


def available_gpus(*, cdi_dirs: Sequence[Path] | None = None, dev: Path = Path("/dev")) -> tuple[int, str]:
    """How many GPUs :func:`find_gpus` can give here, and from where (or why none)."""
    specs: list[CdiSpec] = []
    try:
        specs = _cdi_specs(CDI_DIRS if cdi_dirs is None else cdi_dirs)
    except GpuUnavailable as exc:
        return 0, str(exc)
    for spec in specs:
        if spec.kind == CDI_KIND:
            indexes = {int(n) for n in spec.devices if n.isdigit()}
            n = next(i for i in range(len(indexes) + 1) if i not in indexes)
            return n, f"the CDI specification {spec.source}"
    try:
        names = set(os.listdir(dev))
    except OSError:
        names = set()
    gpus = {int(m[1]) for n in names if (m := _GPU_DEVICE.match(n))}
    n = next(i for i in range(len(gpus) + 1) if i not in gpus)
    if n and "nvidiactl" in names:
        return n, "the host's /dev/nvidia* (no CDI specification)"
    where = " or ".join(map(str, CDI_DIRS if cdi_dirs is None else cdi_dirs))
    return 0, f"no CDI specification of {CDI_KIND} under {where} and no /dev/nvidia<N> with /dev/nvidiactl"
