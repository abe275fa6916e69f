"""Episodes on a task's own image (:mod:`sequester.environments.local.image_start`): the
view is the image's layers, every guarantee holds, as root and when the host process is
an ordinary user.

Images are made by real tools (debootstrap, umoci, skopeo; tests/helpers/images.py) and
served by a real registry on loopback (tests/helpers/registry.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from images import busybox_rootfs, oci_from_rootfs, trixie_image
from paths import IMAGE_TASKS
from registry import running_registry, skip_unless_tools
from tasks import make_task

from sequester.cli import main
from sequester.environments.local.episode import Episode
from sequester.environments.settings import EpisodeSettings
from sequester.errors import ImageError
from sequester.images import ImageSettings, ImageStore
import shutil
import subprocess
from nobody_site import SYSTEM_PYTHON, run_as_user

EXAMPLE = IMAGE_TASKS / "python313-primes"
# TB2's canonical verifier script: the example's copy is verbatim.
TB2_SCRIPT_LINES = ("apt-get install -y curl", "curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh",
                    "source $HOME/.local/bin/env", "  -p 3.13 \\")


@pytest.fixture(scope="module")
def configured_store(tmp_path_factory) -> Iterator[tuple[ImageSettings, str]]:
    """busybox with a config: Env, WorkingDir (absent from the layers) and a numeric User."""
    skip_unless_tools("skopeo", "umoci")
    root = tmp_path_factory.mktemp("configured")
    ref = oci_from_rootfs(busybox_rootfs(), root / "layout", "cfg", env=["PATH=/bin:/usr/bin", "FOO=from-image"],
                          workdir="/work/dir", user="1234:2345")
    settings = ImageSettings(store_dir=root / "store", source="prebuilt")
    ImageStore(settings).import_source(ref, "test/configured:1")
    yield settings, "test/configured:1"


def _task(root: Path, image: str, test_sh: str, *, workdir: str | None = None, environment: str = "",
          dockerfile: str = "FROM scratch\n") -> Path:
    toml = f'[environment]\ndocker_image = "{image}"\n' + (f'workdir = "{workdir}"\n' if workdir else "") + environment
    return make_task(root, "t", test_sh, toml=toml, dockerfile=dockerfile)


def test_shell_only_image_runs_with_the_runners_init_and_shell(tmp_path, busybox_store):
    settings, ref = busybox_store
    task = _task(tmp_path, ref, "test \"$(cat /app/out.txt)\" = hello && echo 1 > /logs/verifier/reward.txt "
                 "|| echo 0 > /logs/verifier/reward.txt\n", workdir="/app")
    with Episode(EpisodeSettings(images=settings)) as ep:
        ep.reset(task)
        assert ep.system["mode"] == "image" and ep.system["digest"].startswith("sha256:")
        r = ep.exec("ls /bin/bash /usr/bin/python3 2>&1; busybox | head -1; echo hello > out.txt; pwd")
        assert "No such file" in r.stdout and "BusyBox" in r.stdout and r.stdout.rstrip().endswith("/app")
        assert ep.evaluate().reward == 1.0
    # nop on the same image
    with Episode(EpisodeSettings(images=settings)) as ep:
        ep.reset(task)
        assert ep.evaluate().reward == 0.0


def test_view_is_the_image_and_the_image_stays_untouched(tmp_path, busybox_store):
    settings, ref = busybox_store
    store = ImageStore(settings)
    layers = store.lease(store.find(ref))
    layers.release()
    before = sorted(os.listdir(layers.layers[0] / "bin"))
    task = _task(tmp_path, ref, "echo 1 > /logs/verifier/reward.txt\n", workdir="/app")
    secret = tmp_path / "host-secret.txt"
    secret.write_text("host")
    with Episode(EpisodeSettings(images=settings)) as ep:
        ep.reset(task)
        r = ep.exec(f"ls /usr/lib/python3* /usr/bin/gcc {secret} {task} 2>&1 | grep -c 'No such file'; "
                    "(ls -A /tests; ls -A /logs) | wc -l; touch /tests/x /logs/x 2>&1 | grep -c 'Read-only'; "
                    "echo planted > /bin/planted && rm /bin/ls && echo changed")
        lines = r.stdout.split()
        assert lines[0] == "4", r.stdout  # nothing of the host's system, the task or its files
        # (/logs holds only the agent's own folders: agent, artifacts)
        assert lines[1] == "2" and lines[2] == "2" and lines[3] == "changed", r.stdout
    assert sorted(os.listdir(layers.layers[0] / "bin")) == before  # the agent wrote its own layer only
    with Episode(EpisodeSettings(images=settings)) as ep:  # and the next episode sees the image as it is
        ep.reset(task)
        assert ep.exec("ls /bin/planted 2>&1; ls /bin/ls").stdout.split()[-1] == "/bin/ls"


def test_image_config_env_workdir_and_user_apply(tmp_path, configured_store):
    settings, ref = configured_store
    task = _task(tmp_path, ref, "echo 1 > /logs/verifier/reward.txt\n")
    with Episode(EpisodeSettings(images=settings)) as ep:
        ep.reset(task)
        out = ep.exec("id -u; id -g; pwd; echo $FOO; cat /proc/self/status | grep CapEff").stdout.split()
        assert out[:4] == ["1234", "2345", "/work/dir", "from-image"], out
        assert out[-1] == "0000000000000000"  # a non-root User has no capabilities
        assert any("User '1234:2345'" in n for n in ep.notes)
        assert ep.evaluate().reward == 1.0


def test_separate_verifier_environment_uses_the_same_image(tmp_path, busybox_store):
    settings, ref = busybox_store
    task = _task(tmp_path, ref, "busybox | head -1 > /logs/verifier/seen; test -f /app/a && "
                 "echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n", workdir="/app")
    with open(task / "task.toml", "a") as f:
        f.write('\n[[artifacts]]\nsource = "/app/a"\n')
    with Episode(EpisodeSettings(images=settings, verifier_env="separate")) as ep:
        ep.reset(task)
        ep.exec("touch /app/a")
        result = ep.evaluate()
        assert result.reward == 1.0 and b"BusyBox" in result.files["seen"]


@pytest.mark.slow
def test_prebuilt_image_that_cannot_be_had_fails_before_anything_starts(tmp_path):
    skip_unless_tools("skopeo")
    state = tmp_path / "state"
    settings = EpisodeSettings(state_dir=state, images=ImageSettings(store_dir=tmp_path / "store", source="prebuilt",
                                                                     insecure=["127.0.0.1:9"]))
    # (its Dockerfile's base cannot be had either: else auto would build it)
    task = _task(tmp_path, "127.0.0.1:9/none/such:1", "echo 1 > /logs/verifier/reward.txt\n",
                 dockerfile="FROM 127.0.0.1:9/none/base:1\n")
    with pytest.raises(ImageError, match="127.0.0.1:9/none/such:1"):
        Episode(settings).reset(task)
    assert not state.exists() or not [p for p in state.iterdir() if p.name[0].isdigit()]
    # auto: host mode, with a note naming the image and why
    with Episode(EpisodeSettings(images=ImageSettings(store_dir=tmp_path / "store", source="auto"))) as ep:
        ep.reset(task)
        assert ep.system == {"mode": "host"}
        assert any("127.0.0.1:9/none/such:1 could not be had" in n for n in ep.notes), ep.notes
        assert any("its Dockerfile could not be built" in n and "127.0.0.1:9/none/base:1" in n for n in ep.notes)


def test_process_limit_and_unapplied_limits_are_recorded(tmp_path, busybox_store):
    settings, ref = busybox_store
    task = _task(tmp_path, ref, "echo 1 > /logs/verifier/reward.txt\n", workdir="/app",
                 environment="memory_mb = 512\nstorage_mb = 100\n")
    with Episode(EpisodeSettings(images=settings, max_processes=77)) as ep:
        ep.reset(task)
        assert ep.exec("ulimit -u").stdout.strip() == "77"
        notes = " ".join(ep.notes)
        assert "storage limit of 100 MB" in notes
        # root: the episode's own cgroups hold the memory limit; an ordinary user: a note says not
        assert ("memory limit of 512 MB" in notes) == (os.geteuid() != 0), notes


@pytest.mark.slow
def test_example_on_its_image_from_a_registry_oracle_1_nop_0(tmp_path):
    """The example's image (Python 3.13, which the host's tree may lack) from a loopback
    registry standing in for Docker Hub; its tests/test.sh is TB2's canonical script."""
    skip_unless_tools("skopeo", "umoci", "docker-registry")
    script = (EXAMPLE / "tests" / "test.sh").read_text()
    assert all(line in script.splitlines() for line in TB2_SCRIPT_LINES)
    layout = trixie_image()
    with running_registry(tmp_path / "registry") as registry:
        digest = registry.push(layout, "library/python:3.13-slim-trixie")
        config = tmp_path / "config.toml"
        config.write_text(f'[images]\nstore_dir = "store"\nmirrors = {{ "docker.io" = "{registry.host}" }}\n'
                          f'insecure = ["{registry.host}"]\n')
        for agent, expected in (("oracle", 1.0), ("nop", 0.0)):
            status = main(["run", str(EXAMPLE), "--agent", agent, "--config", str(config), "-o", str(tmp_path / "jobs"),
                           "--job-name", agent, "--image-source", "prebuilt"])
            assert status == 0
            trial = next(p for p in (tmp_path / "jobs" / agent).iterdir() if p.is_dir())
            result = json.loads((trial / "result.json").read_text())
            assert result["verifier_result"]["rewards"]["reward"] == expected, result
            assert result["system"]["mode"] == "image" and result["system"]["digest"] == digest


