"""`build --builder apptainer` end to end, as an ordinary user on a machine where no Docker Engine
answers (DOCKER_HOST points at a dead socket): the suite's build contexts (COPY, RUN shared by
two tasks, multi-stage, USER, a failing RUN) build into the .sif store, `convert` finds nothing
to do, `rewrite --sif` points the tasks at them and they score reward 1 on Slurm; a rerun builds
only the context that changed; the same tasks built by Docker and converted score the same.
With --slurm, the contexts build on compute nodes, one array element each, to the same results.

This machine has no Docker Hub, so the Dockerfiles start FROM the test base image in the test
registry, where Docker (test setup, not harbor-hpc) pushes it once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harbor_hpc.containers.sif import image_config
from harbor_hpc.containers.store import is_ready
from harbor_hpc.runtimes.apptainer import find_apptainer
from harbor_hpc.tasks.manifest import load_manifest
from tests.support.sample_tasks import make_task
from tests.tasks.test_manifest_schema import validate as validate_manifest

# Apptainer's builder, which an enroot cluster does not have (apptainer_only).
pytestmark = [
    pytest.mark.apptainer,
    pytest.mark.apptainer_only,
    pytest.mark.slurm,
    pytest.mark.registry,
    pytest.mark.docker,
]

# Reward 1 when the oracle solved the task and the image is as its Dockerfile says.
TEST_SH = """#!/bin/bash
mkdir -p /logs/verifier
if [ "$(cat /tmp/answer 2>/dev/null)" = "42" ] && {check}; then echo 1 > /logs/verifier/reward.txt
else echo 0 > /logs/verifier/reward.txt; fi
"""
ENTRYPOINT = '["/bin/sh", "-c", ": > /tmp/entrypoint-ran; exec \\"$@\\"", "--"]'


def contexts(base: str, token: str) -> dict[str, tuple[str, dict[str, str], str]]:
    """Task -> (Dockerfile, context files, what its verifier checks in the image)."""
    shared: tuple[str, dict[str, str], str] = (
        f"FROM {base}\nRUN echo {token} > /hello\n",
        {},
        f'[ "$(cat /hello)" = {token} ]',
    )
    return {
        "copy": (
            f'FROM {base}\nWORKDIR /app\nENV GREETING="hello world"\nCOPY data.txt ./\n'
            "COPY sub /opt/sub\nCOPY *.md /docs/\n",
            {
                "data.txt": f"data {token}\n",
                "sub/inner/x": "x\n",
                "a.md": "a\n",
                "b.md": "b\n",
                "skip.md.tmp": "no\n",
                ".dockerignore": "*.tmp\n",
            },
            f'[ "$(cat /app/data.txt)" = "data {token}" ] && [ -L /opt/sub/link ] '
            '&& [ -f /docs/b.md ] && [ "$GREETING" = "hello world" ]',
        ),
        "shared-a": shared,
        "shared-b": shared,
        "multi": (
            f"FROM {base} AS builder\nRUN mkdir /out && echo built > /out/artifact "
            "&& ln -s artifact /out/link\n"
            f"FROM {base}\nCOPY --from=builder /out /srv/\n"
            "COPY --from=builder /out/artifact /single\n",
            {},
            '[ "$(cat /srv/artifact)" = built ] && [ -L /srv/link ] '
            '&& [ "$(cat /single)" = built ]',
        ),
        "user": (
            f"FROM {base}\nRUN useradd -m agent\nWORKDIR /home/agent/w\n"
            "RUN chown agent /home/agent/w\nUSER agent\n"
            "RUN whoami > /tmp/who && echo $HOME >> /tmp/who && touch mine\n"
            f'USER root\nRUN cp /tmp/who /who\nENTRYPOINT {ENTRYPOINT}\nCMD ["sleep", "1"]\n',
            {},
            '[ "$(cat /who)" = "$(printf "agent\\n/home/agent")" ] && [ -e /tmp/entrypoint-ran ]',
        ),
        "fails": (f"FROM {base}\nRUN echo {token} && exit 7\n", {}, "true"),
    }


def make_suite(root: Path, base: str, token: str, names: Collection[str] | None = None) -> None:
    for name, (dockerfile, files, check) in contexts(base, token).items():
        if names is not None and name not in names:
            continue
        task = make_task(root, name, image=None, agent_timeout_sec=60, verifier_timeout_sec=60)
        environment = task / "environment"
        (environment / "Dockerfile").write_text(dockerfile)
        for file, text in files.items():
            (environment / file).parent.mkdir(parents=True, exist_ok=True)
            (environment / file).write_text(text)
        if name == "copy":
            (environment / "sub" / "link").symlink_to("inner/x")
        (task / "tests" / "test.sh").write_text(TEST_SH.format(check=check))


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`harbor-hpc ARGS`."""
    return subprocess.run(
        [sys.executable, "-m", "harbor_hpc", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )


def json_of(done: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(done.stdout)


def submit_and_status(tasks: Path, run_dir: Path, env: dict[str, str]) -> dict[str, Any]:
    """The oracle on every task with an image, on Slurm; each task's (state, reward)."""
    submitted = run_cli(
        "submit", str(tasks), "--agent", "oracle", "--run-dir", str(run_dir),
        "--executor", "slurm", "--concurrency", "2", "--tasks-per-job", "5", "--wait", "--json",
        env=env,
    )  # fmt: skip
    # Exit 1: `fails` has no image (and is not queued); the others ran.
    assert submitted.returncode == 1 and "failures: 1 image" in submitted.stderr, submitted.stderr
    assert list(json_of(submitted)["image_problems"]) == ["fails"]
    statuses = json_of(run_cli("status", str(run_dir), "--json", env=env))
    return {s["task"]: (s["state"], s["reward"], s["message"]) for s in statuses}


@dataclass
class Built:
    root: Path
    tasks: Path
    store: Path
    manifest: Path
    token: str
    base: str
    env: dict[str, str]
    first: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def built(base_image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    root = tmp_path_factory.mktemp("apptainer-build")
    token = uuid.uuid4().hex[:10]
    make_suite(root / "tasks", base_image, token)
    env = {**os.environ, "DOCKER_HOST": f"unix://{root / 'no-docker.sock'}"}
    store, manifest = root / "store", root / "manifest.json"
    first = run_cli(
        "build", str(root / "tasks"), "--builder", "apptainer", "--cache-dir", str(store),
        "--manifest", str(manifest), "--nohttps", "--jobs", "2", "--json", env=env,
    )  # fmt: skip
    yield Built(root, root / "tasks", store, manifest, token, base_image, env, first)


def test_contexts_build_into_the_store_and_a_failed_run_is_named(built: Built) -> None:
    assert built.first.returncode == 1, built.first.stderr
    report = json_of(built.first)
    assert report["builder"] == "apptainer" and report["failed_tasks"] == ["fails"]
    assert "error: 1 task(s) have no image: fails" in built.first.stderr
    actions = sorted(image["action"] for image in report["images"])
    assert actions == ["built into the store"] * 4 + ["failed"]  # shared-a and -b: one image

    validate_manifest(json.loads(built.manifest.read_text()))
    manifest = load_manifest(built.manifest)
    assert manifest.registry == str(built.store)
    records = {task: manifest.image_of(task) for task in manifest.tasks}
    shared = [records[task] for task in ("shared-a", "shared-b")]
    assert shared[0] is not None and shared[1] is not None and shared[0].sif == shared[1].sif
    for task in ("copy", "shared-a", "multi", "user"):
        record = records[task]
        assert record is not None and record.sif and record.sif_sha256
        sif = Path(record.sif)
        assert sif.parent == built.store and sif.name == f"env-{record.tag}.sif"
        assert is_ready(sif)  # what `convert` and the environment trust

    error = manifest.tasks["fails"].error or ""
    assert "Dockerfile line 2: `RUN echo" in error and "returned a non-zero code: 7" in error
    log = Path(error.rsplit("(log: ", 1)[1].rstrip(")"))
    assert built.token in log.read_text()


def test_the_images_config_reaches_the_sif(built: Built) -> None:
    manifest = load_manifest(built.manifest)
    user = manifest.image_of("user")
    copy = manifest.image_of("copy")
    assert user is not None and user.sif and copy is not None and copy.sif
    config = image_config(Path(user.sif))
    assert config is not None
    assert config.entrypoint[:2] == ("/bin/sh", "-c") and config.cmd == ("sleep", "1")
    assert (config.workdir, config.user) == ("/home/agent/w", "root")
    copied = image_config(Path(copy.sif))
    assert copied is not None and copied.env["GREETING"] == "hello world"
    assert copied.workdir == "/app"
    # RUN as USER made files of that user, and the .sif keeps them (root inside, as in Docker).
    stat = [find_apptainer(), "exec", "--fakeroot", user.sif, "stat", "-c", "%U"]
    owner = subprocess.run(
        [*stat, "/home/agent/w/mine"], capture_output=True, text=True, timeout=120, cwd="/"
    )
    assert owner.stdout.split()[-1:] == ["agent"], owner.stderr


@pytest.fixture(scope="module")
def apptainer_results(built: Built) -> dict[str, Any]:
    """`convert` (nothing to do), `rewrite --sif`, then the tasks on Slurm."""
    converted = run_cli(
        "convert", "--manifest", str(built.manifest), "--cache-dir", str(built.store), "--json",
        env=built.env,
    )  # fmt: skip
    report = json_of(converted)
    assert (report["cached"], report["failed"], report.get("converted", 0)) == (4, 1, 0)
    rewritten = run_cli("rewrite", str(built.tasks), "--manifest", str(built.manifest), "--sif",
                        env=built.env)  # fmt: skip
    assert rewritten.returncode == 1 and "fails: left untouched" in rewritten.stderr
    return submit_and_status(built.tasks, built.root / "run", built.env)


def test_the_built_tasks_score_reward_1_on_slurm(apptainer_results: dict[str, Any]) -> None:
    assert {task: got[:2] for task, got in apptainer_results.items()} == {
        **{task: ("done", 1.0) for task in ("copy", "shared-a", "shared-b", "multi", "user")},
        "fails": ("failed", None),
    }, apptainer_results


def test_docker_builds_converted_give_the_same_results(
    built: Built, apptainer_results: dict[str, Any]
) -> None:
    tasks = built.root / "docker-tasks"
    make_suite(tasks, built.base, built.token)
    namespace = f"{os.environ['HARBOR_HPC_TEST_REGISTRY']}/apptainer-cmp-{built.token}"
    manifest, store = built.root / "docker.json", built.root / "docker-store"
    env = {key: value for key, value in os.environ.items() if key != "DOCKER_HOST"}
    steps = [
        ["build", str(tasks), "--builder", "docker", "--registry", namespace, "--manifest",
         str(manifest)],
        ["convert", "--manifest", str(manifest), "--cache-dir", str(store), "--nohttps"],
        ["rewrite", str(tasks), "--manifest", str(manifest), "--sif"],
    ]  # fmt: skip
    for step in steps:  # each fails the failing context only, as the Apptainer builder does
        done = run_cli(*step, env=env)
        assert done.returncode == 1 and "fails" in done.stderr, f"{step[0]}: {done.stderr}"
    assert "returned a non-zero code: 7" in (load_manifest(manifest).tasks["fails"].error or "")
    docker = submit_and_status(tasks, built.root / "docker-run", env)
    assert {t: r[:2] for t, r in docker.items()} == {
        t: r[:2] for t, r in apptainer_results.items()
    }, docker


def test_a_rerun_builds_only_the_context_that_changed(built: Built) -> None:
    (built.tasks / "copy" / "environment" / "data.txt").write_text("changed\n")
    again = run_cli(
        "build", str(built.tasks), "--builder", "apptainer", "--cache-dir", str(built.store),
        "--manifest", str(built.manifest), "--nohttps", "--json", env=built.env,
    )  # fmt: skip
    assert again.returncode == 1, again.stderr
    actions = sorted(image["action"] for image in json_of(again)["images"])
    assert actions == ["already in the store"] * 3 + ["built into the store", "failed"]


def test_contexts_build_on_slurm_nodes_and_score_reward_1(base_image: str, tmp_path: Path) -> None:
    """`--slurm`: one array element per context (two tasks share one; a failing one beside it;
    the other contexts' translation is tested locally), every element's record in the
    manifest, a rerun queues only the failed one, and the tasks score on Slurm."""
    token = uuid.uuid4().hex[:10]
    tasks = tmp_path / "tasks"
    make_suite(tasks, base_image, token, names=("shared-a", "shared-b", "fails"))
    env = {**os.environ, "DOCKER_HOST": f"unix://{tmp_path / 'no-docker.sock'}"}
    store, manifest = tmp_path / "store", tmp_path / "manifest.json"
    command = [
        "build", str(tasks), "--builder", "apptainer", "--slurm", "--cache-dir", str(store),
        "--manifest", str(manifest), "--nohttps", "--time", "20", "--json",
    ]  # fmt: skip
    first = run_cli(*command, env=env)
    assert first.returncode == 1 and "error: 1 task(s) have no image: fails" in first.stderr
    assert "Slurm array job" in first.stderr and "2 context(s)" in first.stderr, first.stderr
    actions = sorted(image["action"] for image in json_of(first)["images"])
    assert actions == ["built into the store", "failed"], first.stdout

    validate_manifest(json.loads(manifest.read_text()))
    built = load_manifest(manifest)
    for task in ("shared-a", "shared-b"):
        record = built.image_of(task)
        assert record is not None and record.sif and record.sif_sha256, task
        assert is_ready(Path(record.sif))
    error = built.tasks["fails"].error or ""
    assert "Dockerfile line 2: `RUN echo" in error and "returned a non-zero code: 7" in error
    assert token in Path(error.rsplit("(log: ", 1)[1].rstrip(")")).read_text()

    again = run_cli(*command, env=env)
    assert again.returncode == 1 and "1 context(s)" in again.stderr, again.stderr
    actions = sorted(image["action"] for image in json_of(again)["images"])
    assert actions == ["already in the store", "failed"], again.stdout

    docker = run_cli(*command[:2], "--builder", "docker", *command[4:], env=env)
    assert docker.returncode == 2 and "--slurm builds with Apptainer" in docker.stderr

    rewritten = run_cli("rewrite", str(tasks), "--manifest", str(manifest), "--sif", env=env)
    assert rewritten.returncode == 1 and "fails: left untouched" in rewritten.stderr
    results = submit_and_status(tasks, tmp_path / "run", env)
    assert {task: got[:2] for task, got in results.items()} == {
        **{task: ("done", 1.0) for task in ("shared-a", "shared-b")},
        "fails": ("failed", None),
    }, results
