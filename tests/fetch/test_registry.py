"""fetch of Harbor registry datasets: Harbor's own registry client and downloader against a real
git repository and registry.json in tmp_path (file:// URLs; no network, no git config of the
machine's or the user's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harbor_hpc.core.errors import HarborHpcError, InputError
from harbor_hpc.fetch import fetch_registry_dataset, plan_registry_dataset
from tests.support.hub_data import task_files

TASKS = ["hello", "fizz", "buzz"]
# Git as a fresh machine has it: no /etc/gitconfig, no ~/.gitconfig, an identity for commits,
# never a prompt.
GIT_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_AUTHOR_NAME": "harbor-hpc tests",
    "GIT_AUTHOR_EMAIL": "tests@harbor-hpc.invalid",
    "GIT_COMMITTER_NAME": "harbor-hpc tests",
    "GIT_COMMITTER_EMAIL": "tests@harbor-hpc.invalid",
    "GIT_TERMINAL_PROMPT": "0",
}


@pytest.fixture(autouse=True)
def lone_git(monkeypatch: pytest.MonkeyPatch) -> None:
    """Harbor runs git as a child process: it inherits these."""
    monkeypatch.delenv("GIT_CONFIG_COUNT", raising=False)
    for key, value in GIT_ENV.items():
        monkeypatch.setenv(key, value)


def git(*args: str, cwd: Path) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True)
    return done.stdout.strip()


def write_task(root: Path, name: str, flavour: str = "") -> None:
    for rel, (content, mode) in task_files(name, flavour).items():
        path = root / name / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        path.chmod(mode)


@dataclass(frozen=True)
class TaskRepo:
    """A git repository of tasks under tasks/: commit v1, then v2 where only hello changed."""

    path: Path
    v1: str
    v2: str

    @property
    def url(self) -> str:
        return self.path.as_uri()

    def entry(self, task: str, commit: str) -> dict[str, Any]:
        return {"name": task, "git_url": self.url, "git_commit_id": commit, "path": f"tasks/{task}"}


@pytest.fixture
def task_repo(tmp_path: Path) -> TaskRepo:
    path = tmp_path / "git" / "lab" / "tasks"
    path.mkdir(parents=True)
    git("init", "-q", "-b", "main", cwd=path)
    for task in TASKS:
        write_task(path / "tasks", task)
    git("add", ".", cwd=path)
    git("commit", "-q", "-m", "three tasks", cwd=path)
    v1 = git("rev-parse", "HEAD", cwd=path)
    write_task(path / "tasks", "hello", flavour=" v2")
    git("commit", "-q", "-am", "hello v2", cwd=path)
    return TaskRepo(path, v1, git("rev-parse", "HEAD", cwd=path))


def dataset(name: str, version: str, tasks: list[dict[str, Any]]) -> dict[str, Any]:
    return {"name": name, "version": version, "description": "", "tasks": tasks}


@pytest.fixture
def registry(task_repo: TaskRepo, tmp_path: Path) -> Path:
    """demo@1.0 and demo@2.0; broken@1.0, whose second commit does not exist."""
    path = tmp_path / "registry.json"
    entries = [
        dataset("demo", "1.0", [task_repo.entry(task, task_repo.v1) for task in TASKS]),
        dataset("demo", "2.0", [task_repo.entry(task, task_repo.v2) for task in TASKS]),
        dataset(
            "broken",
            "1.0",
            [task_repo.entry("hello", task_repo.v1), task_repo.entry("fizz", "0" * 40)],
        ),
    ]
    path.write_text(json.dumps(entries))
    return path


def run_fetch(*args: str) -> subprocess.CompletedProcess[str]:
    # COLUMNS: rich wraps at 80 columns when stderr is not a terminal; keep each message whole.
    return subprocess.run(
        [sys.executable, "-m", "harbor_hpc", "fetch", *args],
        env={**os.environ, "COLUMNS": "400"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def snapshot(root: Path) -> dict[str, tuple[int, bytes]]:
    """Every path under `root` (the lock file aside) with its mtime and content."""
    return {
        str(path.relative_to(root)): (
            path.lstat().st_mtime_ns,
            path.read_bytes() if path.is_file() else b"",
        )
        for path in root.rglob("*")
        if path.name != ".harbor-hpc-fetch.lock"
    }


def visible(root: Path) -> list[str]:
    return sorted(path.name for path in root.iterdir() if not path.name.startswith("."))


def test_cli_puts_each_task_in_its_folder(
    registry: Path, task_repo: TaskRepo, tmp_path: Path
) -> None:
    dest = tmp_path / "tasks"

    result = run_fetch("demo@1.0", "--registry", str(registry), "--dest", str(dest), "--json")

    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert sorted(report["placed"]) == sorted(TASKS) and report["refused"] == []
    assert report["tasks"] == sorted(TASKS)
    assert report["sources"]["fizz"] == f"tasks/fizz in {task_repo.url} at {task_repo.v1}"
    assert visible(dest) == sorted(TASKS)
    for task in TASKS:
        files = {p.relative_to(dest / task).as_posix() for p in (dest / task).rglob("*")}
        assert set(task_files(task)) <= files
        assert (dest / task / "instruction.md").read_text() == f"Do {task}.\n"
        assert os.access(dest / task / "tests/test.sh", os.X_OK)
    assert not list(dest.glob(".harbor-hpc-staging-*"))


def test_include_picks_tasks_by_name(registry: Path, tmp_path: Path) -> None:
    dest = tmp_path / "tasks"

    report = fetch_registry_dataset(
        "demo@1.0", dest, registry=str(registry), include=["f*", "buzz"]
    )

    assert sorted(report.placed) == ["buzz", "fizz"]
    assert visible(dest) == ["buzz", "fizz"]


def test_rerun_keeps_unchanged_tasks_and_replaces_changed_ones(
    registry: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "tasks"
    fetch_registry_dataset("demo@1.0", dest, registry=str(registry))
    edited = dest / "fizz/task.toml"
    edited.write_text(edited.read_text() + "# as rewrite edits it\n")

    again = fetch_registry_dataset("demo@1.0", dest, registry=str(registry))
    newer = fetch_registry_dataset("demo@2.0", dest, registry=str(registry))

    assert again.placed == [] and sorted(again.unchanged) == sorted(TASKS)
    assert newer.placed == ["hello"] and sorted(newer.unchanged) == ["buzz", "fizz"]
    assert (dest / "hello/instruction.md").read_text() == "Do hello v2.\n"
    assert edited.read_text().endswith("# as rewrite edits it\n")
    assert not list(dest.glob(".harbor-hpc-staging-*"))


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["nope@1.0"], "nope@1.0: Dataset nope not found"),
        (["demo@9.9"], "demo@9.9: Version 9.9 of dataset demo not found"),
        (["demo@1.0", "--include", "zz*"], "No tasks matched the filter(s) ['zz*']"),
        (["demo@1.0", "--revision", "main"], "demo@1.0: --revision is for Hugging Face"),
    ],
)
def test_bad_names_are_one_line_and_exit_2(
    args: list[str], expected: str, registry: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "tasks"

    result = run_fetch(*args, "--registry", str(registry), "--dest", str(dest))

    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    [error] = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert expected in error
    assert not dest.exists()


@pytest.mark.parametrize(
    ("name", "where", "repo", "expected"),
    [
        ("demo@1.0", "nowhere.json", None, "--registry nowhere.json: no such file"),
        (
            "demo@1.0",
            "https://registry.invalid/registry.json",
            "https://git.invalid/lab/tasks",
            "demo@1.0: Value error, Cannot set both 'repo' and 'registry_url'",
        ),
        ("lab/demo@1.0", "registry.json", None, "ORG/NAME is a package on Harbor's hub"),
    ],
)
def test_options_that_cannot_work_are_bad_input(
    name: str,
    where: str,
    repo: str | None,
    expected: str,
    registry: Path,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.chdir(registry.parent)
    with pytest.raises(InputError) as error:
        fetch_registry_dataset(name, tmp_path / "tasks", registry=where, repo=repo)
    assert expected in error.value.message
    assert not (tmp_path / "tasks").exists()


def test_git_failure_midway_leaves_dest_as_it_was(registry: Path, tmp_path: Path) -> None:
    dest = tmp_path / "tasks"
    fetch_registry_dataset("demo@1.0", dest, registry=str(registry), include=["buzz"])
    before = snapshot(dest)
    fresh = tmp_path / "fresh"

    # hello downloads (and is staged) before git fails to fetch fizz's commit.
    result = run_fetch("broken@1.0", "--registry", str(registry), "--dest", str(dest))
    into_fresh = run_fetch("broken@1.0", "--registry", str(registry), "--dest", str(fresh))

    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    [error] = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert error.startswith(f"error: broken@1.0: `git fetch --depth 1 origin {'0' * 40}` failed")
    assert snapshot(dest) == before
    assert into_fresh.returncode == 1 and visible(fresh) == []
    assert not list(fresh.glob(".harbor-hpc-staging-*"))


def test_folder_no_fetch_placed_is_not_replaced(registry: Path, tmp_path: Path) -> None:
    dest = tmp_path / "tasks"
    mine = dest / "hello"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine\n")

    plan = plan_registry_dataset("demo@1.0", dest, registry=str(registry))
    report = fetch_registry_dataset("demo@1.0", dest, registry=str(registry))

    assert {task.name: task.step.state for task in plan.tasks}["hello"] == "failed"
    assert [failure.path for failure in report.failed] == ["hello"]
    assert "did not create" in report.failed[0].message
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    assert sorted(report.placed) == ["buzz", "fizz"]


def test_dry_run_lists_and_writes_nothing(
    registry: Path, task_repo: TaskRepo, tmp_path: Path
) -> None:
    dest = tmp_path / "tasks"

    result = run_fetch(
        "demo@1.0", "--registry", str(registry), "--dest", str(dest), "--dry-run", "-i", "hello"
    )

    assert result.returncode == 0, result.stderr
    assert f"hello (tasks/hello in {task_repo.url} at {task_repo.v1}): download into hello/" in (
        result.stdout
    )
    assert "fizz" not in result.stdout
    assert not dest.exists()
    fetch_registry_dataset("demo@1.0", dest, registry=str(registry), include=["hello"])
    again = plan_registry_dataset("demo@2.0", dest, registry=str(registry), include=["hello"])
    assert [task.action for task in again.tasks] == ["download, and replace hello/ if it changed"]


def test_git_registry(task_repo: TaskRepo, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A git registry (Harbor's --repo): registry.json in the repository, its tasks without a
    git_url of their own. Harbor takes only http(s), ssh and git URLs there; git's insteadOf
    (given in the environment) serves the one below from the local repository."""
    entries = [dataset("demo", "1.0", [{"name": "buzz", "path": "tasks/buzz"}])]
    (task_repo.path / "registry.json").write_text(json.dumps(entries))
    git("add", "registry.json", cwd=task_repo.path)
    git("commit", "-q", "-m", "registry", cwd=task_repo.path)
    base = f"{(tmp_path / 'git').as_uri()}/"
    monkeypatch.setenv("GIT_CONFIG_COUNT", "1")
    monkeypatch.setenv("GIT_CONFIG_KEY_0", f"url.{base}.insteadOf")
    monkeypatch.setenv("GIT_CONFIG_VALUE_0", "https://git.invalid/")
    dest = tmp_path / "tasks"

    report = fetch_registry_dataset("demo@1.0", dest, repo="https://git.invalid/lab/tasks")

    assert report.placed == ["buzz"]
    assert (dest / "buzz/instruction.md").read_text() == "Do buzz.\n"
    with pytest.raises(InputError, match=r"Version '2\.0' of dataset 'demo' not found"):
        fetch_registry_dataset("demo@2.0", dest, repo="https://git.invalid/lab/tasks")


