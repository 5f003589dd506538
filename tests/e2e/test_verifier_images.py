"""Separate verifier images (Harbor's `[verifier] environment_mode = "separate"`): planned, built,
recorded, converted, rewritten and run, from tests/Dockerfile or from the author's reference.

The planning, manifest and rewrite tests need nothing; the last test runs the whole flow on the
real Docker Engine, the open test registry, Apptainer and Slurm.
"""

from __future__ import annotations

import difflib
import json
import os
import subprocess
import sys
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harbor_hpc.images.build import plan_build
from harbor_hpc.tasks.manifest import (
    ImageRecord,
    Manifest,
    RoleImage,
    load_manifest,
    save_manifest,
)
from harbor_hpc.tasks.rewrite import VERIFIER_ENVIRONMENT, rewrite_tasks, set_docker_image
from tests.tasks.test_manifest_schema import validate as validate_manifest

REPO = Path(__file__).resolve().parents[2]
BASE = os.environ.get("HARBOR_HPC_TEST_BASE_IMAGE", "local/debian:bookworm")
SEPARATE = '[verifier]\ntimeout_sec = 60.0\nenvironment_mode = "separate"\n'
DIGEST = "sha256:" + "d" * 64


def make_task(
    root: Path,
    rel: str,
    *,
    verifier: str = SEPARATE,
    environment: str = "[environment]\ncpus = 1\nmemory_mb = 512\n",
    dockerfile: str = f"FROM {BASE}\n",
    tests_dockerfile: str | None = None,
    files: dict[str, str] | None = None,
) -> Path:
    """A task folder; `files` are extra files by path relative to the task."""
    task = root / rel
    for folder in ("environment", "tests", "solution"):
        (task / folder).mkdir(parents=True, exist_ok=True)
    (task / "task.toml").write_text(
        f'# task {rel}\nschema_version = "1.1"\n\n{verifier}\n{environment}'
    )
    (task / "environment" / "Dockerfile").write_text(dockerfile)
    if tests_dockerfile is not None:
        (task / "tests" / "Dockerfile").write_text(tests_dockerfile)
    for name, text in (files or {}).items():
        (task / name).parent.mkdir(parents=True, exist_ok=True)
        (task / name).write_text(text)
    return task


# ---- planning: which context is whose -------------------------------------------------------


def test_plan_builds_tests_as_one_more_context_shared_across_tasks_and_roles(
    tmp_path: Path,
) -> None:
    root = tmp_path / "tasks"
    grader = f"FROM {BASE}\nRUN echo grader > /grader\n"
    make_task(root, "a", tests_dockerfile=grader)
    make_task(root, "b", tests_dockerfile=grader, files={"tests/test.sh": "exit 0\n"})
    # tests/ identical to an environment/ context: one image, in both roles.
    make_task(root, "c", dockerfile=grader)
    make_task(root, "d", tests_dockerfile=f"FROM {BASE}\nRUN echo grader > /grader\n")
    # Shared mode: Harbor never reads tests/Dockerfile, so nothing is built from it.
    make_task(root, "shared", verifier="[verifier]\ntimeout_sec = 60.0\n", tests_dockerfile=grader)
    make_task(root, "outside", tests_dockerfile=f"FROM {BASE}\nCOPY ../solution/x /x\n")
    make_task(
        root,
        "author",
        verifier=f'[verifier.environment]\ndocker_image = "localhost:5000/g/grader@{DIGEST}"\n',
    )
    make_task(root, "sidecars", files={"environment/docker-compose.yaml": "services: {}\n"})
    make_task(
        root,
        "host-net",
        files={
            "environment/docker-compose.yaml": "services:\n  db:\n    image: x\n"
            "    network_mode: host\n"
        },
    )

    plan = plan_build(root, "localhost:5000/ns")

    roles = sorted((image.tasks, image.verifier_tasks) for image in plan.images.values())
    tests_a, tests_b = (root / "a" / "tests", root / "b" / "tests")
    assert (tests_a / "Dockerfile").read_text() == (tests_b / "Dockerfile").read_text()
    # a's and d's tests/ are one context; b's has a test.sh too; c's environment/ is a's tests/.
    assert (["c"], ["a", "d"]) in roles and ([], ["b"]) in roles
    assert sum(len(image.tasks) for image in plan.images.values()) == 9  # every environment/
    assert "shared" not in {t for image in plan.images.values() for t in image.verifier_tasks}
    assert plan.verifier_errors == {
        "outside": "outside/tests/Dockerfile: COPY ../solution/x reaches outside the build "
        "context (tests/), which Docker does not send; move the file into tests/"
    }
    assert plan.verifier_references == {"author": f"localhost:5000/g/grader@{DIGEST}"}
    # A compose file is read as the environment reads it: only what cannot run is named.
    assert list(plan.compose) == ["host-net"] and "network_mode 'host'" in plan.compose["host-net"]


