"""A Dockerfile's copies mapped to files of its build context
(:mod:`sequester.tasks.context`): Docker's rules, and sources outside the context, links
out of it, archives and special files refused."""

import io
import os
import tarfile

import pytest
from task_folders import make_files

from sequester.errors import TaskError
from sequester.tasks import parse_dockerfile, resolve_copies


@pytest.fixture
def context(tmp_path):
    ctx = tmp_path / "environment"
    make_files(ctx, {"Dockerfile": "FROM x\n", "a.txt": "a", "b.txt": "b", "src/main.py": "m",
                     "src/pkg/__init__.py": "", "src/pkg/mod.py": "x"})
    (ctx / "src" / "empty").mkdir()
    return ctx


def resolved(text, ctx):
    return [(str(host.relative_to(ctx.resolve())), dest)
            for host, dest in resolve_copies(parse_dockerfile(text, "Dockerfile"), ctx)]


def test_resolve_copies_follows_dockers_rules(context):
    pairs = resolved(
        "FROM x\n"
        "WORKDIR /app\n"
        "COPY a.txt .\n"              # into the working directory
        "COPY a.txt /etc/conf\n"      # a single file becomes the destination
        "COPY src /app/code\n"        # a directory: its contents
        "COPY *.txt /data\n"          # a wildcard matching several files: a directory
        "COPY src/pkg/m?d.py b.txt /lib/\n",
        context,
    )
    assert pairs == [
        ("a.txt", "/app/a.txt"),
        ("a.txt", "/etc/conf"),
        ("src", "/app/code"),
        ("src/empty", "/app/code/empty"),
        ("src/main.py", "/app/code/main.py"),
        ("src/pkg", "/app/code/pkg"),
        ("src/pkg/__init__.py", "/app/code/pkg/__init__.py"),
        ("src/pkg/mod.py", "/app/code/pkg/mod.py"),
        ("a.txt", "/data/a.txt"),
        ("b.txt", "/data/b.txt"),
        ("src/pkg/mod.py", "/lib/mod.py"),
        ("b.txt", "/lib/b.txt"),
    ]


def test_resolve_copies_whole_context(context):
    pairs = resolved("FROM x\nCOPY . /app/\n", context)
    assert pairs[0] == (".", "/app")
    assert ("Dockerfile", "/app/Dockerfile") in pairs and ("src/pkg/mod.py", "/app/src/pkg/mod.py") in pairs


@pytest.mark.parametrize("text, message", [
    ("FROM x\nCOPY ../secret /s\n", "Dockerfile:2: source '../secret' is outside the build context"),
    ("FROM x\n\nCOPY src/../../secret /s\n", "Dockerfile:3: source 'src/../../secret' is outside the build context"),
    ("FROM x\nCOPY .. /s/\n", "Dockerfile:2: source '..' is outside the build context"),
    ("FROM x\nCOPY /etc/passwd /s\n", "Dockerfile:2: source '/etc/passwd' is an absolute path"),
    ("FROM x\nCOPY missing.txt /s\n", "Dockerfile:2: source 'missing.txt' does not exist in the build context"),
    ("FROM x\nCOPY *.nothing /s/\n", "Dockerfile:2: source '*.nothing' matches nothing in the build context"),
])
def test_resolve_copies_refuses_sources_outside_or_missing(context, text, message):
    (context.parent / "secret").write_text("s")
    with pytest.raises(TaskError) as err:
        resolve_copies(parse_dockerfile(text, "Dockerfile"), context)
    assert str(err.value).startswith(message)


def test_a_symlink_source_pointing_outside_is_refused(context, tmp_path):
    (tmp_path / "secret").write_text("s")
    (context / "link").symlink_to(tmp_path / "secret")
    with pytest.raises(TaskError, match=r"^Dockerfile:2: source 'link': .* outside the build context"):
        resolve_copies(parse_dockerfile("FROM x\nCOPY link /s\n", "Dockerfile"), context)
    with pytest.raises(TaskError, match=r"^Dockerfile:2: source '\*': .*link.* outside the build context"):
        resolve_copies(parse_dockerfile("FROM x\nCOPY * /s/\n", "Dockerfile"), context)


def test_a_symlink_inside_a_copied_directory_pointing_outside_is_refused(context, tmp_path):
    (tmp_path / "outside").mkdir()
    (context / "src" / "pkg" / "escape").symlink_to(tmp_path / "outside")
    with pytest.raises(TaskError, match=r"^Dockerfile:3: source 'src': .*escape.* outside the build context"):
        resolve_copies(parse_dockerfile("FROM x\n\nCOPY src /app\n", "Dockerfile"), context)


def test_symlinked_directory_outside_cannot_be_reached_by_a_path_through_it(context, tmp_path):
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "f").write_text("x")
    (context / "door").symlink_to(tmp_path / "outside")
    with pytest.raises(TaskError, match="outside the build context"):
        resolve_copies(parse_dockerfile("FROM x\nCOPY door/f /f\n", "Dockerfile"), context)


def test_symlinks_inside_the_context_are_fine(context):
    (context / "alias.txt").symlink_to("a.txt")
    (context / "src" / "pkg" / "link.py").symlink_to("mod.py")
    pairs = resolved("FROM x\nCOPY alias.txt /x/\nCOPY src/pkg /p\n", context)
    assert pairs[0] == ("a.txt", "/x/alias.txt")  # followed, keeps its own name
    host = resolve_copies(parse_dockerfile("FROM x\nCOPY src/pkg /p\n", "Dockerfile"), context)
    links = [(h.name, d) for h, d in host if h.is_symlink()]
    assert links == [("link.py", "/p/link.py")]  # inside a directory: listed as the link itself


def test_add_of_an_archive_is_refused_by_content(context):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("inner.txt")
        tar.addfile(info, io.BytesIO(b""))
    (context / "data.bin").write_bytes(buffer.getvalue())
    plan = parse_dockerfile("FROM x\nADD data.bin /opt/\nCOPY data.bin /copy/\n", "Dockerfile")
    assert plan.unsupported == ()  # the name does not say it is an archive
    with pytest.raises(TaskError, match=r"^Dockerfile:2: ADD data.bin: .*archive Docker would extract"):
        resolve_copies(plan, context)
    plan = parse_dockerfile("FROM x\nADD a.txt /opt/\nCOPY data.bin /copy/\n", "Dockerfile")
    assert [d for _, d in resolve_copies(plan, context)] == ["/opt/a.txt", "/copy/data.bin"]


def test_dockerignore_and_special_files_are_refused(context):
    os.mkfifo(context / "src" / "fifo")
    with pytest.raises(TaskError, match="fifo is not a file, directory or symlink"):
        resolve_copies(parse_dockerfile("FROM x\nCOPY src /app\n", "Dockerfile"), context)
    (context / ".dockerignore").write_text("*.txt\n")
    with pytest.raises(TaskError, match=r"\.dockerignore: \.dockerignore is not supported"):
        resolve_copies(parse_dockerfile("FROM x\nCOPY a.txt /app\n", "Dockerfile"), context)
