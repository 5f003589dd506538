"""`build` against the real Docker Engine and both test registries, plus its planning alone.

The integration suite builds three tiny images once per module (a shared context, a context with
a .dockerignore and a COPY, and one whose RUN fails) and checks everything on them.
"""

from __future__ import annotations

import base64
import json
import os
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from harbor_hpc.core.errors import InputError
from harbor_hpc.images.build import (
    _HASH_BATCH,
    _PARALLEL_HASH_MIN,
    parse_build_args,
    plan_build,
    run_build,
)
from harbor_hpc.images.docker_builder import DockerBuilder
from harbor_hpc.images.registry import Registry
from harbor_hpc.tasks.manifest import load_manifest
from tests.tasks.test_manifest_schema import validate as validate_manifest

BASE = os.environ.get("HARBOR_HPC_TEST_BASE_IMAGE", "local/debian:bookworm")


def make_task(root: Path, rel: str, dockerfile: str, files: dict[str, str] | None = None) -> None:
    env = root / rel / "environment"
    env.mkdir(parents=True)
    (root / rel / "task.toml").write_text(
        f'# task {rel}\nversion = "1.0"\n\n[environment]\ncpus = 1  # one core\n\n'
        "[verifier]\ntimeout_sec = 60.0\n"
    )
    (env / "Dockerfile").write_text(dockerfile)
    for name, text in (files or {}).items():
        (env / name).write_text(text)


def make_suite(root: Path, token: str) -> None:
    for name in ("t1", "t2", "t3"):
        make_task(root, f"shared/{name}", f"FROM {BASE}\nRUN echo {token} > /hello\n")
    for name, log in (("a", "first run"), ("b", "second run")):
        make_task(
            root,
            f"copy/{name}",
            f"FROM {BASE}\nCOPY data.txt /data.txt\n",
            {"data.txt": f"data {token}\n", ".dockerignore": "*.log\n", "run.log": log},
        )
    make_task(root, "fails", f"FROM {BASE}\nRUN echo {token} && exit 7\n")


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "harbor_hpc", *args], env=env, capture_output=True, text=True
    )


# ---- planning only: no Docker needed -------------------------------------------------------


def test_plan_groups_tasks_by_context(tmp_path: Path) -> None:
    root = tmp_path / "tasks"
    make_suite(root, "plan")
    make_task(root, "outside", "FROM base\nCOPY ../../secret /s\n")
    (root / "broken").mkdir()
    (root / "broken" / "task.toml").write_text("[environment\n")
    plan = plan_build(root, "localhost:5000/ns")
    groups = sorted(image.tasks for image in plan.images.values())
    assert groups == [["copy/a", "copy/b"], ["fails"], ["shared/t1", "shared/t2", "shared/t3"]]
    for key, image in plan.images.items():
        assert image.repository == f"localhost:5000/ns/env-{key[:12]}" and image.tag == key
    assert "COPY ../../secret reaches outside the build context" in plan.task_errors["outside"]
    assert [problem.path.name for problem in plan.problems] == ["task.toml"]
    assert plan.task_count == 7


def test_parallel_hashing_plans_the_same(tmp_path: Path) -> None:
    """Hashed in worker processes, in batches sent while the walk goes on, the plan is the one
    hashed here."""
    root = tmp_path / "tasks"
    for index in range(_PARALLEL_HASH_MIN + 2 * _HASH_BATCH + 7):
        make_task(root, f"t{index:04d}", f"FROM base\nRUN echo {index % 3}\n")
    sequential, parallel = (
        plan_build(root, "localhost:5000/ns", jobs=1),
        plan_build(root, "localhost:5000/ns", jobs=2),
    )
    assert len(parallel.images) == 3
    assert {k: v.tasks for k, v in sequential.images.items()} == {
        k: v.tasks for k, v in parallel.images.items()
    }