def test_build_dry_run_warns_about_compose_that_cannot_run_per_task(tmp_path: Path) -> None:
    root = tmp_path / "tasks"
    make_task(
        root,
        "one",
        files={
            "environment/docker-compose.yml": "services:\n  db:\n    image: x\n"
            "    privileged: true\n"
        },
    )
    make_task(
        root, "fine", files={"environment/docker-compose.yml": "services:\n  db:\n    image: x\n"}
    )
    make_task(root, "two")
    result = subprocess.run(
        [sys.executable, "-m", "harbor_hpc", "build", str(root), "--registry",
         "localhost:5000/ns", "--manifest", str(tmp_path / "m.json"), "--dry-run"],
        capture_output=True, text=True, env={**os.environ, "COLUMNS": "300"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "compose" in line]
    assert len(warnings) == 1
    assert (
        warnings[0].startswith("warning: one: ")
        and "docker-compose.yml: service 'db'" in warnings[0]
    )
    assert "`privileged`" in warnings[0] and "`unsupported`" in warnings[0]


# ---- the manifest -------------------------------------------------------------------------------


def _manifest_with_verifiers(root: Path, path: Path) -> Manifest:
    """Task `a` built its verifier from tests/; task `author` names a reference of its own."""
    manifest = Manifest("localhost:5000/ns", str(root))
    main = ImageRecord("localhost:5000/ns/env-" + "1" * 12, "1" * 64, ["a", "author"], DIGEST)
    main.sif = "/store/main.sif"
    verifier = ImageRecord("localhost:5000/ns/env-" + "2" * 12, "2" * 64, [], DIGEST)
    verifier.verifier_tasks, verifier.sif = ["a"], "/store/verifier.sif"
    manifest.set_image("1" * 64, main)
    manifest.set_image("2" * 64, verifier)
    manifest.tasks["author"].verifier = RoleImage(None, "localhost:5000/g/grader:1")
    save_manifest(path, manifest)
    return manifest


def test_manifest_records_verifier_images_and_old_manifests_still_read(tmp_path: Path) -> None:
    path = tmp_path / "manifest.json"
    manifest = _manifest_with_verifiers(tmp_path, path)
    validate_manifest(json.loads(path.read_text()))
    again = load_manifest(path)
    assert again.tasks == manifest.tasks
    assert again.tasks["a"].verifier == RoleImage(
        "2" * 64, f"{again.images['2' * 64].repository}@{DIGEST}"
    )
    assert again.verifier_image_of("a") is not None and again.verifier_image_of("author") is None

    # A manifest written before verifier images: the example without the verifier fields.
    data = json.loads((REPO / "manifests" / "verifiers-and-failures.json").read_text())
    for task in data["tasks"].values():
        task.pop("verifier", None)
    for image in data["images"].values():
        image.pop("verifier_tasks", None)
    old_path = tmp_path / "old.json"
    old_path.write_text(json.dumps(data))
    validate_manifest(data)  # the schema still describes it
    loaded = load_manifest(old_path)
    assert all(record.verifier is None for record in loaded.tasks.values())
    assert all(image.verifier_tasks == [] for image in loaded.images.values())


# ---- rewrite --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (  # an existing docker_image line: replaced in place, comment kept
            SEPARATE + '[verifier.environment]\ndocker_image = "old"  # mine\n',
            SEPARATE + '[verifier.environment]\ndocker_image = "NEW"  # mine\n',
        ),
        (  # an existing table without the key: the line goes right under the header
            "[verifier.environment]\ncpus = 2\n\n[environment]\ncpus = 1\n",
            '[verifier.environment]\ndocker_image = "NEW"\ncpus = 2\n\n[environment]\ncpus = 1\n',
        ),
        (  # a spaced header
            "[ verifier . environment ]  # v\nx = 1\n",
            '[ verifier . environment ]  # v\ndocker_image = "NEW"\nx = 1\n',
        ),
    ],
)
def test_set_verifier_docker_image_changes_only_that_value(before: str, after: str) -> None:
    assert set_docker_image(before, "NEW", table=VERIFIER_ENVIRONMENT) == after