def test_local_task_is_copied(tmp_path: Path) -> None:
    """A registry entry without git_url names a folder on this machine: fetch copies it."""
    write_task(tmp_path / "shared", "local-one")
    registry = tmp_path / "registry.json"
    entry = {"name": "local-one", "path": str(tmp_path / "shared/local-one")}
    registry.write_text(json.dumps([dataset("mine", "1", [entry])]))
    dest = tmp_path / "tasks"

    report = fetch_registry_dataset("mine@1", dest, registry=str(registry))

    assert report.placed == ["local-one"] and report.tasks == ["local-one"]
    assert (dest / "local-one/instruction.md").read_text() == "Do local-one.\n"
    assert (tmp_path / "shared/local-one/instruction.md").exists(), "the source stays"


def test_two_tasks_of_one_name_are_refused(task_repo: TaskRepo, tmp_path: Path) -> None:
    write_task(tmp_path / "shared", "hello")
    registry = tmp_path / "registry.json"
    local = {"name": "hello", "path": str(tmp_path / "shared/hello")}
    registry.write_text(
        json.dumps([dataset("twice", "1", [task_repo.entry("hello", task_repo.v1), local])])
    )

    with pytest.raises(HarborHpcError, match="more than one task is named hello"):
        plan_registry_dataset("twice@1", tmp_path / "tasks", registry=str(registry))
