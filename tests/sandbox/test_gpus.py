"""GPUs for a sandbox (:mod:`sequester.sandbox.gpus`), planned from a CDI specification
as the NVIDIA container toolkit writes one, or from the host's device nodes and driver
libraries. Pure functions on sample files in a temporary folder: this machine has no GPU
(the refusal itself is tested for real in tests/environments/local/test_episode.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sequester.sandbox.gpus import (
    GpuUnavailable,
    available_gpus,
    find_gpus,
    parse_cdi_spec,
    parse_ldconfig,
    plan_from_cdi,
    plan_from_host,
)
from sequester.sandbox.mounts import MountKind

LIB = "/usr/lib/x86_64-linux-gnu"
# The shape `nvidia-ctk cdi generate` writes (trimmed): common edits, one entry per GPU and "all".
SPEC_YAML = f"""---
cdiVersion: 0.5.0
kind: nvidia.com/gpu
devices:
- name: "0"
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
- name: "1"
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia1
- name: GPU-7a3e0000-0000-0000-0000-000000000000
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
- name: all
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
    - path: /dev/nvidia1
containerEdits:
  env:
  - NVIDIA_VISIBLE_DEVICES=void
  deviceNodes:
  - path: /dev/nvidia-modeset
  - path: /dev/nvidia-uvm
  - path: /dev/nvidia-uvm-tools
  - path: /dev/nvidiactl
  hooks:
  - hookName: createContainer
    path: /usr/bin/nvidia-cdi-hook
    args: [nvidia-cdi-hook, create-symlinks, --link, libcuda.so.1::{LIB}/libcuda.so]
  - hookName: createContainer
    path: /usr/bin/nvidia-cdi-hook
    args: [nvidia-cdi-hook, update-ldcache, --folder, {LIB}]
  - hookName: createContainer
    path: /usr/bin/nvidia-cdi-hook
    args: [nvidia-cdi-hook, chmod, --mode, "755", --path, /dev/dri]
  mounts:
  - hostPath: {LIB}/libcuda.so.550.54.15
    containerPath: {LIB}/libcuda.so.550.54.15
    options: [ro, nosuid, nodev, bind]
  - hostPath: /run/nvidia-persistenced/socket
    containerPath: /run/nvidia-persistenced/socket
    options: [nosuid, nodev, bind, noexec]
  - hostPath: /usr/bin/nvidia-smi
    containerPath: /usr/bin/nvidia-smi
    options: [ro, nosuid, nodev, bind]