def test_a_new_verifier_table_gives_the_verifier_what_harbor_gave_it_before(
    tmp_path: Path,
) -> None:
    from harbor.models.task.config import TaskConfig
    from harbor.models.task.paths import TaskPaths
    from harbor.models.task.verifier_mode import resolve_verifier_environment_definition

    environment = (
        '[environment]\ndocker_image = "main@x"\ncpus = 2\nmemory_mb = 1024\n'
        'network_mode = "no-network"\n\n[environment.env]\nTOKEN = "t"\n'
    )
    task = make_task(tmp_path, "t", environment=environment, tests_dockerfile=f"FROM {BASE}\n")
    before = (task / "task.toml").read_text()
    after = set_docker_image(before, "/store/v.sif", table=VERIFIER_ENVIRONMENT)

    changes = difflib.ndiff(before.splitlines(), after.splitlines())
    assert not [line for line in changes if line.startswith("- ")]  # lines only added

    def definition(text: str) -> Any:
        config = TaskConfig.model_validate(tomllib.loads(text))
        return resolve_verifier_environment_definition(config, TaskPaths(task))

    was, now = definition(before), definition(after)
    assert (was.directory, was.bundled_tests) == (now.directory, now.bundled_tests)
    assert was.config.docker_image is None and now.config.docker_image == "/store/v.sif"
    assert now.config.model_dump(exclude={"docker_image"}) == was.config.model_dump(
        exclude={"docker_image"}
    )


def test_rewrite_points_verifiers_at_their_images_and_sifs(tmp_path: Path) -> None:
    root = tmp_path / "tasks"
    make_task(root, "a", tests_dockerfile=f"FROM {BASE}\n")
    make_task(
        root,
        "author",
        verifier='[verifier.environment]\ndocker_image = "localhost:5000/g/grader:1"\n',
    )
    path = tmp_path / "manifest.json"
    manifest = _manifest_with_verifiers(root, path)

    def verifier_image(task: str) -> str:
        config = tomllib.loads((root / task / "task.toml").read_text())
        image: str = config["verifier"]["environment"]["docker_image"]
        return image

    result = rewrite_tasks(root, path)
    assert sorted(result.changed) == ["a", "author"] and result.ok
    assert verifier_image("a") == manifest.tasks["a"].verifier.image  # type: ignore[union-attr]
    assert verifier_image("author") == "localhost:5000/g/grader:1"  # the author's, untouched

    skipped = rewrite_tasks(root, path, sif=True)  # the author's reference has no .sif yet
    assert skipped.skipped == {"author": "verifier image: no .sif yet (run `harbor-hpc convert`)"}
    assert verifier_image("a") == "/store/verifier.sif"
    manifest.tasks["author"].verifier = RoleImage(
        None, "localhost:5000/g/grader:1", None, "/store/g.sif"
    )
    save_manifest(path, manifest)
    assert rewrite_tasks(root, path, sif=True).changed == ["author"]
    assert verifier_image("author") == "/store/g.sif"
    assert rewrite_tasks(root, path, sif=True).unchanged == ["a", "author"]

    manifest.tasks["a"].verifier = RoleImage(None, None, "build failed: RUN exit 3")
    save_manifest(path, manifest)
    failed = rewrite_tasks(root, path)
    assert failed.skipped == {"a": "verifier image: build failed: RUN exit 3"}


