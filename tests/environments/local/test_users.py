"""Users, groups, capabilities and process defaults like a container's
(:mod:`sequester.sandbox.idmap`, :mod:`sequester.images.owners`): an episode maps 65,536
ids, so ``useradd`` + ``su``, ``chown`` and ``apt``'s drop to ``_apt`` work; the image's
files show their real owners; ``chroot`` works; ``/tmp`` is the same filesystem as ``/``;
signals and limits start as Docker's. As root (whose range ``sequester setup ids`` made:
.ci/run), as an ordinary user (newuidmap), and as a root without a range (one id, a note)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from fakeroot import run_as_user as run_as_attacker
from fakeroot import run_in_fake_root
from images import busybox_rootfs, oci_from_rootfs, trixie_image
from nobody_site import SYSTEM_PYTHON, run_as_user
from paths import EXAMPLES
from registry import skip_unless_tools
from tasks import make_task

from sequester.environments.local.episode import Episode
from sequester.environments.settings import EpisodeSettings
from sequester.images import ImageSettings, ImageStore
from sequester.sandbox.idmap import IDS, caller_id_map

IDS_HERE, NO_IDS = caller_id_map()
needs_range = pytest.mark.skipif(IDS_HERE is None, reason=f"no id range here: {NO_IDS}")


def _image_task(root: Path, image: str, workdir: str = "/app") -> Path:
    toml = f'[environment]\ndocker_image = "{image}"\nworkdir = "{workdir}"\n'
    return make_task(root, "t", "echo 1 > /logs/verifier/reward.txt\n", toml=toml, dockerfile="FROM scratch\n")


def _lines(ep: Episode, command: str) -> list[str]:
    r = ep.exec(command, timeout=60)
    assert r.exit_code == 0, r
    return r.stdout.split("\n")[:-1]


# -- root, on an image ---------------------------------------------------------------------


@needs_range
def test_an_image_episode_maps_a_containers_range_of_ids(tmp_path, busybox_store):
    settings, ref = busybox_store
    with Episode(EpisodeSettings(images=settings)) as ep:
        ep.reset(_image_task(tmp_path, ref))
        maps = _lines(ep, "cat /proc/self/uid_map /proc/self/gid_map")
        assert [m.split() for m in maps] == [["0", str(IDS_HERE.uid), "1"], ["1", str(IDS_HERE.sub_uid), str(IDS - 1)],
                                              ["0", str(IDS_HERE.gid), "1"], ["1", str(IDS_HERE.sub_gid), str(IDS - 1)]]
        assert not any("maps one id" in n for n in ep.notes), ep.notes


@needs_range
def test_useradd_su_and_chown_work_and_files_keep_their_owners(tmp_path, busybox_store):
    settings, ref = busybox_store
    state = tmp_path / "state"
    with Episode(EpisodeSettings(images=settings, state_dir=state)) as ep:
        ep.reset(_image_task(tmp_path, ref))
        out = _lines(ep, "echo 'app:x:1000:1000::/tmp:/bin/sh' >> /etc/passwd && echo 'app:x:1000:' >> /etc/group && su app -c 'id -u; id -g; touch /tmp/by-app; stat -c %u:%g /tmp/by-app'"
                         " && echo x > /app/f && chown 1000:1000 /app/f && chown 65535:65534 /tmp && "
                         "stat -c %u:%g /app/f /tmp && chown 65536 /app/f 2>/dev/null || echo refused")
        assert out == ["1000", "1000", "1000:1000", "1000:1000", "65535:65534", "refused"], out
        # and on the host, in the writable layer, the file is the range's (never the caller's)
        upper = list(state.rglob("by-app"))
        assert upper and all(os.lstat(p).st_uid == IDS_HERE.host_uid(1000) for p in upper), upper


@needs_range
def test_chroot_one_filesystem_default_signals_and_limits(tmp_path, busybox_store):
    """What a container gives its processes and Docker's defaults: chroot (CAP_SYS_CHROOT),
    /tmp on /'s filesystem (a rename works), no signal ignored or blocked, nofile 1024."""
    settings, ref = busybox_store
    with Episode(EpisodeSettings(images=settings)) as ep:
        ep.reset(_image_task(tmp_path, ref))
        out = _lines(ep, "chroot / /bin/true && echo chrooted; stat -c %d / /tmp /root /app | sort -u | wc -l; "
                         "grep -E '^Sig(Ign|Blk)' /proc/self/status; ulimit -n; ulimit -Hn; "
                         "yes | head -c 4 | wc -c")
        assert out[0] == "chrooted" and out[1] == "1", out
        assert [line.split() for line in out[2:4]] == [["SigBlk:", "0" * 16], ["SigIgn:", "0" * 16]], out
        hard = min(524288, _hard_nofile())
        assert out[4:] == ["1024", str(hard), "4"], out


