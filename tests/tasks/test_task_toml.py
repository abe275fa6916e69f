"""task.toml (:mod:`sequester.tasks.task_toml`, pure): both schemas, their defaults and
sizes, network modes, and every error naming the file and the field."""

import pytest
from task_folders import OLD_SCHEMA

from sequester.errors import SequesterError, TaskError
from sequester.tasks import TaskConfig, parse_task_config
from sequester.tasks.task_toml import EnvironmentConfig

NEW_SCHEMA = """
schema_version = "1.1"

[verifier]
timeout_sec = 90
env = { API_URL = "http://127.0.0.1:8000" }

[environment]
docker_image = "python:3.12-slim"
memory_mb = 4096
storage_mb = 512
workdir = "/app"
network_mode = "allowlist"
allowed_hosts = ["pypi.org", "files.pythonhosted.org"]
"""


def test_old_schema_is_normalised():
    config = parse_task_config(OLD_SCHEMA, "task.toml")
    assert isinstance(config, TaskConfig)
    assert config.schema_version == "1.0"
    assert config.verifier.timeout_sec == 120.0 and config.verifier.env == {}
    assert config.agent.timeout_sec == 300.0
    env = config.environment
    assert (env.cpus, env.memory_mb, env.storage_mb) == (2.0, 2048, 10240)
    assert env.allow_internet is False and env.network_mode is None
    assert env.effective_network_mode == "no-network"
    assert config.metadata == {"author_name": "Ada", "difficulty": "easy", "tags": ["files"]}


def test_new_schema():
    config = parse_task_config(NEW_SCHEMA, "task.toml")
    assert config.schema_version == "1.1"
    assert config.verifier.timeout_sec == 90.0
    assert config.verifier.env == {"API_URL": "http://127.0.0.1:8000"}
    env = config.environment
    assert env.docker_image == "python:3.12-slim"
    assert (env.memory_mb, env.storage_mb, env.workdir) == (4096, 512, "/app")
    assert env.effective_network_mode == "allowlist"
    assert env.allowed_hosts == ("pypi.org", "files.pythonhosted.org")


def test_defaults_for_an_empty_file():
    config = parse_task_config("", "task.toml")
    assert config.verifier.timeout_sec == 600.0
    assert config.agent.timeout_sec is None
    assert config.environment == EnvironmentConfig()
    assert config.environment.effective_network_mode == "public"
    assert config.metadata == {} and config.schema_version is None


@pytest.mark.parametrize("text, mb", [("2G", 2048), ("512M", 512), ("1024K", 1), ("512K", 1), ("1.5G", 1536),
                                      ("2GB", 2048), ("2gi", 2048), (" 1T ", 1024 * 1024)])
def test_memory_strings(text, mb):
    config = parse_task_config(f'[environment]\nmemory = "{text}"', "task.toml")
    assert config.environment.memory_mb == mb


def test_old_and_new_size_keys_may_both_be_given_if_they_agree():
    config = parse_task_config('[environment]\nmemory = "1G"\nmemory_mb = 1024', "task.toml")
    assert config.environment.memory_mb == 1024


@pytest.mark.parametrize("environment, mode", [
    ("", "public"),
    ("allow_internet = true", "public"),
    ("allow_internet = false", "no-network"),
    ('network_mode = "no-network"', "no-network"),
    ('allow_internet = true\nnetwork_mode = "no-network"', "no-network"),
    ('allow_internet = false\nnetwork_mode = "allowlist"', "allowlist"),
    ('network_mode = "allowlist"', "allowlist"),
    ('network_mode = "public"', "public"),
])
def test_network_mode_resolution(environment, mode):
    config = parse_task_config(f"[environment]\n{environment}", "task.toml")
    assert config.environment.effective_network_mode == mode