# ---- the whole flow on the real parts ----------------------------------------------------------

AGENT_FILE, VERIFIER_FILE, AUTHOR_FILE = "/agent-only", "/verifier-only", "/author-grader"
# Harbor uploads no tests into a separate verifier's image: it must hold /tests/test.sh itself.
_OWN_TESTS = "COPY test.sh /tests/test.sh\n"
# The verifier runs in its own container: it sees the agent's work through the artifacts Harbor
# carries over (/logs/artifacts), and passes only in the image it expects.
_TEST = """#!/bin/bash
mkdir -p /logs/verifier
if [ "$(cat /logs/artifacts/answer 2>/dev/null)" = "42" ] && [ -f {expected} ] \\
    && [ ! -e {agent} ]; then echo 1 > /logs/verifier/reward.txt
else echo 0 > /logs/verifier/reward.txt; ls / /logs/artifacts >&2; fi
"""


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "harbor_hpc", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "250"},
        timeout=900,
    )


def flow_task(
    root: Path,
    name: str,
    *,
    base: str,
    verifier: str,
    tests_dockerfile: str | None,
    expected: str,
) -> None:
    make_task(
        root,
        name,
        verifier=verifier,
        dockerfile=f"FROM {base}\nRUN echo agent > {AGENT_FILE}\n",
        tests_dockerfile=tests_dockerfile,
        files={
            "instruction.md": "Write 42 into /logs/artifacts/answer.\n",
            "solution/solve.sh": "#!/bin/bash\nmkdir -p /logs/artifacts\n"
            "echo 42 > /logs/artifacts/answer\n",
            "tests/test.sh": _TEST.format(expected=expected, agent=AGENT_FILE),
        },
    )
    for script in ("solution/solve.sh", "tests/test.sh"):
        (root / name / script).chmod(0o755)


@pytest.fixture
def namespace() -> Iterator[str]:
    token = uuid.uuid4().hex[:10]
    yield f"{os.environ['HARBOR_HPC_TEST_REGISTRY']}/verifier-test-{token}"
    listed = subprocess.run(["docker", "images", "--format", "{{.Repository}}:{{.Tag}}"],
                            capture_output=True, text=True).stdout.split()  # fmt: skip
    mine = [image for image in listed if f"verifier-test-{token}" in image]
    if mine:
        subprocess.run(["docker", "rmi", "-f", *mine], capture_output=True)