def _hard_nofile() -> int:
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return hard if hard != resource.RLIM_INFINITY else 1 << 30


@needs_range
def test_files_the_agent_gave_to_other_users_are_removed_at_the_end(tmp_path, busybox_store):
    settings, ref = busybox_store
    state = tmp_path / "state"
    with Episode(EpisodeSettings(images=settings, state_dir=state)) as ep:
        ep.reset(_image_task(tmp_path, ref))
        _lines(ep, "mkdir -p /srv/a/b && echo x > /srv/a/b/f && chmod 700 /srv/a /srv/a/b && chown -R 4242:4242 /srv/a")
        assert _episode_folders(state)
    assert _episode_folders(state) == []


def _episode_folders(state: Path) -> list[Path]:
    return [p for p in state.iterdir() if p.is_dir() and not p.name.startswith("skeleton-")]


# -- root, on the host's system -----------------------------------------------------------


@needs_range
def test_a_host_mode_episode_maps_the_range_too():
    """And a container's other capabilities: a port below 1024, a file capability."""
    with Episode() as ep:
        ep.reset(EXAMPLES / "python-csv-stats")
        out = _lines(ep, "cat /proc/self/uid_map | wc -l; touch /tmp/f && chown 33:33 /tmp/f && stat -c %u:%g /tmp/f; "
                         "chroot / true && echo chrooted; python3 -c \"import socket; s = socket.socket(); "
                         "s.bind(('127.0.0.1', 80)); s.listen(); print('port', s.getsockname()[1])\"; "
                         + ("cp /bin/true /tmp/t && setcap cap_net_bind_service+ep /tmp/t && getcap /tmp/t"
                            if shutil.which("setcap") else "echo '/tmp/t cap_net_bind_service=ep'"))
        assert out[:4] == ["2", "33:33", "chrooted", "port 80"], out
        assert out[4].replace(" ", "") == "/tmp/tcap_net_bind_service=ep", out


# -- a root without a range, and an ordinary user -------------------------------------------


def test_root_without_a_range_maps_one_id_and_says_so():
    """In the fake root (a user namespace of one id), the range cannot be mapped: one id
    and a note, never a failed start."""
    out = run_in_fake_root('''
from sequester.environments.local.episode import Episode
with Episode(settings()) as ep:
    ep.reset(TASKS / "python-csv-stats")
    r = ep.exec("cat /proc/self/uid_map; chown 5:5 /tmp 2>&1 || echo refused")
    emit({"out": r.stdout.split(), "notes": list(ep.notes)})
''')
    assert out["out"][:3] == ["0", "0", "1"] and out["out"][-1] == "refused", out
    assert any("maps one id" in n for n in out["notes"]), out["notes"]


