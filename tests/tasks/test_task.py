"""Task loading (:mod:`sequester.tasks.task`; the Terminal-Bench 2 / Harbor layout): a task
folder read into a Task, its optional parts, every error naming the file, and the folder
left byte-identical."""

import hashlib
import os
from pathlib import Path

import pytest
from task_folders import DOCKERFILE, hello_task

from sequester.errors import TaskError
from sequester.tasks import Task, find_tasks, load_task, resolve_copies


def test_load_task(tmp_path):
    task = load_task(hello_task(tmp_path))
    assert isinstance(task, Task)
    assert task.name == "hello" and task.path == tmp_path / "hello"
    assert task.instruction == "Write hello.txt.\n"
    assert task.config.environment.memory_mb == 2048
    assert task.dockerfile is not None and task.dockerfile.base_image == "python:3.12-slim"
    assert task.dockerfile.source == str(tmp_path / "hello" / "environment" / "Dockerfile")
    assert task.default_workdir == "/app"
    assert task.tests_dir == tmp_path / "hello" / "tests"
    assert task.test_script == tmp_path / "hello" / "tests" / "test.sh"
    assert task.test_files == (tmp_path / "hello" / "tests" / "test_outputs.py",)
    assert task.environment_dir == tmp_path / "hello" / "environment"
    assert task.solution_dir == tmp_path / "hello" / "solution" and task.has_solution
    assert resolve_copies(task.dockerfile, task.environment_dir) == [
        (task.environment_dir / "app.py", "/app/app.py")]


def test_optional_parts(tmp_path):
    path = hello_task(tmp_path, **{"environment/Dockerfile": None, "environment/app.py": None,
                                  "solution/solve.sh": None, "tests/test.sh": None})
    task = load_task(path)
    assert task.dockerfile is None and task.default_workdir is None
    assert task.test_script is None and not task.has_solution
    assert load_task(hello_task(tmp_path, "only-sh", **{"tests/test_outputs.py": None})).test_script is not None


@pytest.mark.parametrize("overrides, message", [
    ({"instruction.md": None}, "hello/instruction.md: missing"),
    ({"instruction.md": "  \n"}, "hello/instruction.md: empty"),
    ({"task.toml": None}, "hello/task.toml: missing"),
    ({"task.toml": "[verifier]\ntimeout_sec = 'abc'\n"}, "hello/task.toml: [verifier] timeout_sec: 'abc'"),
    ({"tests/test.sh": None, "tests/test_outputs.py": None}, "hello/tests: missing"),
    ({"tests/test.sh": None, "tests/test_outputs.py": None, "tests/helper.py": ""},
     "hello/tests: has neither test.sh nor a test_*.py file"),
    ({"environment/Dockerfile": "FROM x\nCOPY\n"}, "hello/environment/Dockerfile:2: COPY: needs"),
])
def test_load_task_errors_name_the_file(tmp_path, overrides, message):
    path = hello_task(tmp_path, **overrides)
    with pytest.raises(TaskError) as err:
        load_task(path)
    assert str(err.value).startswith(str(tmp_path / message))


def test_load_task_refuses_non_utf8_and_files_outside_the_task(tmp_path):
    path = hello_task(tmp_path)
    (path / "instruction.md").write_bytes(b"caf\xe9\n")
    with pytest.raises(TaskError, match=r"instruction.md: not UTF-8 text"):
        load_task(path)
    (tmp_path / "secret").write_text("host secret\n")
    (path / "instruction.md").unlink()
    (path / "instruction.md").symlink_to(tmp_path / "secret")
    with pytest.raises(TaskError, match=r"hello/instruction.md: resolves to .*secret, outside the task directory"):
        load_task(path)
    with pytest.raises(TaskError, match=r"nowhere: does not exist"):
        load_task(tmp_path / "nowhere")


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under root: kind, mode, size, mtime and a content hash (files) or target (links)."""
    out = {}
    for folder, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(folder) / name
            st = path.lstat()
            if path.is_symlink():
                detail = os.readlink(path)
            elif path.is_file():
                detail = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                detail = sorted(os.listdir(path))
            out[str(path.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns, detail)
    return out


def test_loading_leaves_the_task_directory_byte_identical(tmp_path):
    suite = tmp_path / "suite"
    path = hello_task(suite, **{"environment/Dockerfile": DOCKERFILE + "COPY . /src/\nRUN make\n",
                               "environment/data/blob.bin": "\x00\x01binary"})
    (path / "environment" / "alias.py").symlink_to("app.py")
    hello_task(suite, "second")
    before = snapshot(tmp_path)
    task = load_task(path)
    find_tasks([suite])
    resolve_copies(task.dockerfile, task.environment_dir)
    assert (task.test_script, task.has_solution, task.test_files) != (None, False, ())
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("name", ["docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml"])
def test_a_compose_file_is_found_by_the_names_compose_reads(tmp_path, name):
    task = load_task(hello_task(tmp_path))
    assert task.compose_file is None
    (task.environment_dir / name).write_text("services: {}\n")
    assert task.compose_file == task.environment_dir / name
