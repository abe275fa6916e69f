"""Episodes on an image when the host process is an ordinary user: the user imports the
image into its own store, its agent is root in its view of the image and can install
there, and the verdicts are right (oracle 1, nop 0)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from images import busybox_rootfs
from registry import skip_unless_tools
from test_unprivileged import _run_as_user, user_site  # noqa: F401 - the fixture, reused

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="creating a user needs root (CI runs as root)"),
    pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="needs /usr/bin/python3 (.ci/run installs it)"),
]

HARNESS = r'''
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


def test_user_episode_on_an_image(user_site, tmp_path):  # noqa: F811 - the imported fixture
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
        (work / "harness.py").write_text(HARNESS)
        subprocess.run(["chown", "-R", f"{entry.pw_uid}:{entry.pw_gid}", str(work)], check=True)
        out = _run_as_user(user_site, "image-test/harness.py", str(work / "rootfs"), str(task))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(Path(home) / "images", ignore_errors=True)
    assert out["layer_owner"] == entry.pw_uid and out["store_mode"] == "0o700"
    assert out["system"] == "image"
    assert out["agent"] == ["0", "installed"], out  # root in its view of the image; it can install there
    assert out["oracle"] == 1.0 and out["nop"] == 0.0
