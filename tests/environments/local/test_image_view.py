"""The plan of an episode's view on an image (:mod:`sequester.environments.local.image_view`,
pure), and reading the merged layer stack (:mod:`sequester.images.stack`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sequester.environments.local.image_view import (
    OVERLAY_OPTIONS_LIMIT,
    overlay_option_bytes,
    plan_image_view,
    upper_folders,
)
from sequester.environments.local.state import EpisodeDirs
from sequester.errors import ImageError
from sequester.images.reference import parse_reference
from sequester.images.stack import OPAQUE_XATTR, TopEntry, image_path_kind, merge_tops, read_image_file, resolve_user
from sequester.sandbox.argv import CONTAINER_CAPS, Identity, SandboxSpec, build_argv
from sequester.sandbox.mounts import MountKind, MountOp


def _layers(tmp_path: Path) -> list[Path]:
    low, mid, top = (tmp_path / n for n in ("low", "mid", "top"))
    for layer in (low, mid, top):
        layer.mkdir()
    (low / "usr" / "bin").mkdir(parents=True)
    (low / "etc").mkdir()
    (low / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\napp:x:1000:1001:app:/home/app:/bin/sh\n")
    (low / "etc" / "group").write_text("root:x:0:\nstaff:x:50:\n")
    (low / "gone").mkdir()
    (low / "opq").mkdir()
    (low / "opq" / "old").write_text("x")
    os.symlink("usr/bin", low / "bin")
    (mid / "usr").mkdir()
    os.mknod(mid / "gone", 0o600 | 0o020000, 0)  # a whiteout of the folder
    (mid / "opq").mkdir()
    os.setxattr(mid / "opq", OPAQUE_XATTR, b"y")
    (top / "usr").mkdir()
    (top / "app").mkdir()
    return [low, mid, top]


def test_merge_tops_follows_overlay_rules(tmp_path):
    low, mid, top = _layers(tmp_path)
    tops = {t.name: t for t in merge_tops([low, mid, top])}
    assert "gone" not in tops  # whited out above
    assert tops["usr"] == TopEntry("usr", "dir", (low / "usr", mid / "usr", top / "usr"))
    assert tops["opq"].lowers == (mid / "opq",)  # opaque: nothing below it
    assert tops["bin"] == TopEntry("bin", "symlink", (), "usr/bin")
    assert tops["app"].lowers == (top / "app",)


def test_files_and_users_from_the_image(tmp_path):
    layers = _layers(tmp_path)
    assert read_image_file(layers, "/etc/passwd").startswith(b"root:")
    assert read_image_file(layers, "/bin/sh") is None  # through a link: not read
    assert read_image_file(layers, "/gone/x") is None
    assert resolve_user(layers, "") == (0, 0, "/root")
    assert resolve_user(layers, "app") == (1000, 1001, "/home/app")
    assert resolve_user(layers, "app:staff") == (1000, 50, "/home/app")
    assert resolve_user(layers, "4321:99") == (4321, 99, None)
    with pytest.raises(ImageError, match="'nobody-here' is not in its /etc/passwd"):
        resolve_user(layers, "nobody-here")
    assert image_path_kind(layers, "/app") == "dir" and image_path_kind(layers, "/app/x/y") == "none"
    assert image_path_kind(layers, "/gone") == "none" and image_path_kind(layers, "/bin") == "other"


def test_the_view_is_one_filesystem_with_the_sandboxs_own_mounts_on_it(tmp_path):
    """One overlay at / over every layer (so a rename from /app into /tmp or /root works, as
    in a container), the sandbox's /proc, /dev and hidden verifier points on it, the runner
    read-only, and /tmp, /run of the image itself unless its config declares them volumes."""
    dirs = EpisodeDirs(tmp_path / "ep")
    layers = [Path("/l1"), Path("/l2")]
    ops = plan_image_view(layers, dirs, toolchain=Path("/runner"), new_tops={"app", "tmp", "proc"})
    by_dest = {(op.kind, str(op.dest)): op for op in ops}
    root = by_dest[(MountKind.OVERLAY, "/")]
    assert root.lowers == (Path("/l1"), Path("/l2"), dirs.runner_skeleton)
    assert (root.upper, root.work) == (dirs.upper_root, dirs.work_root)
    assert ops[0] is root  # everything else is mounted on it
    assert not any(op.kind is MountKind.OVERLAY and str(op.dest) != "/" for op in ops)
    assert (MountKind.PROC, "/proc") in by_dest and (MountKind.HIDE_DIR, "/tests") in by_dest
    assert (MountKind.DIR, "/app") in by_dest  # the working directory's top, if the image lacks it
    assert not {"/tmp", "/run"} & {str(op.dest) for op in ops}  # the image's own folders
    assert by_dest[(MountKind.READONLY, "/opt/sequester-verifier")].source == Path("/runner")
    assert not any(op.source and str(op.source).startswith(("/usr", "/root")) for op in ops)  # nothing of the host's
    declared = {str(op.dest) for op in plan_image_view(layers, dirs, toolchain=Path("/r"), volumes=["/tmp/"])}
    assert "/tmp" in declared and "/run" not in declared
    argv = build_argv("bwrap", SandboxSpec(mounts=(root,), command=("true",), identity=Identity.ROOT,
                                           caps=CONTAINER_CAPS, uid=7, gid=8), __import__("sequester.sandbox.argv",
                                                                                            fromlist=["LaunchFds"]).LaunchFds())
    joined = " ".join(argv)
    assert "--overlay-src /l1 --overlay-src /l2 --overlay" in joined and "--uid 7 --gid 8" in joined


def test_the_writable_layer_starts_with_the_sandboxs_folders():
    """Mount points fresh and opaque (nothing of the image's /proc, /dev, /tests shows
    through); /tmp 1777 where the image has none. Never the runner's folder: it is the
    runner skeleton's, a lower layer (below)."""
    made = upper_folders({"usr": "dir", "opt": "dir", "tmp": "dir", "tests": "dir"})
    assert made == {name: (0o755, True) for name in ("proc", "dev", "sys", "tests", "logs")}
    made = upper_folders({"usr": "dir", "opt": "other"})
    assert "opt" not in made and made["tmp"] == (0o1777, False)
    assert "opt" not in upper_folders({})