@pytest.mark.slow
def test_run_with_an_image_that_cannot_be_had_exits_2_before_any_trial(tmp_path, capsys):
    skip_unless_tools("skopeo")
    task = _task(tmp_path, "127.0.0.1:9/none/such:1", "echo 1 > /logs/verifier/reward.txt\n")
    config = tmp_path / "config.toml"
    config.write_text('[images]\nstore_dir = "store"\ninsecure = ["127.0.0.1:9"]\n')
    status = main(["run", str(task), "--agent", "oracle", "--config", str(config), "-o", str(tmp_path / "jobs"),
                   "--image-source", "prebuilt"])
    err = capsys.readouterr().err
    assert status == 2 and "127.0.0.1:9/none/such:1" in err and "Traceback" not in err
    assert not (tmp_path / "jobs").exists() or not any((tmp_path / "jobs").iterdir())


# -- as an ordinary user -----------------------------------------------------------------------

USER_HARNESS = r'''
import json, os, sys
from sequester.environments.local.episode import Episode
from sequester.environments.settings import EpisodeSettings
from sequester.images import ImageSettings, ImageStore
rootfs, task = sys.argv[1], sys.argv[2]
images = ImageSettings(store_dir=os.path.expanduser("~/images"), source="prebuilt")
record = ImageStore(images).import_source(rootfs, "test/busybox:user")
out = {"layer_owner": os.stat(ImageStore(images).layer_dir(record.layers[0].diff_id) / "bin").st_uid,
       "store_mode": oct(os.stat(images.store_dir).st_mode & 0o777)}
for agent in ("oracle", "nop"):
    with Episode(EpisodeSettings(images=images)) as ep:
        ep.reset(task)
        out["system"] = ep.system["mode"]
        if agent == "oracle":
            r = ep.exec("id -u; printf '#!/bin/sh\\necho installed\\n' > /usr/bin/newtool && chmod +x /usr/bin/newtool "
                        "&& newtool; echo done > /app/out.txt")
            out["agent"] = r.stdout.split()
        out[agent] = ep.evaluate().reward
print(json.dumps(out))
'''


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="creating a user needs root (CI runs as root)")
@pytest.mark.skipif(not SYSTEM_PYTHON.exists(), reason="needs /usr/bin/python3 (.ci/run installs it)")
def test_user_episode_on_an_image(user_site, tmp_path):
    """When the host process is an ordinary user: the user imports the image into its own
    store, its agent is root in its view of the image and can install there, and the
    verdicts are right (oracle 1, nop 0)."""
    skip_unless_tools("skopeo")
    entry, home, _, site = user_site
    work = Path(site) / "image-test"
    work.mkdir()
    try:
        subprocess.run(["cp", "-a", f"{busybox_rootfs()}/.", str(work / "rootfs")], check=True)
        task = work / "task"
        for sub in ("tests", "environment", "solution"):
            (task / sub).mkdir(parents=True)
        (task / "instruction.md").write_text("Write done to /app/out.txt.\n")
        (task / "task.toml").write_text('version = "1.0"\n[verifier]\ntimeout_sec = 60\n[environment]\n'
                                        'docker_image = "test/busybox:user"\nworkdir = "/app"\n')
        (task / "environment" / "Dockerfile").write_text("FROM scratch\n")
        (task / "tests" / "test.sh").write_text('grep -q done /app/out.txt && echo 1 > /logs/verifier/reward.txt '
                                                '|| echo 0 > /logs/verifier/reward.txt\n')
        (task / "solution" / "solve.sh").write_text("true\n")
        (work / "harness.py").write_text(USER_HARNESS)
        subprocess.run(["chown", "-R", f"{entry.pw_uid}:{entry.pw_gid}", str(work)], check=True)
        out = run_as_user(user_site, "image-test/harness.py", str(work / "rootfs"), str(task))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(Path(home) / "images", ignore_errors=True)
    assert out["layer_owner"] == entry.pw_uid and out["store_mode"] == "0o700"
    assert out["system"] == "image"
    assert out["agent"] == ["0", "installed"], out  # root in its view of the image; it can install there
    assert out["oracle"] == 1.0 and out["nop"] == 0.0


