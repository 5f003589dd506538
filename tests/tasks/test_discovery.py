import os
from pathlib import Path

import pytest
from harbor.models.task.config import NetworkMode

from harbor_hpc.core.errors import InputError
from harbor_hpc.tasks.discovery import discover_tasks


def make_task(folder: Path, toml: str = "", dockerfile: bool = True) -> Path:
    (folder / "environment").mkdir(parents=True)
    (folder / "task.toml").write_text(toml)
    if dockerfile:
        (folder / "environment" / "Dockerfile").write_text("FROM scratch\n")
    return folder


def test_a_task_folder_given_itself_is_that_one_task_named_as_in_its_parent(
    tmp_path: Path,
) -> None:
    task = make_task(tmp_path / "tasks" / "hello-world")
    make_task(tmp_path / "tasks" / "other")

    found = discover_tasks(task)

    assert found.root == tmp_path / "tasks"
    assert [t.rel for t in found.tasks] == ["hello-world"] and found.problems == []


def test_finds_tasks_at_any_depth_and_reports_problems(tmp_path: Path) -> None:
    make_task(tmp_path / "a", '[environment]\ndocker_image = "img"\nmemory_mb = 512\n')
    make_task(tmp_path / "deep" / "er" / "b", "[agent]\ntimeout_sec = 30\n")
    make_task(tmp_path / "broken", "[environment\n")
    make_task(tmp_path / "nodockerfile", dockerfile=False)
    make_task(tmp_path / "badtype", "[environment]\nmemory_mb = 'lots'\n")
    (tmp_path / "link").symlink_to(tmp_path / "a")
    (tmp_path / ".hidden").mkdir()
    make_task(tmp_path / ".hidden" / "c")

    found = discover_tasks(tmp_path)

    assert [t.rel for t in found.tasks] == ["a", "deep/er/b"]
    a, b = found.tasks
    assert (a.docker_image, a.memory_mb) == ("img", 512)
    assert b.agent_timeout_sec == 30.0 and b.verifier_timeout_sec == 600.0  # Harbor's default
    problems = {p.path.relative_to(tmp_path).as_posix(): p.message for p in found.problems}
    assert problems.keys() == {"broken/task.toml", "nodockerfile", "badtype/task.toml", "link"}
    assert "not valid TOML" in problems["broken/task.toml"]
    assert problems["badtype/task.toml"] == (
        "environment.memory_mb: Input should be a valid integer, unable to parse string as an "
        "integer"
    )
    assert "duplicate of" in problems["link"]


def test_dockerfile_optional_and_root_task(tmp_path: Path) -> None:
    make_task(tmp_path, dockerfile=False)
    found = discover_tasks(tmp_path, require_dockerfile=False)
    assert [t.rel for t in found.tasks] == [tmp_path.name]


def test_missing_root_is_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="not a folder"):
        discover_tasks(tmp_path / "nope")


def test_harbor_migrations_apply(tmp_path: Path) -> None:
    make_task(
        tmp_path / "old",
        'version = "1.0"\n[environment]\nmemory = "2G"\nallow_internet = false\n'
        '[verifier.environment]\ndocker_image = "grader"\n',
    )
    make_task(tmp_path / "clash", '[environment]\nmemory = "1G"\nmemory_mb = 512\n')
    found = discover_tasks(tmp_path)
    (task,) = found.tasks
    assert task.memory_mb == 2048
    assert task.config.environment.network_mode == NetworkMode.NO_NETWORK
    assert task.separate_verifier and task.verifier_docker_image == "grader"
    (problem,) = found.problems
    assert str(problem) == (
        f"{tmp_path}/clash/task.toml: environment: Value error, Conflicting 'memory' and "
        "'memory_mb' values: memory='1G' (1024 MB) != memory_mb=512."
    )


def test_equal_task_tomls_are_each_a_task_or_each_a_problem(tmp_path: Path) -> None:
    for name in ("a", "b"):
        make_task(tmp_path / "good" / name, "[environment]\nmemory_mb = 512\n")
        make_task(tmp_path / "bad" / name, "[environment]\nmemory_mb = 'lots'\n")

    found = discover_tasks(tmp_path)

    assert [(t.rel, t.memory_mb) for t in found.tasks] == [("good/a", 512), ("good/b", 512)]
    assert [p.path.relative_to(tmp_path).as_posix() for p in found.problems] == [
        "bad/a/task.toml",
        "bad/b/task.toml",
    ]
    assert found.problems[0].message == found.problems[1].message


def test_a_folder_reached_again_through_a_deeper_symlink_is_a_duplicate(tmp_path: Path) -> None:
    make_task(tmp_path / "set" / "one")
    make_task(tmp_path / "elsewhere" / "two")
    (tmp_path / "set" / "again").symlink_to(tmp_path / "set" / "one")
    (tmp_path / "set" / "outside").symlink_to(tmp_path / "elsewhere" / "two")

    found = discover_tasks(tmp_path / "set")

    assert [t.rel for t in found.tasks] == ["again", "outside"]  # walked in sorted order
    (problem,) = found.problems
    assert problem.path == tmp_path / "set" / "one"
    assert problem.message == f"duplicate of {tmp_path / 'set' / 'again'} (symlink)"


def test_a_task_toml_that_cannot_be_read_is_named_and_a_folder_of_that_name_is_none(
    tmp_path: Path,
) -> None:
    make_task(tmp_path / "dangling")
    (tmp_path / "dangling" / "task.toml").unlink()
    (tmp_path / "dangling" / "task.toml").symlink_to(tmp_path / "gone.toml")
    (tmp_path / "holder" / "task.toml").mkdir(parents=True)  # a folder, not a task.toml
    make_task(tmp_path / "holder" / "inner")
    locked = make_task(tmp_path / "locked")
    (locked / "task.toml").chmod(0)

    found = discover_tasks(tmp_path)

    assert [t.rel for t in found.tasks] == ["holder/inner"] + (
        ["locked"] if os.geteuid() == 0 else []  # root reads it all the same
    )
    problems = {p.path.relative_to(tmp_path).as_posix(): p.message for p in found.problems}
    expected = {"dangling/task.toml": "cannot read (No such file or directory)"}
    if os.geteuid() != 0:
        expected["locked/task.toml"] = "cannot read (Permission denied)"
    assert problems == expected
