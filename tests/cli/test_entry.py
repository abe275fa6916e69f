"""The ``sequester`` command as a whole (:mod:`sequester.cli.entry`), run as a real process:
its version and help, and the whole configuration checked by every command."""

import pytest
from command import sequester
from paths import EXAMPLES

import sequester as sequester_package

TASK = EXAMPLES / "python-csv-stats"


def test_version_and_a_plain_help():
    r = sequester("--version")
    assert (r.returncode, r.stdout.strip()) == (0, f"sequester {sequester_package.__version__}")
    from importlib.metadata import version

    assert sequester_package.__version__ == version("sequester")  # one version: the package's metadata
    r = sequester("--help")
    assert r.returncode == 0 and "``" not in r.stdout and ":mod:" not in r.stdout
    for status in ("0 success", "1 the program failed", "2 bad input", "3 sequester could not run", "130 interrupted"):
        assert status in " ".join(r.stdout.split())  # every exit status, whatever the line breaks


@pytest.mark.slow
@pytest.mark.parametrize("text, named", [
    ("[episode]\nexec_timeout = 5\n", "unknown table 'episode'"),
    ("[episodes]\nexec_timout = 5\n", "episodes.exec_timout"),
    ("[limits]\nmemory = 5\n", "limits.memory"),
    ("[runtime]\nisolaton = true\n", "runtime.isolaton"),
])
def test_every_command_checks_the_whole_config(tmp_path, text, named):
    config = tmp_path / "c.toml"
    config.write_text(text)
    for argv in (["exec", "-"], ["check"], ["run", str(TASK), "--agent", "nop", "-o", str(tmp_path / "jobs")]):
        r = sequester(argv[0], "--config", str(config), *argv[1:], stdin="print(1)\n")
        assert r.returncode == 2 and named in r.stderr and "Traceback" not in r.stderr, (argv, r.stderr)
    assert not (tmp_path / "jobs").exists()