def test_gpus_from_a_cdi_spec_are_bound_into_an_image_view(tmp_path, busybox_store, monkeypatch):
    """On an image (one overlay at /), a stand-in CDI spec's device node (/dev/null as
    /dev/nvidia0), a library bound read-only, its variable and its symlink; the image has
    no ldconfig, so the update-ldcache hook's failure is a note, not silence."""
    from sequester.sandbox import gpus

    settings, ref = busybox_store
    (tmp_path / "libfake.so.1.0").write_bytes(b"\x7fELF fake driver")
    (tmp_path / "cdi").mkdir()
    (tmp_path / "cdi" / "nvidia.json").write_text(json.dumps({
        "cdiVersion": "0.5.0", "kind": "nvidia.com/gpu",
        "devices": [{"name": "0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0", "hostPath": "/dev/null"}]}}],
        "containerEdits": {
            "env": ["NVIDIA_VISIBLE_DEVICES=void"],
            "mounts": [{"hostPath": str(tmp_path / "libfake.so.1.0"), "containerPath": "/usr/lib/seq-gpu/libfake.so.1.0"}],
            "hooks": [{"hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook",
                       "args": ["nvidia-cdi-hook", "create-symlinks", "--link", "libfake.so.1.0::/usr/lib/seq-gpu/libfake.so"]},
                      {"hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook",
                       "args": ["nvidia-cdi-hook", "update-ldcache", "--folder", "/usr/lib/seq-gpu"]}]}}))
    monkeypatch.setattr(gpus, "CDI_DIRS", (tmp_path / "cdi",))
    task = _task(tmp_path / "task", ref, "echo 1 > /logs/verifier/reward.txt\n", environment="gpus = 1\n")
    with Episode(EpisodeSettings(images=settings)) as ep:
        ep.reset(task)
        assert ep.system["mode"] == "image"
        r = ep.exec("test -c /dev/nvidia0 && echo char; echo $NVIDIA_VISIBLE_DEVICES; readlink /usr/lib/seq-gpu/libfake.so;"
                    " cat /usr/lib/seq-gpu/libfake.so.1.0; echo; echo x >> /usr/lib/seq-gpu/libfake.so.1.0 || echo ro")
        assert r.stdout.split("\n")[:4] == ["char", "void", "libfake.so.1.0", "\x7fELF fake driver"], r
        assert r.stdout.split()[-1] == "ro", r
        assert any("1 GPU from the CDI specification" in n for n in ep.notes), ep.notes
        assert any("ldconfig of the GPU driver's folders failed" in n for n in ep.notes), ep.notes
