"""Finding tasks (:mod:`sequester.tasks.finder`): one task or a folder of them, and every
error naming the folder."""

import pytest
from task_folders import hello_task

from sequester.errors import TaskError
from sequester.tasks import find_tasks


def test_find_tasks_single_task_and_folder_of_tasks(tmp_path):
    suite = tmp_path / "suite"
    for name in ("zeta", "alpha", "mid"):
        hello_task(suite, name)
    (suite / ".git").mkdir()
    (suite / "README.md").write_text("not a task")
    single = hello_task(tmp_path / "extra", "solo")
    tasks = find_tasks([suite, single])
    assert [t.name for t in tasks] == ["alpha", "mid", "zeta", "solo"]
    assert [t.name for t in find_tasks([str(single)])] == ["solo"]


def test_find_tasks_errors(tmp_path):
    hello_task(tmp_path / "a", "same")
    hello_task(tmp_path / "b", "same")
    with pytest.raises(TaskError, match=r"b/same: duplicate task name 'same' \(also .*a/same\)"):
        find_tasks([tmp_path / "a", tmp_path / "b"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(TaskError, match=r"empty: neither a task \(no task.toml\) nor a folder of tasks"):
        find_tasks([tmp_path / "empty"])
    with pytest.raises(TaskError, match=r"missing: does not exist"):
        find_tasks([tmp_path / "missing"])
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(TaskError, match=r"file.txt: not a directory"):
        find_tasks([tmp_path / "file.txt"])
    broken = hello_task(tmp_path, "no-toml", **{"task.toml": None})
    with pytest.raises(TaskError, match=r"no-toml/task.toml: missing"):
        find_tasks([broken])
    hello_task(tmp_path / "mixed", "good")
    (tmp_path / "mixed" / "broken").mkdir()
    with pytest.raises(TaskError, match=r"mixed/broken/task.toml: missing"):
        find_tasks([tmp_path / "mixed"])


def test_a_task_id_names_a_task_inside_the_tasks_folder_only(tmp_path):
    """The rule of the server and the episode pool (resolve_task_id): by name, then by real path."""
    from sequester.errors import PolicyError
    from sequester.tasks.finder import resolve_task_id

    root = (tmp_path / "tasks").resolve()
    hello_task(root, "one")
    hello_task(root / "group", "two")
    hello_task(tmp_path, "outside")
    (root / "out").symlink_to(tmp_path / "outside")
    (root / "loop").symlink_to(root)
    assert resolve_task_id(root, "one") == root / "one"
    assert resolve_task_id(root, "one/") == root / "one"
    assert resolve_task_id(root, "group/two") == root / "group" / "two"
    for task_id, said in (
        ("/etc", "absolute path"),
        (str(root / "one"), "absolute path"),
        ("..\\x", "absolute path"),
        ("../outside", "'..'"),
        ("one/../../outside", "'..'"),
        (".hidden", "hidden"),
        ("", "empty"),
        ("out", "outside the tasks folder"),
        ("loop", "outside the tasks folder"),
        ("group", "no task 'group'"),
        ("no-such", "no task 'no-such'"),
    ):
        with pytest.raises(PolicyError, match=f"^data.task: .*{said}"):
            resolve_task_id(root, task_id, "data.task")
