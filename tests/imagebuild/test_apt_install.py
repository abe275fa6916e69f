"""The tests' ``apt-get install`` (:mod:`sequester.imagebuild.apt_install`): installed ahead
on the task's pristine image with the image's own apt, packed, and unpacked by the runner's
``apt-get`` when the script asks; never the agent's apt, sources or tools.

The example ``examples/build-tasks/apt-in-tests`` installs ``bc`` in its test.sh and ``dc``
from a script its Python tests write, on a Debian base served by a real registry on
loopback; the packages come from Debian's package index through the build proxy.
"""

from __future__ import annotations

import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest
from images import is_root, trixie_image
from paths import BUILD_TASKS
from registry import running_registry, skip_unless_tools

from sequester.cli import main
from sequester.imagebuild.apt_install import install_dockerfile, install_key, kept, pack_layer
from sequester.sandbox.idmap import IdMap
from sequester.verifier.apt_pins import AptRequest

EXAMPLE = BUILD_TASKS / "apt-in-tests"


def test_the_install_step_uses_the_images_own_apt_as_root():
    text = install_dockerfile("localhost/x:1", AptRequest(("gcc", "expect"), (), True, True))
    assert text.splitlines() == [
        "FROM localhost/x:1",
        "USER root",
        "RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends --reinstall "
        "gcc expect",
    ]


def test_the_key_names_image_packages_and_flags():
    one = install_key("sha256:a", AptRequest(("gcc", "git")))
    assert one == install_key("sha256:a", AptRequest(("git", "gcc")))
    assert len({one, install_key("sha256:b", AptRequest(("gcc", "git"))), install_key("sha256:a", AptRequest(("gcc",))),
                install_key("sha256:a", AptRequest(("gcc", "git"), (), True))}) == 4


def test_bookkeeping_is_left_out():
    for rel in ("var/lib/apt/lists/x", "var/cache/apt/a.bin", "var/log/dpkg.log", "var/lib/dpkg/status",
                "tmp/x", "root/.bashrc", "etc/ld.so.cache", "run/lock"):
        assert not kept(rel), rel
    for rel in ("usr/bin/gcc", "var/lib/dpkg/info/gcc.list", "etc/alternatives/vim", "usr/lib/x/libz.so.1"):
        assert kept(rel), rel


def test_pack_keeps_files_links_and_modes_and_maps_owners(tmp_path):
    layer = tmp_path / "layer"
    (layer / "usr" / "bin").mkdir(parents=True)
    (layer / "usr" / "lib").mkdir()
    (layer / "var" / "lib" / "apt" / "lists").mkdir(parents=True)
    (layer / "usr" / "bin" / "tool").write_text("#!/bin/sh\necho real\n")
    os.chmod(layer / "usr" / "bin" / "tool", 0o755)
    os.symlink("tool", layer / "usr" / "bin" / "alias")
    os.link(layer / "usr" / "bin" / "tool", layer / "usr" / "bin" / "hard")
    (layer / "var" / "lib" / "apt" / "lists" / "index").write_text("x")
    out = tmp_path / "out.tar"
    ids = IdMap(os.getuid(), os.getgid(), 200000, 200000)
    if is_root():  # an owner of the subordinate range is the same inside id in the tar
        os.chown(layer / "usr" / "bin" / "alias", 200005, 200007, follow_symlinks=False)
    count, libraries = pack_layer(layer, out, ids)
    assert not libraries
    with tarfile.open(out) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert "var/lib/apt/lists/index" not in members and "var/lib/apt" in members
    assert members["usr/bin/tool"].mode & 0o777 == 0o755 and members["usr/bin/tool"].uid == 0
    assert members["usr/bin/alias"].issym() and members["usr/bin/alias"].linkname == "tool"
    if is_root():
        assert (members["usr/bin/alias"].uid, members["usr/bin/alias"].gid) == (6, 8)  # (sub_uid is inside id 1)
    assert {members["usr/bin/hard"].islnk(), members["usr/bin/tool"].islnk()} == {True, False}  # one file, twice
    assert count == len(members)
    (layer / "usr" / "lib" / "libx.so.1").write_text("")
    assert pack_layer(layer, out, None)[1]