def test_dry_run_prints_the_plan_and_touches_nothing(tmp_path: Path) -> None:
    root = tmp_path / "tasks"
    make_suite(root, "dry")
    manifest = tmp_path / "m.json"
    result = run_cli(
        "build", str(root), "--registry", "localhost:5000/ns", "--manifest", str(manifest),
        "--dry-run", "--json", env=dict(os.environ),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert (plan["tasks"], plan["contexts"]) == (6, 3)
    assert not manifest.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tasks"]


# Builds only with BASE_IMAGE given: its default is an image no test machine has.
ARG_DOCKERFILE = (
    "ARG BASE_IMAGE=unreachable.invalid/none:1\nFROM $BASE_IMAGE\nARG GREETING=hi\n"
    "RUN echo $GREETING > /greeting\n"
)


def test_build_args_split_only_the_contexts_that_declare_them(tmp_path: Path) -> None:
    root = tmp_path / "tasks"
    make_task(root, "plain", "FROM base\nRUN true\n")
    make_task(root, "greets", ARG_DOCKERFILE)
    before = plan_build(root, "localhost:5000/ns")
    after = plan_build(root, "localhost:5000/ns", build_args={"GREETING": "yo", "OTHER": "1"})
    images = {image.tasks[0]: image for image in after.images.values()}
    assert images["plain"].context in before.images and images["plain"].build_args == {}
    assert images["greets"].context not in before.images
    assert images["greets"].build_args == {"GREETING": "yo"}
    assert after.build_args == {"GREETING": "yo", "OTHER": "1"}  # all of them reach Docker


def test_build_args_are_name_equals_value() -> None:
    assert parse_build_args(["A=1", "B=x=y", "A=2", "C="]) == {"A": "2", "B": "x=y", "C": ""}
    for bad in ("A", "=1", "1A=2"):
        with pytest.raises(InputError, match="is not NAME=VALUE"):
            parse_build_args([bad])


def test_docker_login_is_read_from_docker_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = base64.b64encode(b"someone:s3cret").decode()
    (tmp_path / "config.json").write_text(
        json.dumps({"auths": {"reg.example:5000": {"auth": secret}}})
    )
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    assert Registry("reg.example:5000").logged_in
    assert not Registry("other.example").logged_in


# ---- the real Docker Engine and registries -------------------------------------------------


@dataclass
class Built:
    root: Path
    manifest: Path
    namespace: str
    token: str
    env: dict[str, str]
    first: subprocess.CompletedProcess[str]


def docker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    """The suite built once into the open registry, in a namespace of its own."""
    base = tmp_path_factory.mktemp("build")
    token = uuid.uuid4().hex[:10]
    make_suite(base / "tasks", token)
    config = base / "docker-config"
    config.mkdir()
    env = {**os.environ, "DOCKER_CONFIG": str(config)}
    namespace = f"{os.environ['HARBOR_HPC_TEST_REGISTRY']}/build-test-{token}"
    manifest = base / "manifest.json"
    first = run_cli(
        "build", str(base / "tasks"), "--registry", namespace, "--manifest", str(manifest),
        "--jobs", "2", "--json", env=env,
    )  # fmt: skip
    yield Built(base / "tasks", manifest, namespace, token, env, first)
    images = docker("images", "--format", "{{.Repository}}:{{.Tag}}").stdout.split()
    mine = [image for image in images if f"build-test-{token}" in image]
    if mine:
        docker("rmi", "-f", *mine)


@pytest.mark.docker
@pytest.mark.registry
def test_identical_contexts_share_one_pushed_image(built: Built) -> None:
    assert built.first.returncode == 1, built.first.stderr
    report = json.loads(built.first.stdout)
    assert report["failed_tasks"] == ["fails"]
    assert "error: 1 task(s) have no image: fails" in built.first.stderr
    actions = sorted(image["action"] for image in report["images"])
    assert actions == ["built and pushed", "built and pushed", "failed"]

    validate_manifest(json.loads(built.manifest.read_text()))
    manifest = load_manifest(built.manifest)
    refs = {task: record.image for task, record in manifest.tasks.items()}
    assert refs["shared/t1"] == refs["shared/t2"] == refs["shared/t3"]
    assert refs["copy/a"] == refs["copy/b"]  # differ only in a .dockerignored file
    assert refs["shared/t1"] != refs["copy/a"]
    for task in ("shared/t1", "copy/a"):
        assert (refs[task] or "").startswith(f"{built.namespace}/env-")
        assert "@sha256:" in (refs[task] or "")
    assert refs["fails"] is None
    error = manifest.tasks["fails"].error or ""
    assert "returned a non-zero code: 7" in error
    log = Path(error.rsplit("(log: ", 1)[1].rstrip(")"))
    assert built.token in log.read_text()


@pytest.mark.docker
@pytest.mark.registry
def test_pinned_references_pull_and_run(built: Built) -> None:
    manifest = load_manifest(built.manifest)
    for task, command, expected in (
        ("shared/t2", "cat /hello", built.token),
        ("copy/b", "cat /data.txt", f"data {built.token}"),
    ):
        reference = manifest.tasks[task].image or ""
        docker("rmi", "-f", reference)
        assert docker("pull", reference).returncode == 0
        run = docker("run", "--rm", reference, "sh", "-c", command)
        assert run.stdout.strip() == expected, run.stderr


@pytest.mark.docker
@pytest.mark.registry
def test_rerun_builds_nothing_even_without_local_images(built: Built, tmp_path: Path) -> None:
    manifest = load_manifest(built.manifest)
    pushed = [image for image in manifest.images.values() if image.digest]
    docker("rmi", "-f", *[image.tagged for image in pushed], *[str(i.reference) for i in pushed])
    os.environ["DOCKER_CONFIG"] = built.env["DOCKER_CONFIG"]
    try:
        plan = plan_build(built.root, built.namespace)
        for manifest_path, expected in (
            (built.manifest, "already in the registry"),  # the manifest's digest still resolves
            (tmp_path / "fresh.json", "found in the registry"),  # a new manifest: by content tag
        ):
            result = run_build(plan, manifest_path, DockerBuilder(plan))
            actions = sorted(outcome.action for outcome in result.outcomes)
            assert actions == sorted([expected, expected, "failed"])  # only the failed one again
        fresh = load_manifest(tmp_path / "fresh.json")
        assert fresh.tasks["shared/t1"].image == manifest.tasks["shared/t1"].image
    finally:
        del os.environ["DOCKER_CONFIG"]
    assert all(docker("image", "inspect", image.tagged).returncode != 0 for image in pushed), (
        "a rerun must not rebuild"
    )


@pytest.mark.docker
@pytest.mark.registry
def test_rewrite_changes_only_the_docker_image_line(built: Built) -> None:
    before = {
        task: (built.root / task / "task.toml").read_text() for task in ("shared/t1", "fails")
    }
    result = run_cli("rewrite", str(built.root), "--manifest", str(built.manifest), env=built.env)
    assert result.returncode == 1  # the failed task is left out, and says so
    assert "fails: left untouched: build failed" in result.stderr
    reference = load_manifest(built.manifest).tasks["shared/t1"].image
    after = (built.root / "shared/t1/task.toml").read_text().splitlines()
    old = before["shared/t1"].splitlines()
    assert [line for line in after if line not in old] == [f'docker_image = "{reference}"']
    assert [line for line in after if not line.startswith("docker_image")] == old
    assert (built.root / "fails/task.toml").read_text() == before["fails"]
    again = run_cli("rewrite", str(built.root), "--manifest", str(built.manifest), env=built.env)
    assert "pointed 0 task(s) at their images; 5 already pointed there" in again.stderr


@pytest.mark.docker
@pytest.mark.registry
def test_password_registry_works_after_login_and_fails_clearly_without(
    built: Built, tmp_path: Path
) -> None:
    host = os.environ["HARBOR_HPC_TEST_AUTH_REGISTRY"]
    user = os.environ["HARBOR_HPC_TEST_AUTH_USER"]
    password = os.environ["HARBOR_HPC_TEST_AUTH_PASSWORD"]
    config = tmp_path / "docker-config"
    config.mkdir()
    env = {**os.environ, "DOCKER_CONFIG": str(config)}
    manifest = tmp_path / "auth.json"
    args = ["build", str(built.root / "shared"), "--registry", f"{host}/build-test-{built.token}"]
    args += ["--manifest", str(manifest)]

    refused = run_cli(*args, env=env)
    assert refused.returncode == 1
    assert f"registry {host} asks for a login" in refused.stderr
    assert f"docker login {host}" in refused.stderr
    assert "Traceback" not in refused.stderr and not manifest.exists()

    wrong = base64.b64encode(f"{user}:wrong".encode()).decode()
    (config / "config.json").write_text(json.dumps({"auths": {host: {"auth": wrong}}}))
    assert "refused the credentials" in run_cli(*args, env=env).stderr
    (config / "config.json").unlink()

    login = subprocess.run(
        ["docker", "--config", str(config), "login", host, "-u", user, "--password-stdin"],
        input=password, capture_output=True, text=True,
    )  # fmt: skip
    assert login.returncode == 0, login.stderr
    pushed = run_cli(*args, "--json", env=env)
    assert pushed.returncode == 0, pushed.stderr
    reference = load_manifest(manifest).tasks["t1"].image or ""
    assert reference.startswith(f"{host}/build-test-{built.token}/env-")
    secrets = (password, base64.b64encode(f"{user}:{password}".encode()).decode())
    written = [manifest.read_text(), pushed.stdout, pushed.stderr]
    written += [log.read_text() for log in tmp_path.glob("*.build-logs/*.log")]
    assert not any(secret in text for secret in secrets for text in written)
    (logs,) = tmp_path.glob("*.build-logs")
    assert stat.S_IMODE(logs.stat().st_mode) == 0o700  # what builds print is the user's alone


@pytest.mark.docker
@pytest.mark.registry
def test_no_push_records_local_images_that_rewrite_leaves_alone(
    built: Built, tmp_path: Path
) -> None:
    manifest_path = tmp_path / "local.json"
    plan = plan_build(built.root / "shared", built.namespace)
    first = run_build(plan, manifest_path, DockerBuilder(plan, push=False))
    again = run_build(plan, manifest_path, DockerBuilder(plan, push=False))
    assert [outcome.action for outcome in again.outcomes] == ["already built locally"]
    record = first.outcomes[0].record
    assert record.image_id and record.image_id.startswith("sha256:") and record.reference is None
    rewrite = run_cli("rewrite", str(built.root / "shared"), "--manifest", str(manifest_path),
                      "--json", env=built.env)  # fmt: skip
    assert rewrite.returncode == 1
    assert "--no-push" in json.loads(rewrite.stdout)["skipped"]["t1"]


@pytest.mark.docker
@pytest.mark.registry
def test_build_args_reach_the_build_and_the_manifest(tmp_path: Path) -> None:
    token = uuid.uuid4().hex[:10]
    root = tmp_path / "tasks"
    make_task(root, "greets", ARG_DOCKERFILE)
    config = tmp_path / "harbor-hpc.toml"
    config.write_text(f'build_args = ["BASE_IMAGE={BASE}", "GREETING=from-config"]\n')
    (tmp_path / "docker-config").mkdir()
    env = {**os.environ, "DOCKER_CONFIG": str(tmp_path / "docker-config")}
    env["HARBOR_HPC_CONFIG"] = str(config)
    namespace = f"{os.environ['HARBOR_HPC_TEST_REGISTRY']}/build-args-{token}"
    manifest = tmp_path / "manifest.json"
    result = run_cli(
        "build", str(root), "--registry", namespace, "--manifest", str(manifest),
        "--build-arg", f"GREETING={token}", "--json", env=env,
    )  # fmt: skip
    try:
        assert result.returncode == 0, result.stderr
        validate_manifest(json.loads(manifest.read_text()))
        record = next(iter(load_manifest(manifest).images.values()))
        assert record.build_args == {"BASE_IMAGE": BASE, "GREETING": token}
        reference = str(record.reference)
        assert docker("pull", reference).returncode == 0
        run = docker("run", "--rm", reference, "cat", "/greeting")
        assert run.stdout.strip() == token, run.stderr
    finally:
        images = docker("images", "--format", "{{.Repository}}:{{.Tag}}").stdout.split()
        mine = [image for image in images if f"build-args-{token}" in image]
        if mine:
            docker("rmi", "-f", *mine)
