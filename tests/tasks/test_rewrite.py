from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from harbor_hpc.core.errors import InputError
from harbor_hpc.tasks.manifest import ImageRecord, Manifest, TaskRecord, save_manifest
from harbor_hpc.tasks.rewrite import rewrite_tasks, set_docker_image

REF = "localhost:5000/ns/env-abc@sha256:" + "a" * 64
DIGEST = "sha256:" + "d" * 64


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
        (  # CRLF, trailing spaces and no final newline: all kept
            '[environment]  \r\ndocker_image = "old"\r\ncpus = 1 \t',
            f'[environment]  \r\ndocker_image = "{REF}"\r\ncpus = 1 \t',
        ),
        (  # a key added to a CRLF file ends in CRLF
            "# c\r\n[environment] # env\r\ncpus = 2\r\n",
            f'# c\r\n[environment] # env\r\ndocker_image = "{REF}"\r\ncpus = 2\r\n',
        ),
        (  # a header that ends the file without a newline
            "a = 1\r\n[environment]",
            f'a = 1\r\n[environment]\r\ndocker_image = "{REF}"',
        ),
        (  # lines tomlkit adds to a CRLF file end in CRLF too
            'version = "1.0"\r\n',
            f'version = "1.0"\r\n\r\n[environment]\r\ndocker_image = "{REF}"\r\n',
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


def test_rewrite_keeps_every_other_byte(tmp_path: Path) -> None:
    """Read and written as bytes: CRLF is not turned into LF on the way."""
    root = tmp_path / "tasks"
    toml = make_task(root, "crlf", "")
    toml.write_bytes(b'# k\xc3\xa9ep \r\n[environment]\r\ndocker_image = "old"  # x\r\ncpus = 1')
    manifest = tmp_path / "manifest.json"
    pinned = ImageRecord("localhost:5000/ns/env-a", "a" * 64, ["crlf"], digest("a"))
    write_manifest(manifest, root, pinned)
    assert rewrite_tasks(root, manifest).changed == ["crlf"]
    assert toml.read_bytes() == (
        b"# k\xc3\xa9ep \r\n[environment]\r\n"
        + f'docker_image = "{pinned.reference}"  # x\r\ncpus = 1'.encode()
    )


def test_a_task_toml_with_a_bom_is_named_and_left_alone(tmp_path: Path) -> None:
    """Harbor's TOML reader refuses a byte order mark, so the task is named, not rewritten."""
    root = tmp_path / "tasks"
    toml = make_task(root, "bom", "")
    toml.write_bytes(b"\xef\xbb\xbf[environment]\r\ncpus = 1\r\n")
    manifest = tmp_path / "manifest.json"
    write_manifest(manifest, root, ImageRecord("localhost:5000/ns/a", "a" * 64, ["bom"], DIGEST))
    result = rewrite_tasks(root, manifest)
    assert [problem.path for problem in result.problems] == [toml]
    assert toml.read_bytes() == b"\xef\xbb\xbf[environment]\r\ncpus = 1\r\n"


def test_a_symlinked_task_toml_is_edited_in_its_target(tmp_path: Path) -> None:
    root = tmp_path / "tasks"
    link = make_task(root, "linked", "")
    link.unlink()
    shared = tmp_path / "shared"
    shared.mkdir()
    target = shared / "task.toml"
    target.write_text("[environment]\ncpus = 1\n")
    target.chmod(0o640)
    link.symlink_to(os.path.relpath(target, link.parent))
    manifest = tmp_path / "manifest.json"
    pinned = ImageRecord("localhost:5000/ns/env-a", "a" * 64, ["linked"], digest("a"))
    write_manifest(manifest, root, pinned)

    assert rewrite_tasks(root, manifest).changed == ["linked"]
    assert link.is_symlink() and link.resolve() == target
    assert target.read_text() == f'[environment]\ndocker_image = "{pinned.reference}"\ncpus = 1\n'
    assert target.stat().st_mode & 0o777 == 0o640
    assert sorted(path.name for path in shared.iterdir()) == ["task.toml"]  # no temp file left
    assert rewrite_tasks(root, manifest).unchanged == ["linked"]


def write_manifest(path: Path, root: Path, *images: ImageRecord) -> None:
    manifest = Manifest("localhost:5000/ns", str(root))
    for image in images:
        manifest.set_image(image.tag, image)
    save_manifest(path, manifest)


def cli(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "empty-config.toml"
    config.write_text("")
    return subprocess.run(
        [sys.executable, "-m", "harbor_hpc", "rewrite", *args],
        capture_output=True,
        text=True,
        # No wrapping inside messages; no config file of the user's.
        env={**os.environ, "COLUMNS": "250", "HARBOR_HPC_CONFIG": str(config)},
        timeout=120,
        check=False,
    )


def test_a_read_only_task_toml_is_refused_and_the_others_go_on(tmp_path: Path) -> None:
    root = tmp_path / "tasks"
    locked = make_task(root, "locked", "[environment]\ncpus = 1\n")
    free = make_task(root, "free", "[environment]\ncpus = 1\n")
    locked.chmod(0o444)
    manifest = tmp_path / "manifest.json"
    write_manifest(
        manifest, root, ImageRecord("localhost:5000/ns/a", "a" * 64, ["locked", "free"], DIGEST)
    )

    ran = cli(str(root), "--manifest", str(manifest), tmp_path=tmp_path)
    assert ran.returncode == 1, ran.stderr
    assert f"{locked}: read-only: chmod u+w it to let rewrite change it" in ran.stderr
    assert "Traceback" not in ran.stderr + ran.stdout
    assert locked.read_text() == "[environment]\ncpus = 1\n"
    assert locked.stat().st_mode & 0o777 == 0o444
    assert tomllib.loads(free.read_text())["environment"]["docker_image"] == (
        f"localhost:5000/ns/a@{DIGEST}"
    )


@pytest.mark.parametrize(
    ("entry", "change", "shown"),
    [
        ("digest", "latest", "'latest' is not a digest (sha256:<64 hex digits>)"),
        ("digest", "sha256:" + "A" * 64, "is not a digest"),
        ("tasks", "t", "'t' is not a list of strings"),
        ("repository", 5, "5 is not a repository"),
        ("sif", ["x"], "['x'] is not a string"),
    ],
)
def test_a_bad_manifest_value_is_one_line_naming_it(
    tmp_path: Path, entry: str, change: object, shown: str
) -> None:
    root = tmp_path / "tasks"
    toml = make_task(root, "t", "[environment]\ncpus = 1\n")
    manifest = tmp_path / "manifest.json"
    write_manifest(manifest, root, ImageRecord("localhost:5000/ns/a", "a" * 64, ["t"], DIGEST))
    data = json.loads(manifest.read_text())
    data["images"]["a" * 64][entry] = change
    manifest.write_text(json.dumps(data))

    ran = cli(str(root), "--manifest", str(manifest), tmp_path=tmp_path)
    assert ran.returncode == 2
    error = [line for line in ran.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "Traceback" not in ran.stderr
    assert error[0].startswith(f"error: {manifest}: images.{'a' * 64}.{entry} = ")
    assert shown in error[0]
    assert toml.read_text() == "[environment]\ncpus = 1\n"


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_a_rewrite_stopped_while_it_writes_leaves_each_task_old_or_new(
    tmp_path: Path, stop: signal.Signals
) -> None:
    root = tmp_path / "tasks"
    old = "[environment]\ncpus = 1\n"
    tomls = [make_task(root, f"t{index:04d}", old) for index in range(2000)]
    record = ImageRecord("localhost:5000/ns/a", "a" * 64, [t.parent.name for t in tomls], DIGEST)
    manifest = tmp_path / "manifest.json"
    write_manifest(manifest, root, record)
    config = tmp_path / "empty-config.toml"
    config.write_text("")
    rewrite = [
        sys.executable,
        "-m",
        "harbor_hpc",
        "rewrite",
        str(root),
        "--manifest",
        str(manifest),
    ]
    env = {**os.environ, "HARBOR_HPC_CONFIG": str(config)}
    # On a busy machine a rewrite can finish between two looks: then the tasks are put back
    # and it runs again, until the stop lands while new files are written beside the old.
    for _ in range(5):
        for toml in tomls:
            toml.write_text(old)
        process = subprocess.Popen(
            rewrite,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            # Ctrl-C as at a terminal: a test run started in the background (CI) ignores
            # SIGINT, and so would the rewrite it starts.
            preexec_fn=_interruptible,
        )
        if _stopped_while_writing(process, root, stop):
            break
        assert process.wait(timeout=60) == 0
    else:
        pytest.fail("five rewrites ended before they could be stopped while writing")
    _, stderr = process.communicate(timeout=60)

    assert process.returncode in (130, 128 + stop), stderr
    assert "Traceback" not in stderr and "internal error" not in stderr
    assert not list(root.rglob("*.tmp"))
    pinned = f"localhost:5000/ns/a@{DIGEST}"
    images = [tomllib.loads(toml.read_text())["environment"].get("docker_image") for toml in tomls]
    assert set(images) <= {None, pinned}

    again = cli(str(root), "--manifest", str(manifest), tmp_path=tmp_path)
    assert again.returncode == 0, again.stderr
    assert all(tomllib.loads(t.read_text())["environment"]["docker_image"] == pinned for t in tomls)


def _interruptible() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stopped_while_writing(
    process: subprocess.Popen[str], root: Path, stop: signal.Signals
) -> bool:
    """Send `stop` to the rewrite `process` while it has new files beside the old (it is paused
    to look): True; False where it ended first."""
    first = root / "t0000"
    deadline = time.monotonic() + 60
    while not any(name.endswith(".tmp") for name in os.listdir(first)):
        if process.poll() is not None:
            return False
        assert time.monotonic() < deadline
        time.sleep(0.001)
    process.send_signal(signal.SIGSTOP)
    writing = any(root.rglob("*.tmp"))
    if writing:
        process.send_signal(stop)
    process.send_signal(signal.SIGCONT)
    return writing
