"""The configuration file (:mod:`sequester.config`): the policy's tables and every other one
checked by one schema, each bad key or value named, relative paths taken from the file,
and the default configuration the package embeds."""

import pytest
from paths import REPO

from sequester import Endpoint, Isolation, Limits, PolicyError, load_policy


def test_default_config_is_auto_and_loads_from_the_package():
    embedded = load_policy(None)
    assert embedded.isolation is Isolation.AUTO
    assert embedded == load_policy(REPO / "configs" / "default.toml")
    # The defaults in the file are the library's defaults (one source of truth for limits).
    assert embedded.limits == Limits()


def write(tmp_path, text):
    path = tmp_path / "policy.toml"
    path.write_text(text)
    return path


def test_unknown_key_is_named(tmp_path):
    with pytest.raises(PolicyError, match="runtime.isolaton"):
        load_policy(write(tmp_path, "[runtime]\nisolaton = true\n"))
    with pytest.raises(PolicyError, match="limits.memory"):
        load_policy(write(tmp_path, "[limits]\nmemory = 5\n"))
    with pytest.raises(PolicyError, match="'network'"):
        load_policy(write(tmp_path, "[network]\n"))


def test_missing_path_is_named(tmp_path):
    with pytest.raises(PolicyError, match=r"runtime.readonly.*does not exist"):
        load_policy(write(tmp_path, '[runtime]\nreadonly = ["nope"]\n'))
    with pytest.raises(PolicyError, match=r"hide.*does not exist"):
        load_policy(write(tmp_path, '[runtime]\nisolation = {hide = ["/no/such/dir"]}\n'))


def test_bad_allow_entry_is_named(tmp_path):
    with pytest.raises(PolicyError, match=r"runtime.allow\[1\].*'example.com'"):
        load_policy(write(tmp_path, '[runtime]\nallow = ["127.0.0.1:80", "example.com"]\n'))


def test_bad_limits_and_env(tmp_path):
    with pytest.raises(PolicyError, match="limits.max_threads"):
        load_policy(write(tmp_path, "[limits]\nmax_threads = 0\n"))
    with pytest.raises(PolicyError, match="limits.memory_mb"):
        load_policy(write(tmp_path, "[limits]\nmemory_mb = 1.5\n"))
    with pytest.raises(PolicyError, match=r"runtime.env\[0\]"):
        load_policy(write(tmp_path, '[runtime]\nenv = ["NOT A NAME"]\n'))


def test_relative_paths_are_taken_from_the_file(tmp_path):
    (tmp_path / "src").mkdir()
    policy = load_policy(write(tmp_path, '[runtime]\nreadonly = ["src"]\nallow = ["https://api.example.com"]\n'))
    assert policy.readonly == ((tmp_path / "src").resolve(),)
    assert policy.allow == (Endpoint("api.example.com", 443),)


def test_invalid_toml(tmp_path):
    with pytest.raises(PolicyError, match="not valid TOML"):
        load_policy(write(tmp_path, "[runtime\n"))


@pytest.mark.parametrize("text, named", [
    ("[episode]\nexec_timeout = 5\n", "unknown table 'episode'"),          # a typo'd table
    ("isolation = true\n", "unknown key 'isolation'"),                      # a key outside every table
    ("[runtime]\nisolaton = true\n", "runtime.isolaton"),
    ("[limits]\nmemory = 5\n", "limits.memory"),
    ("[episodes]\nexec_timout = 5\n", "episodes.exec_timout"),
    ("[episodes]\nexec_timeout = 'long'\n", "episodes.exec_timeout"),
    ("[episodes]\nverifier_env = 'both'\n", "episodes.verifier_env"),
    ("episodes = 3\n", "'episodes' must be a table"),
    ("runtime = 3\n", "'runtime' must be a table"),
])
def test_every_table_is_checked_by_one_schema(tmp_path, text, named):
    from sequester.config import load_config

    path = write(tmp_path, text)
    for load in (load_config, load_policy):  # the library's load_policy checks [episodes] too
        with pytest.raises(PolicyError) as err:
            load(path)
        assert named in str(err.value) and str(path) in str(err.value)


def test_a_whole_config_loads(tmp_path):
    from sequester.config import load_config

    config = load_config(write(tmp_path, "[runtime]\nisolation = 'auto'\n[limits]\nmemory_mb = 512\n"
                                         "[episodes]\nexec_timeout = 7\nstate_dir = 'state'\n"))
    assert config.policy.limits.memory_mb == 512 and config.policy.isolation is Isolation.AUTO
    assert config.episodes.exec_timeout == 7 and config.episodes.state_dir == tmp_path.resolve() / "state"
    assert load_config(None).policy == load_policy(None)