def test_the_runner_skeleton_is_the_topmost_lower_layer(tmp_path):
    """The runner's mount point is a folder of a lower layer above the image's and the
    sealed ones: no agent wrote it, no link below it is followed, it cannot be renamed."""
    dirs = EpisodeDirs(tmp_path / "ep")
    layers = [Path("/store/l1"), Path("/store/l2"), Path("/state/ckpt/layer")]
    ops = plan_image_view(layers, dirs, toolchain=Path("/tc"))
    root = next(op for op in ops if op.kind is MountKind.OVERLAY and op.dest == Path("/"))
    assert root.lowers == (*layers, dirs.runner_skeleton) and root.upper == dirs.upper_root


def test_too_many_layers_for_one_overlay_is_measured():
    op = MountOp(MountKind.OVERLAY, Path("/usr"), lowers=tuple(Path(f"/var/lib/sequester/images/layers/{i:064x}/usr")
                                                                 for i in range(40)), upper=Path("/u"), work=Path("/w"))
    assert overlay_option_bytes(op) > OVERLAY_OPTIONS_LIMIT


@pytest.mark.parametrize("text, expected", [
    ("python:3.13-slim-bookworm", "docker.io/library/python:3.13-slim-bookworm"),
    ("ubuntu", "docker.io/library/ubuntu:latest"),
    ("docker.io/library/ubuntu:24.04", "docker.io/library/ubuntu:24.04"),
    ("index.docker.io/org/img:1", "docker.io/org/img:1"),
    ("localhost:5000/x/y", "localhost:5000/x/y:latest"),
    ("ghcr.io/org/img@sha256:" + "a" * 64, "ghcr.io/org/img@sha256:" + "a" * 64),
])
def test_references_normalise_as_docker_does(text, expected):
    assert str(parse_reference(text)) == expected


@pytest.mark.parametrize("text", ["", "UPPER/case", "a b", "img@sha256:short", "host:5000/", "x:bad tag"])
def test_bad_references_name_themselves(text):
    with pytest.raises(ImageError, match="image reference"):
        parse_reference(text)