@pytest.fixture(scope="module")
def apt_job(tmp_path_factory):
    """The example's image built on a Debian base from a loopback registry; yields a runner
    of ``sequester run`` on a copy of the example (``test_sh``: another test script)."""
    skip_unless_tools("skopeo", "umoci", "docker-registry")
    if not is_root():
        pytest.skip("the Debian base image is made from the trixie rootfs, which needs root to pack")
    tmp = tmp_path_factory.mktemp("apt")
    with running_registry(tmp / "registry") as registry:
        registry.push(trixie_image(), "library/debian:13.0-slim")
        config = tmp / "config.toml"
        config.write_text(f'[images]\nstore_dir = "store"\nmirrors = {{ "docker.io" = "{registry.host}" }}\n'
                          f'insecure = ["{registry.host}"]\n'
                          f'[episodes]\ntoolchain_dir = "{tmp / "toolchain"}"\n')
        runs = iter(range(1000))

        def run(agent: str, *, test_sh: str | None = None) -> dict:
            task = EXAMPLE
            if test_sh is not None:
                task = tmp / f"task-{next(runs)}" / "apt-in-tests"
                shutil.copytree(EXAMPLE, task)
                (task / "tests" / "test.sh").write_text(test_sh)
            name = f"job-{next(runs)}"
            assert main(["run", str(task), "--agent", agent, "--config", str(config), "-o", str(tmp / "jobs"),
                         "--job-name", name, "--image-source", "dockerfile", "--calibration", "off"]) in (0, 1)
            job = tmp / "jobs" / name
            trial = next(p for p in job.iterdir() if p.is_dir() and (p / "result.json").exists())
            return json.loads((trial / "result.json").read_text())

        yield run, tmp


def _reward(result: dict) -> float | None:
    return ((result.get("verifier_result") or {}).get("rewards") or {}).get("reward")


@pytest.mark.slow
def test_tests_that_apt_get_install_pass_for_the_oracle_and_fail_for_nop(apt_job):
    run, tmp = apt_job
    assert _reward(run("oracle")) == 1.0
    assert _reward(run("nop")) == 0.0
    records = [json.loads(p.read_text()) for p in (tmp / "toolchain" / "task-installs").glob("*.json")]
    assert [r["packages"] for r in records] == [["bc", "dc"]]  # test.sh's and the written script's


@pytest.mark.slow
def test_an_agent_that_breaks_apt_changes_nothing(apt_job, tmp_path):
    """Attack: the agent's apt, sources and proxy are what the tests' apt-get would use under
    Docker; breaking them must not turn the agent's work into an error (nor a pass): the
    packages come from the pristine image's apt, ahead."""
    run, _ = apt_job
    agent = tmp_path / "break-apt.sh"
    agent.write_text(
        "rm -f /usr/bin/apt-get /usr/bin/apt /usr/bin/dpkg\n"
        "echo 'deb http://127.0.0.1:9/debian trixie main' > /etc/apt/sources.list.d/evil.list\n"
        "echo 'Acquire::http::Proxy \"http://127.0.0.1:9\";' > /etc/apt/apt.conf.d/99evil\n"
        "echo 42 > /app/answer.txt\n"
    )
    result = run(f"script:{agent}")
    assert _reward(result) == 1.0, result.get("exception_info")


@pytest.mark.slow
def test_a_tool_the_agent_planted_is_replaced_by_the_install(apt_job, tmp_path):
    """Attack: a fake ``bc`` (and ``dc``) agreeing with a wrong answer. The tests' install
    writes the real ones over them, as apt-get in the container would."""
    run, _ = apt_job
    agent = tmp_path / "fake-bc.sh"
    agent.write_text(
        "printf '#!/bin/sh\\necho 41\\n' > /usr/bin/bc; chmod +x /usr/bin/bc\n"
        "printf '#!/bin/sh\\necho 41\\n' > /usr/bin/dc; chmod +x /usr/bin/dc\n"
        "echo 41 > /app/answer.txt\n"
    )
    assert _reward(run(f"script:{agent}")) == 0.0


@pytest.mark.slow
def test_a_package_that_cannot_be_installed_is_an_error_never_a_zero(apt_job):
    run, _ = apt_job
    script = (EXAMPLE / "tests" / "test.sh").read_text().replace("curl bc", "curl bc sequester-no-such-package")
    result = run("oracle", test_sh=script)
    assert _reward(result) is None
    assert result["exception_info"]["sequester_exception_type"] in ("BootstrapFailed", "VerifierCouldNotRun")
    assert "set-up failed" in result["exception_info"]["exception_message"]
    assert any("sequester-no-such-package" in note and "could not be prepared" in note for note in result["notes"])