@pytest.mark.parametrize("text, message", [
    ('[verifier]\ntimeout_sec = "abc"', "task.toml: [verifier] timeout_sec: 'abc' is not a positive number"),
    ("[verifier]\ntimeout_sec = 0", "task.toml: [verifier] timeout_sec: 0 is not a positive number"),
    ("[verifier]\ntimeout_sec = -5.0", "task.toml: [verifier] timeout_sec: -5.0 is not a positive number"),
    ("[verifier]\ntimeout_sec = true", "task.toml: [verifier] timeout_sec: True is not a positive number"),
    ("[verifier]\ntimeout_sec = nan", "task.toml: [verifier] timeout_sec: nan is not a positive number"),
    ("[verifier]\nenv = { A = 1 }", "task.toml: [verifier] env.A: 1 is not a string"),
    ('[verifier]\nenv = "A=1"', "task.toml: [verifier] env: 'A=1' is not a table"),
    ("[agent]\ntimeout_sec = -1", "task.toml: [agent] timeout_sec: -1 is not a positive number"),
    ('[environment]\nmemory = "lots"', "task.toml: [environment] memory: 'lots' is not a size"),
    ('[environment]\nmemory = "2048"', "task.toml: [environment] memory: '2048' is not a size"),
    ("[environment]\nmemory = 2048", "task.toml: [environment] memory: 2048 is not a size"),
    ('[environment]\nmemory = "0G"', "task.toml: [environment] memory: '0G' is not a positive size"),
    ('[environment]\nstorage = "ten gigs"', "task.toml: [environment] storage: 'ten gigs' is not a size"),
    ('[environment]\nmemory_mb = "2G"', "task.toml: [environment] memory_mb: '2G' is not a positive whole number"),
    ("[environment]\nmemory_mb = 1.5", "task.toml: [environment] memory_mb: 1.5 is not a positive whole number"),
    ("[environment]\nstorage_mb = 0", "task.toml: [environment] storage_mb: 0 is not a positive whole number"),
    ('[environment]\nmemory = "1G"\nmemory_mb = 512',
     "task.toml: [environment] memory = '1G' and memory_mb = 512 disagree"),
    ('[environment]\ncpus = "2"', "task.toml: [environment] cpus: '2' is not a positive number"),
    ('[environment]\ndocker_image = 3', "task.toml: [environment] docker_image: 3 is not an image name"),
    ('[environment]\nworkdir = "app"', "task.toml: [environment] workdir: 'app' is not an absolute path"),
    ('[environment]\nallow_internet = "yes"', "task.toml: [environment] allow_internet: 'yes' is not true or false"),
    ('[environment]\nnetwork_mode = "open"', "task.toml: [environment] network_mode: 'open' is not one of"),
    ('[environment]\nnetwork_mode = "public"\nallowed_hosts = ["a.com"]',
     "task.toml: [environment] allowed_hosts: only allowed with network_mode = 'allowlist'"),
    ('[environment]\nallowed_hosts = ["a.com"]', "task.toml: [environment] allowed_hosts: only allowed"),
    ('[environment]\nnetwork_mode = "allowlist"\nallowed_hosts = "a.com"',
     "task.toml: [environment] allowed_hosts: 'a.com' is not a list"),
    ('[environment]\nnetwork_mode = "allowlist"\nallowed_hosts = ["a b"]',
     "task.toml: [environment] allowed_hosts[0]: 'a b' is not a host name"),
    ('[environment]\nallow_internet = false\nnetwork_mode = "public"',
     "task.toml: [environment] network_mode: 'public' contradicts allow_internet = false"),
    ("verifier = 3", "task.toml: [verifier]: 3 is not a table"),
    ("metadata = []", "task.toml: [metadata]: [] is not a table"),
    ("version = 1", "task.toml: version: 1 is not a string"),
    ('version = "1.0"\nschema_version = "2.0"', "task.toml: version = '1.0' and schema_version = '2.0' disagree"),
])
def test_config_errors_name_the_file_and_field(text, message):
    with pytest.raises(TaskError) as err:
        parse_task_config(text, "task.toml")
    assert str(err.value).startswith(message)


def test_invalid_toml_names_the_file_and_the_parser_message():
    with pytest.raises(TaskError, match=r"^/x/hello/task.toml: not valid TOML: .*line 2") as err:
        parse_task_config("[verifier]\ntimeout_sec = = 3\n", "/x/hello/task.toml")
    assert isinstance(err.value, SequesterError) and isinstance(err.value, ValueError)


def test_gpus_and_their_types_are_read_and_checked():
    env = parse_task_config('[environment]\ngpus = 2\ngpu_types = ["H100", "A100"]\n', "t").environment
    assert (env.gpus, env.gpu_types) == (2, ("H100", "A100"))
    assert parse_task_config("", "t").environment.gpus == 0
    for bad in ("gpus = -1", "gpus = 1.5", "gpus = true", 'gpus = "1"'):
        with pytest.raises(TaskError, match="gpus"):
            parse_task_config(f"[environment]\n{bad}\n", "t")
    with pytest.raises(TaskError, match="gpu_types"):
        parse_task_config('[environment]\ngpu_types = "H100"\n', "t")