@pytest.mark.docker
@pytest.mark.registry
@pytest.mark.apptainer
@pytest.mark.slurm
def test_separate_verifiers_build_convert_rewrite_and_run_to_reward_one(
    tmp_path: Path, namespace: str, slim_image: str
) -> None:
    # Every image FROM the small test image (bash, no python3): the flow converts three.
    # The author's grader image, pushed by tag like any image a task might name.
    author_image = f"{namespace}/grader:1"
    context = tmp_path / "grader"
    context.mkdir()
    (context / "test.sh").write_text(_TEST.format(expected=AUTHOR_FILE, agent=AGENT_FILE))
    (context / "test.sh").chmod(0o755)
    (context / "Dockerfile").write_text(
        f"FROM {slim_image}\nRUN echo author > {AUTHOR_FILE}\n{_OWN_TESTS}"
    )
    for command in (["build", "-t", author_image, str(context)], ["push", author_image]):
        done = subprocess.run(["docker", *command], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr

    tasks = tmp_path / "tasks"
    verifier_dockerfile = f"FROM {slim_image}\nRUN echo verifier > {VERIFIER_FILE}\n{_OWN_TESTS}"
    flow_task(tasks, "built", base=slim_image, verifier=SEPARATE, expected=VERIFIER_FILE,
              tests_dockerfile=verifier_dockerfile)  # fmt: skip
    flow_task(tasks, "author", base=slim_image, expected=AUTHOR_FILE, tests_dockerfile=None,
              verifier=f'[verifier]\ntimeout_sec = 60.0\n\n[verifier.environment]\n'
              f'docker_image = "{author_image}"\n')  # fmt: skip
    manifest, store, run = tmp_path / "manifest.json", tmp_path / "sif", tmp_path / "run"

    built = cli("build", str(tasks), "--registry", namespace, "--manifest", str(manifest), "--json")
    assert built.returncode == 0, built.stderr
    assert sorted(image["verifier_tasks"] for image in json.loads(built.stdout)["images"]) == [0, 1]
    validate_manifest(json.loads(manifest.read_text()))
    recorded = load_manifest(manifest)
    assert recorded.tasks["author"].verifier == RoleImage(None, author_image)

    submitted_early = cli("submit", str(tasks), "--agent", "oracle", "--run-dir", str(run),
                          "--dry-run", "--json")  # fmt: skip
    problems = json.loads(submitted_early.stdout)["image_problems"]
    assert "no environment.docker_image" in problems["built"]  # not rewritten yet

    converted = cli("convert", "--manifest", str(manifest), "--cache-dir", str(store),
                    "--nohttps", "--jobs", "2", "--json")  # fmt: skip
    assert converted.returncode == 0, converted.stderr
    assert json.loads(converted.stdout)["converted"] == 3  # two tasks' images, two verifiers'
    rewritten = cli("rewrite", str(tasks), "--manifest", str(manifest), "--sif")
    assert rewritten.returncode == 0, rewritten.stderr
    verifier_sifs = {}
    for name in ("built", "author"):
        config = tomllib.loads((tasks / name / "task.toml").read_text())
        verifier_sifs[name] = Path(config["verifier"]["environment"]["docker_image"])
        assert verifier_sifs[name].parent == store and verifier_sifs[name].is_file()
        assert verifier_sifs[name] != Path(config["environment"]["docker_image"])
    # The new [verifier.environment] of `built` carries what Harbor gave its verifier before.
    assert (
        tomllib.loads((tasks / "built/task.toml").read_text())["verifier"]["environment"][
            "memory_mb"
        ]
        == 512
    )

    # A rebuild keeps the author's reference (and its .sif) though the task now names the .sif.
    rebuilt = cli("build", str(tasks), "--registry", namespace, "--manifest", str(manifest))
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert load_manifest(manifest).tasks["author"].verifier == RoleImage(
        None, author_image, None, str(verifier_sifs["author"])
    )
    again = cli("rewrite", str(tasks), "--manifest", str(manifest), "--sif")
    assert "pointed 0 task(s) at their images; 2 already pointed there" in again.stderr

    submitted = cli("submit", str(tasks), "--agent", "oracle", "--run-dir", str(run), "--wait",
                    "--executor", "slurm", "--cache-dir", str(store), "--json")  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    assert json.loads(submitted.stdout)["image_problems"] == {}
    statuses = json.loads(cli("status", str(run), "--json").stdout)
    got = {s["task"]: (s["state"], s["reward"], s["failure"], s["message"]) for s in statuses}
    assert {task: got[task][:2] for task in got} == {
        "author": ("done", 1.0),
        "built": ("done", 1.0),
    }, got