"""


def _spec_dir(tmp_path: Path, text: str = SPEC_YAML, name: str = "nvidia.yaml") -> Path:
    folder = tmp_path / "cdi"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)
    return folder


def test_a_cdi_spec_gives_the_first_gpus_with_the_specs_edits(tmp_path):
    plan = find_gpus(1, cdi_dirs=[_spec_dir(tmp_path)], dev=tmp_path / "no-dev")
    dev = Path("/dev")
    assert plan.count == 1 and str(tmp_path / "cdi" / "nvidia.yaml") in plan.source
    assert plan.devices == tuple((dev / n, dev / n) for n in
                                 ("nvidia-modeset", "nvidia-uvm", "nvidia-uvm-tools", "nvidiactl", "nvidia0"))
    assert plan.mounts == ((Path(f"{LIB}/libcuda.so.550.54.15"),) * 2, (Path("/run/nvidia-persistenced/socket"),) * 2,
                           (Path("/usr/bin/nvidia-smi"),) * 2)
    assert plan.env == (("NVIDIA_VISIBLE_DEVICES", "void"),)
    assert plan.links == (("libcuda.so.1", Path(f"{LIB}/libcuda.so")),)
    assert plan.ldconfig == (LIB,)
    assert plan.notes == (f"the CDI hook createContainer 'nvidia-cdi-hook chmod --mode' of {tmp_path}/cdi/nvidia.yaml "
                          "was not run",)
    two = find_gpus(2, cdi_dirs=[_spec_dir(tmp_path)])
    assert [d.name for d, _ in two.devices][-2:] == ["nvidia0", "nvidia1"]


def test_the_plan_as_mounts_binds_devices_usable_and_every_driver_file_read_only(tmp_path):
    ops = find_gpus(1, cdi_dirs=[_spec_dir(tmp_path)]).mount_ops()
    kinds = {(op.kind, str(op.dest)) for op in ops}
    assert (MountKind.DEV_BIND, "/dev/nvidia0") in kinds and (MountKind.DEV_BIND, "/dev/nvidiactl") in kinds
    # the spec leaves the socket writable: the sandbox binds it read-only (it still connects)
    assert (MountKind.READONLY, "/run/nvidia-persistenced/socket") in kinds
    assert (MountKind.SYMLINK, f"{LIB}/libcuda.so") in kinds
    assert not any(op.kind is MountKind.BIND for op in ops)


def test_a_json_spec_reads_the_same(tmp_path):
    import yaml

    as_json = find_gpus(1, cdi_dirs=[_spec_dir(tmp_path / "j", json.dumps(yaml.safe_load(SPEC_YAML)), "nvidia.json")])
    as_yaml = find_gpus(1, cdi_dirs=[_spec_dir(tmp_path / "y")])
    fields = ("count", "devices", "mounts", "env", "links", "ldconfig")
    assert [getattr(as_json, f) for f in fields] == [getattr(as_yaml, f) for f in fields]


def test_more_gpus_than_the_spec_lists_is_refused(tmp_path):
    with pytest.raises(GpuUnavailable, match="fewer than 3"):
        find_gpus(3, cdi_dirs=[_spec_dir(tmp_path)])
    assert available_gpus(cdi_dirs=[_spec_dir(tmp_path)])[0] == 2


@pytest.mark.parametrize("text, match", [
    ("{not json", "not a valid CDI specification"),
    ("kind: nvidia.com/gpu\n", "no cdiVersion"),
    ("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- containerEdits: {}\n", "without a name"),
    ('cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: "0"\n  containerEdits:\n    mounts:\n'
     "    - hostPath: ../etc/shadow\n      containerPath: /x\n", "not an absolute path"),
])
def test_a_bad_spec_is_refused_naming_the_file(tmp_path, text, match):
    folder = _spec_dir(tmp_path, text)
    with pytest.raises(GpuUnavailable, match=match) as caught:
        find_gpus(1, cdi_dirs=[folder])
    assert str(folder / "nvidia.yaml") in str(caught.value)


def test_a_spec_of_another_kind_is_not_a_gpu(tmp_path):
    other = SPEC_YAML.replace("kind: nvidia.com/gpu", "kind: vendor.com/fpga")
    specs = [parse_cdi_spec(other, "other.yaml")]
    with pytest.raises(GpuUnavailable, match="no CDI specification of kind nvidia.com/gpu"):
        plan_from_cdi(specs, 1)
    with pytest.raises(GpuUnavailable, match="no /dev/nvidia<N>"):
        find_gpus(1, cdi_dirs=[_spec_dir(tmp_path, other)], dev=tmp_path)


LDCONFIG = f"""1234 libs found in cache `/etc/ld.so.cache'
	libz.so.1 (libc6,x86-64) => {LIB}/libz.so.1
	libnvidia-ml.so.1 (libc6,x86-64) => {LIB}/libnvidia-ml.so.1
	libcuda.so.1 (libc6,x86-64) => {LIB}/libcuda.so.1
	libcudart.so.12 (libc6,x86-64) => /usr/local/cuda/lib64/libcudart.so.12
	libGLX_nvidia.so.0 (libc6,x86-64) => {LIB}/libGLX_nvidia.so.0
"""


def test_without_a_spec_the_hosts_devices_and_driver_libraries():
    names = ["null", "nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-caps"]
    libs = parse_ldconfig(LDCONFIG)
    plan = plan_from_host(names, libs, [Path("/usr/bin/nvidia-smi")], 1)
    assert [d.name for d, _ in plan.devices] == ["nvidia0", "nvidiactl", "nvidia-uvm"]
    # the driver's, not the CUDA toolkit's (libcudart is the image's business) nor others
    assert [h.name for h, _ in plan.mounts] == ["libnvidia-ml.so.1", "libcuda.so.1", "libGLX_nvidia.so.0", "nvidia-smi"]
    assert plan.ldconfig == (LIB,) and "no CDI specification" in plan.source
    with pytest.raises(GpuUnavailable, match="only 2 GPU devices"):
        plan_from_host(names, libs, [], 3)
    with pytest.raises(GpuUnavailable, match="driver is not loaded"):
        plan_from_host(["nvidia0"], libs, [], 1)


def test_this_host_without_gpus_says_where_it_looked(tmp_path):
    count, why = available_gpus(cdi_dirs=[tmp_path / "none"], dev=tmp_path)
    assert count == 0 and "no CDI specification of nvidia.com/gpu" in why and "/dev/nvidia<N>" in why
    with pytest.raises(GpuUnavailable, match="no /dev/nvidia<N>"):
        find_gpus(1, cdi_dirs=[tmp_path / "none"], dev=tmp_path)


def test_a_stand_in_dev_tree_without_a_spec(tmp_path):
    """find_gpus over a /dev stand-in (no CDI folder): its nodes are bound at /dev/NAME."""
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("null", "nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (dev / name).touch()
    assert available_gpus(cdi_dirs=[tmp_path / "cdi"], dev=dev) == (2, "the host's /dev/nvidia* (no CDI specification)")
    plan = find_gpus(2, cdi_dirs=[tmp_path / "cdi"], dev=dev)
    assert plan.devices == tuple((dev / n, Path("/dev") / n) for n in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"))
    with pytest.raises(GpuUnavailable, match="only 2 GPU devices"):
        find_gpus(3, cdi_dirs=[tmp_path / "cdi"], dev=dev)
    (dev / "nvidiactl").unlink()  # the driver is not loaded
    assert available_gpus(cdi_dirs=[tmp_path / "cdi"], dev=dev)[0] == 0
    with pytest.raises(GpuUnavailable, match="driver is not loaded"):
        find_gpus(1, cdi_dirs=[tmp_path / "cdi"], dev=dev)
