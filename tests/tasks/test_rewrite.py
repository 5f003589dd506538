from __future__ import annotations

import hashlib
import tomllib
from pathlib import Path

import pytest

from harbor_hpc.core.errors import InputError
from harbor_hpc.tasks.manifest import ImageRecord, Manifest, TaskRecord, save_manifest
from harbor_hpc.tasks.rewrite import rewrite_tasks, set_docker_image

REF = "localhost:5000/ns/env-abc@sha256:" + "a" * 64


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (  # replaced in place: comments, spacing, quoting of neighbours kept
            '# top\n[environment]  # env\ncpus=1\ndocker_image =  "old"   # keep\n\n[agent]\n',
            f'# top\n[environment]  # env\ncpus=1\ndocker_image =  "{REF}"   # keep\n\n[agent]\n',
        ),
        (  # literal string replaced
            "[environment]\ndocker_image = 'old'\n",
            f'[environment]\ndocker_image = "{REF}"\n',
        ),
        (  # key added under the header
            "[environment]\ncpus = 2\n",
            f'[environment]\ndocker_image = "{REF}"\ncpus = 2\n',
        ),
        (  # table added
            'version = "1.0"\n',
            f'version = "1.0"\n\n[environment]\ndocker_image = "{REF}"\n',
        ),
        (  # dotted keys: tomlkit keeps the style
            "environment.cpus = 1\n",
            f'environment.cpus = 1\nenvironment.docker_image = "{REF}"\n',
        ),
        (  # a look-alike inside a multi-line string is left alone
            '[environment]\nnote = """\ndocker_image = "fake"\n"""\ndocker_image = "old"\n',
            f'[environment]\nnote = """\ndocker_image = "fake"\n"""\ndocker_image = "{REF}"\n',
        ),
    ],
)
def test_set_docker_image_changes_only_that_value(before: str, after: str) -> None:
    assert set_docker_image(before, REF) == after
    assert tomllib.loads(after)["environment"]["docker_image"] == REF


def make_task(root: Path, rel: str, toml: str) -> Path:
    task = root / rel
    (task / "environment").mkdir(parents=True)
    (task / "environment" / "Dockerfile").write_text("FROM base\n")
    (task / "task.toml").write_text(toml)
    return task / "task.toml"


def digest(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


@pytest.fixture
def suite(tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "tasks"
    for rel in ("a/one", "a/two", "failed", "local", "unknown"):
        make_task(root, rel, "# keep\n[environment]\ncpus = 1  # cores\n\n[agent]\nx = 1\n")
    make_task(root, "broken", "[environment\n")
    manifest = Manifest("localhost:5000/ns", str(root))
    pushed = ImageRecord("localhost:5000/ns/env-a", "a" * 64, ["a/one", "a/two"], digest("a"))
    pushed.sif = "/sif/env-a.sif"
    manifest.set_image("a" * 64, pushed)
    manifest.set_image(
        "b" * 64, ImageRecord("localhost:5000/ns/env-b", "b" * 64, ["failed"], error="RUN failed")
    )
    manifest.set_image(
        "c" * 64,
        ImageRecord("localhost:5000/ns/env-c", "c" * 64, ["local"], image_id=digest("c")),
    )
    manifest.tasks["elsewhere"] = TaskRecord(None, None, "COPY outside the context")
    path = tmp_path / "manifest.json"
    save_manifest(path, manifest)
    return root, path


def test_rewrite_pins_what_it_can_and_lists_the_rest(suite: tuple[Path, Path]) -> None:
    root, manifest = suite
    before = (root / "failed" / "task.toml").read_bytes()
    result = rewrite_tasks(root, manifest)
    assert result.changed == ["a/one", "a/two"]
    reference = f"localhost:5000/ns/env-a@{digest('a')}"
    assert (root / "a/one/task.toml").read_text() == (
        f'# keep\n[environment]\ndocker_image = "{reference}"\ncpus = 1  # cores\n'
        "\n[agent]\nx = 1\n"
    )
    assert set(result.skipped) == {"failed", "local", "unknown"}
    assert result.skipped["failed"] == "RUN failed"
    assert "--no-push" in result.skipped["local"]
    assert "not in the manifest" in result.skipped["unknown"]
    assert [problem.path for problem in result.problems] == [root / "broken" / "task.toml"]
    assert (root / "failed" / "task.toml").read_bytes() == before
    assert not result.ok

    again = rewrite_tasks(root, manifest)
    assert again.changed == [] and again.unchanged == ["a/one", "a/two"]


def test_dry_run_shows_a_diff_and_writes_nothing(suite: tuple[Path, Path]) -> None:
    root, manifest = suite
    before = (root / "a/one/task.toml").read_bytes()
    result = rewrite_tasks(root, manifest, dry_run=True)
    assert (root / "a/one/task.toml").read_bytes() == before
    diff = result.diffs["a/one"]
    assert "--- a/a/one/task.toml" in diff
    assert [
        line for line in diff.splitlines() if line[:1] in "+-" and line[:3] not in "+++---"
    ] == [f'+docker_image = "localhost:5000/ns/env-a@{digest("a")}"']


def test_sif_mode_uses_the_recorded_sif(suite: tuple[Path, Path]) -> None:
    root, manifest = suite
    result = rewrite_tasks(root, manifest, sif=True)
    assert result.changed == ["a/one", "a/two"]
    assert tomllib.loads((root / "a/two/task.toml").read_text())["environment"] == {
        "docker_image": "/sif/env-a.sif",
        "cpus": 1,
    }


def test_a_folder_the_manifest_does_not_know_is_refused(suite: tuple[Path, Path]) -> None:
    root, manifest = suite
    with pytest.raises(InputError, match="none of the 2 tasks under"):
        rewrite_tasks(root / "a", manifest)
