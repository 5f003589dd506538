"""A compose task's services through `build`, the manifest, `convert` and `rewrite`, like any
image: a `build:` context is an image of the plan (shared by hash), an `image:` reference is
recorded per task for `convert`, and `rewrite` writes each service's `image:` in the task's
compose file, every other byte kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harbor_hpc.images.build import plan_build
from harbor_hpc.tasks.manifest import (
    ImageRecord,
    Manifest,
    RoleImage,
    load_manifest,
    save_manifest,
)
from harbor_hpc.tasks.rewrite import rewrite_tasks, set_service_image
from tests.tasks.test_manifest_schema import validate

DIGEST = "sha256:" + "d" * 64
COMPOSE = """\
# the task's services
services:
  main:
    depends_on: [api, db]

  api:   # built here
    build:
      context: ./api
    healthcheck:
      test: ["CMD", "true"]
  db:
    image: registry.test/postgres:16  # the author's
"""


def compose_task(root: Path, name: str) -> Path:
    task = root / name
    (task / "environment" / "api").mkdir(parents=True)
    (task / "task.toml").write_text('version = "1.0"\n[environment]\ncpus = 1\n')
    (task / "instruction.md").write_text("x\n")
    (task / "environment" / "Dockerfile").write_text("FROM registry.test/base\n")
    (task / "environment" / "api" / "Dockerfile").write_text(
        "FROM registry.test/base\nCOPY . /app\n"
    )
    (task / "environment" / "docker-compose.yaml").write_text(COMPOSE)
    return task


def test_build_plans_service_contexts_and_references(tmp_path: Path) -> None:
    for name in ("one", "two"):
        compose_task(tmp_path, name)
    plan = plan_build(tmp_path, "localhost:5000/ns")
    services = [image.services for image in plan.images.values() if image.services]
    assert services == [[("one", "api"), ("two", "api")]]  # one context, one image
    assert plan.service_references == {
        "one": {"db": "registry.test/postgres:16"},
        "two": {"db": "registry.test/postgres:16"},
    }
    assert plan.compose == {}


def test_the_manifest_records_service_images_by_task(tmp_path: Path) -> None:
    manifest = Manifest("localhost:5000/ns", str(tmp_path))
    built = ImageRecord("localhost:5000/ns/env-a", "a" * 64, [], DIGEST)
    built.services = [["one", "api"]]
    manifest.set_image("a" * 64, built)
    manifest.tasks["one"].services["db"] = RoleImage(None, "registry.test/postgres:16")
    path = tmp_path / "m.json"
    save_manifest(path, manifest)
    validate(json.loads(path.read_text()))
    again = load_manifest(path)
    assert again.tasks["one"].services == {
        "api": RoleImage("a" * 64, f"localhost:5000/ns/env-a@{DIGEST}"),
        "db": RoleImage(None, "registry.test/postgres:16"),
    }
    assert [(task, service) for task, service, _ in again.author_images()] == [("one", "db")]


def write_manifest(root: Path, *, sif: bool) -> Path:
    manifest = Manifest("localhost:5000/ns", str(root))
    own = ImageRecord("localhost:5000/ns/env-m", "m" * 64, ["one"], DIGEST)
    api = ImageRecord("localhost:5000/ns/env-a", "a" * 64, [], DIGEST)
    api.services = [["one", "api"]]
    if sif:
        own.sif, api.sif = "/store/m.sif", "/store/a.sif"
    manifest.set_image("m" * 64, own)
    manifest.set_image("a" * 64, api)
    db = RoleImage(None, "registry.test/postgres:16", None, "/store/pg.sif" if sif else None)
    manifest.tasks["one"].services["db"] = db
    path = root.parent / f"manifest-{sif}.json"
    save_manifest(path, manifest)
    return path


@pytest.mark.parametrize("sif", [False, True])
def test_rewrite_pins_each_service_in_the_compose_file(tmp_path: Path, sif: bool) -> None:
    root = tmp_path / "tasks"
    task = compose_task(root, "one")
    manifest = write_manifest(root, sif=sif)
    result = rewrite_tasks(root, manifest, sif=sif)
    assert result.changed == ["one"], result
    api = "/store/a.sif" if sif else f"localhost:5000/ns/env-a@{DIGEST}"
    db = "/store/pg.sif" if sif else "registry.test/postgres:16"
    expected = COMPOSE.replace(
        "  api:   # built here\n", f'  api:   # built here\n    image: "{api}"\n'
    ).replace("image: registry.test/postgres:16  # the author's", f'image: "{db}"  # the author\'s')
    if not sif:  # the author's reference stays as they wrote it
        expected = expected.replace(f'image: "{db}"', f"image: {db}")
    assert (task / "environment" / "docker-compose.yaml").read_text() == expected
    assert rewrite_tasks(root, manifest, sif=sif).unchanged == ["one"]


def test_a_service_without_its_image_yet_skips_the_task(tmp_path: Path) -> None:
    root = tmp_path / "tasks"
    compose_task(root, "one")
    path = write_manifest(root, sif=True)
    manifest = load_manifest(path)
    manifest.images["a" * 64].sif = None
    save_manifest(path, manifest)
    result = rewrite_tasks(root, path, sif=True)
    assert result.skipped == {
        "one": "compose service 'api' image: no .sif yet (run `harbor-hpc convert`)"
    }


@pytest.mark.parametrize(
    ("text", "service", "expected"),
    [
        (  # added under the name, at its keys' indent; CRLF kept
            "services:\r\n    web:\r\n        build: .\r\n",
            "web",
            'services:\r\n    web:\r\n        image: "r/x@sha"\r\n        build: .\r\n',
        ),
        (  # the service's own name, not another's key of that name
            "services:\n  main:\n    depends_on:\n      web:\n        condition: x\n"
            "  web:\n    build: .\n",
            "web",
            "services:\n  main:\n    depends_on:\n      web:\n        condition: x\n"
            '  web:\n    image: "r/x@sha"\n    build: .\n',
        ),
        (  # replaced where it is, its comment kept
            "services:\n  web:\n    image: old  # pinned\n    command: run\n",
            "web",
            'services:\n  web:\n    image: "r/x@sha"  # pinned\n    command: run\n',
        ),
    ],
)
def test_set_service_image_changes_that_line_only(text: str, service: str, expected: str) -> None:
    assert set_service_image(text, service, "r/x@sha") == expected


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("services:\n  web: {build: .}\n", "edit it by hand"),
        ("services:\n  web:\n    build: .\n", "no service 'api'"),
    ],
)
def test_set_service_image_refuses_what_it_cannot_edit_in_place(text: str, why: str) -> None:
    service = "api" if "no service" in why else "web"
    with pytest.raises(ValueError, match=why):
        set_service_image(text, service, "r/x@sha")


def test_the_tasks_own_image_finishing_after_its_services_keeps_them(tmp_path: Path) -> None:
    manifest = Manifest("localhost:5000/ns", str(tmp_path))
    api = ImageRecord("localhost:5000/ns/env-a", "a" * 64, [], DIGEST)
    api.services = [["one", "api"]]
    manifest.set_image("a" * 64, api)
    manifest.set_image("m" * 64, ImageRecord("localhost:5000/ns/env-m", "m" * 64, ["one"], DIGEST))
    assert list(manifest.tasks["one"].services) == ["api"]