USER_EPISODE = '''
from sequester.environments.local.episode import Episode
from sequester.sandbox.idmap import caller_id_map
ids, why = caller_id_map()
import pathlib, tempfile
state = pathlib.Path(tempfile.mkdtemp(dir=WORK))
ep = Episode(settings(state_dir=state))
ep.reset(TASKS / "python-csv-stats")
r = ep.exec("cat /proc/self/uid_map | wc -l; mkdir -p /tmp/x/y && echo s > /tmp/x/y/f && chmod 700 /tmp/x/y "
            "&& chown -R 1000:1000 /tmp/x && stat -c %u:%g /tmp/x/y/f; su -s /bin/sh nobody -c 'id -u' 2>&1")
notes = list(ep.notes)
ep.close()
emit({"ids": None if ids is None else ids.describe(), "why": why, "out": r.stdout.split(),
      "left": [str(p) for p in state.iterdir() if p.is_dir() and not p.name.startswith("skeleton-")],
      "notes": notes})
'''


def test_an_ordinary_user_maps_its_subordinate_range_and_cleans_up():
    """newuidmap/newgidmap map the user's /etc/subuid range; a tree the agent gave to
    another of its ids (0700, so the user cannot enter it) is still removed at the end."""
    out = run_as_attacker(USER_EPISODE)
    if out["ids"] is None:
        pytest.skip(f"the test user has no range here: {out['why']}")
    assert out["out"] == ["2", "1000:1000", "65534"], out
    assert out["left"] == [], out


# -- the image's own owners ----------------------------------------------------------------


@pytest.mark.slow
@needs_range
def test_a_debian_image_shows_its_owners_and_users_work(tmp_path):
    """trixie's files keep their owners (root:mail /var/mail 2775, root:shadow chage
    2755), useradd + su, a rename from /app into /tmp, and apt's drop to _apt (no
    network here: it must fail resolving, not on setgroups)."""
    skip_unless_tools("skopeo", "umoci")
    settings = ImageSettings(store_dir=tmp_path / "store", source="prebuilt")
    ImageStore(settings).import_source(trixie_image(), "test/trixie:1")
    with Episode(EpisodeSettings(images=settings)) as ep:
        ep.reset(_image_task(tmp_path, "test/trixie:1"))
        out = _lines(ep, "stat -c '%U:%G %a' /var/mail /usr/bin/chage; useradd -m app && su app -c 'id -un; echo $HOME'; "
                         "echo x > /app/x && python3 -c \"import os; os.rename('/app/x', '/tmp/x'); print('renamed')\"; "
                         "apt-get -o Acquire::Retries=0 update 2>&1 | grep -ci -e setgroups -e seteuid -e setresuid; true")
        assert out[:5] == ["root:mail 2775", "root:shadow 2755", "app", "/home/app", "renamed"], out
        assert out[5] == "0", out


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="creating a user needs root (CI runs as root)")
@pytest.mark.skipif(not SYSTEM_PYTHON.exists(), reason="needs /usr/bin/python3 (.ci/run installs it)")
def test_an_ordinary_users_image_shows_its_owners(user_site, tmp_path):
    """The same image unpacked by an ordinary user: the owners are applied in a namespace
    of its range, and its episode shows them; what the agent closes to the user (a 0700
    folder of another of its ids) is still in the tamper report."""
    skip_unless_tools("skopeo", "umoci")
    entry, home, _, site = user_site
    work = Path(site) / "owners-test"
    work.mkdir()
    try:
        rootfs = work / "rootfs"
        subprocess.run(["cp", "-a", f"{busybox_rootfs()}/.", str(rootfs)], check=True)
        (rootfs / "srv").mkdir(exist_ok=True)
        os.chown(rootfs / "srv", 33, 44)  # an image's www-data folder
        layout = oci_from_rootfs(rootfs, work / "layout", "x")  # umoci as root: the owners are in the layer
        subprocess.run(["chmod", "-R", "a+rX", str(work / "layout")], check=True)
        task = _image_task(work, "test/owned:1")
        (work / "harness.py").write_text(f'''
import json, os, sys
from sequester.environments.local.episode import Episode
from sequester.environments.settings import EpisodeSettings, episode_image_store
from sequester.images import ImageSettings
settings = EpisodeSettings(images=ImageSettings(store_dir=os.path.expanduser("~/images"), source="prebuilt"))
store = episode_image_store(settings)
if store.ids is None:
    print(json.dumps({{"skip": "no range"}})); sys.exit(0)
store.import_source(sys.argv[1], "test/owned:1")
with Episode(settings) as ep:
    ep.reset(sys.argv[2])
    r = ep.exec("stat -c %u:%g /srv")
    ep.exec("mkdir -p /usr/x && echo y > /usr/x/f && chmod 700 /usr/x && chown -R 1000:1000 /usr/x")
    tampering = [str(t) for t in ep.evaluate().tampering]
print(json.dumps({{"srv": r.stdout.strip(), "tampering": tampering}}))
''')
        subprocess.run(["chown", "-R", f"{entry.pw_uid}:{entry.pw_gid}", str(work / "harness.py"), str(task)], check=True)
        out = run_as_user(user_site, "owners-test/harness.py", layout, str(task))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        subprocess.run(["rm", "-rf", str(Path(home) / "images")], check=False)
    if "skip" in out:
        pytest.skip("the test user has no subordinate range here")
    assert out["srv"] == "33:44", out
    # the tamper report (information) reads what the agent closed to the caller, in the range
    assert any("/usr/x/f" in t for t in out["tampering"]), out["tampering"]


