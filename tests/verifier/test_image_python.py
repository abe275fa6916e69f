"""The tests' ``python3`` is the image's version, finding the image's packages after the
runner's own (:mod:`sequester.verifier.image_python`, :mod:`sequester.verifier.pysite`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from images import is_root, trixie_image
from registry import running_registry, skip_unless_tools
from tasks import make_task

from sequester.cli import main
from sequester.verifier.image_python import ImagePython, image_python


def test_the_official_images_python_first_then_the_distributions():
    def kinds(present: set[str]):
        return lambda path: "other" if path in present else "none"

    official = image_python(kinds({"/usr/local/bin/python3.13", "/usr/bin/python3.11"}), ["3.11", "3.13"])
    assert official == ImagePython("3.13", ("/usr/local/lib/python3.13/site-packages",), "/usr/local/bin/python3.13")
    debian = image_python(kinds({"/usr/bin/python3.11"}), ["3.11", "3.13"])
    assert debian is not None and debian.version == "3.11"
    assert debian.site == ("/usr/local/lib/python3.11/dist-packages", "/usr/lib/python3/dist-packages",
                           "/usr/lib/python3.11/dist-packages")
    assert image_python(kinds({"/usr/bin/python3.12"}), ["3.11", "3.13"]) is None  # a version the runner lacks
    assert image_python(kinds(set()), ["3.13"]) is None


_TESTS = '''
import importlib.util


def test_the_images_package_is_found():
    import imagemod  # installed in the image's site folder, not the runner's
    assert imagemod.ANSWER == 42


def test_a_module_nobody_has_is_none_to_find_spec():
    # transformers asks this of PIL (a name the runner's own code tries): None, not an exception
    assert importlib.util.find_spec("PIL") is None


def test_the_answer():
    assert open("/app/answer.txt").read().strip() == "42"
'''

_DOCKERFILE = (
    "FROM debian:13.0-slim\nWORKDIR /app\n"
    "RUN mkdir -p /usr/local/lib/python3.13/dist-packages"
    " && echo 'ANSWER = 42' > /usr/local/lib/python3.13/dist-packages/imagemod.py\n"
)


@pytest.fixture(scope="module")
def image_job(tmp_path_factory):
    skip_unless_tools("skopeo", "umoci", "docker-registry")
    if not is_root():
        pytest.skip("the Debian base image is made from the trixie rootfs, which needs root to pack")
    tmp = tmp_path_factory.mktemp("image-python")
    task = make_task(tmp, "image-python", "python3 -m pytest /tests/test_outputs.py -rA"
                     " && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n",
                     dockerfile=_DOCKERFILE, files={"tests/test_outputs.py": _TESTS,
                                                    "solution/solve.sh": "echo 42 > /app/answer.txt\n"})
    with running_registry(tmp / "registry") as registry:
        registry.push(trixie_image(), "library/debian:13.0-slim")
        config = tmp / "config.toml"
        config.write_text(f'[images]\nstore_dir = "store"\nbuild_network = "none"\n'
                          f'mirrors = {{ "docker.io" = "{registry.host}" }}\ninsecure = ["{registry.host}"]\n')
        runs = iter(range(1000))

        def run(agent: str) -> dict:
            name = f"job-{next(runs)}"
            assert main(["run", str(task), "--agent", agent, "--config", str(config), "-o", str(tmp / "jobs"),
                         "--job-name", name, "--image-source", "dockerfile", "--calibration", "off"]) in (0, 1)
            trial = next(p for p in (tmp / "jobs" / name).iterdir() if (p / "result.json").exists())
            return json.loads((trial / "result.json").read_text())

        yield run


def _reward(result: dict) -> float | None:
    return ((result.get("verifier_result") or {}).get("rewards") or {}).get("reward")


@pytest.mark.slow
def test_python3_finds_the_images_packages(image_job):
    oracle = image_job("oracle")
    assert _reward(oracle) == 1.0, oracle.get("exception_info")
    assert any("the tests' python3 is the verifier's Python 3.13" in note for note in oracle["notes"])
    assert any("imagemod" in note for note in oracle["notes"])  # an import from the agent's folders, named
    assert _reward(image_job("nop")) == 0.0


@pytest.mark.slow
def test_a_pth_file_of_the_agents_runs_no_code(image_job, tmp_path):
    """Attack: a ``.pth`` in the image's site folder whose import line ends the runner's
    Python with status 0 at start-up, before pytest (the image's own Python runs it)."""
    agent = tmp_path / "pth.sh"
    agent.write_text("echo 'import os; os._exit(0)' > /usr/local/lib/python3.13/dist-packages/zz-exit.pth\n")
    result = image_job(f"script:{agent}")
    assert _reward(result) == 0.0
    assert any("zz-exit.pth" in note for note in result["notes"])