def test_setup_ids_is_roots_and_says_what_it_would_do(capsys):
    from sequester.cli import main

    status = main(["setup", "ids", "--dry-run"])
    out = capsys.readouterr()
    if os.geteuid() != 0:
        assert status == 2 and "root" in out.err
        return
    assert status == 0, out
    assert ("usermod" in out.out) or ("already" in out.out), out.out
    json.dumps(out.out)


IGNORING_HOST = r'''
import signal, sys
from pathlib import Path
for sig in (signal.SIGHUP, signal.SIGUSR1, signal.SIGPIPE, signal.SIGTTOU):
    signal.signal(sig, signal.SIG_IGN)  # a host started under nohup, or by a daemon that ignores these
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])
from sequester.environments.local.episode import Episode
with Episode() as ep:
    ep.reset(Path(sys.argv[1]))
    print(ep.exec("grep -E '^Sig(Ign|Blk)' /proc/self/status").stdout)
'''


def test_agents_start_with_default_signals_whatever_the_host_ignores():
    import sys

    proc = subprocess.run([sys.executable, "-c", IGNORING_HOST, str(EXAMPLES / "python-csv-stats")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [line.split() for line in proc.stdout.split("\n") if line] == [["SigBlk:", "0" * 16],
                                                                          ["SigIgn:", "0" * 16]], proc.stdout


def test_the_episodes_own_hostname_resolves_as_in_docker(tmp_path, busybox_store):
    """Docker writes /etc/hosts: loopback names and the container's hostname at its address.
    Without it a program that looks its own host up (R, Java, sudo) asked DNS (a TB2 sweep:
    `mcmc-sampling-stan` was refused by the episode's DNS). Not a change of the agent's."""
    settings, ref = busybox_store
    with Episode(EpisodeSettings(images=settings)) as ep:
        ep.reset(_image_task(tmp_path, ref))
        out = _lines(ep, "grep -w \"$(hostname)\" /etc/hosts | cut -f1; grep -c localhost /etc/hosts")
        assert out[0] in ("10.0.2.100", "127.0.1.1") and int(out[1]) >= 2, out
        assert not any("/etc/hosts" in t for t in ep.evaluate().tampering)
    with Episode() as ep:
        ep.reset(EXAMPLES / "python-csv-stats")
        assert _lines(ep, "getent hosts $(hostname) | cut -d' ' -f1") == ["127.0.1.1"]
        assert not any("/etc/hosts" in t for t in ep.evaluate().tampering)
