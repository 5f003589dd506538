"""`manifests/manifest.schema.json` describes exactly what `manifest.py` writes, and every
example beside it is a manifest both the schema and the model read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from harbor_hpc.core.errors import InputError
from harbor_hpc.core.templates import read_template, template_path
from harbor_hpc.tasks.manifest import (
    ImageRecord,
    Manifest,
    TaskRecord,
    load_manifest,
    save_manifest,
)

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = "manifest.schema.json"
MANIFESTS = template_path(SCHEMA, "manifests").parent
EXAMPLES = sorted(path for path in MANIFESTS.glob("*.json") if path.name != SCHEMA)
# Written by hand: shared images, separate verifiers (one built, one an author's), failures.
EXAMPLE = MANIFESTS / "verifiers-and-failures.json"
CONTEXT = "0123456789abcdef" * 4
DIGEST = "sha256:" + "f" * 64


def validate(data: Any) -> None:
    schema = json.loads(read_template(SCHEMA, "manifests"))
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(data, schema, cls=jsonschema.Draft202012Validator)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda path: path.name)
def test_every_example_is_valid_and_the_model_reads_it(example: Path) -> None:
    data = json.loads(example.read_text())
    validate(data)
    manifest = load_manifest(example)
    assert (set(manifest.images), set(manifest.tasks)) == (set(data["images"]), set(data["tasks"]))


@pytest.mark.parametrize("name", ["quickstart-docker.json", "quickstart-apptainer.json"])
def test_the_quickstart_examples_are_what_build_writes_today(name: str) -> None:
    """What `build` (with Docker, then `convert`; or with Apptainer) wrote for examples/tasks:
    the model writes them back unchanged. A new field fails here: build them again (docs/
    architecture.md says how)."""
    example = MANIFESTS / name
    assert load_manifest(example).to_json() == json.loads(example.read_text())


def test_a_written_manifest_is_valid(tmp_path: Path) -> None:
    manifest = Manifest("localhost:5000/ns", str(tmp_path))
    pushed = ImageRecord(f"localhost:5000/ns/env-{CONTEXT[:12]}", CONTEXT, ["a", "b"], DIGEST)
    pushed.sif, pushed.image_id = "/sif/a.sif", DIGEST
    manifest.set_image(CONTEXT, pushed)
    failed = ImageRecord("localhost:5000/ns/env-x", "e" * 64, ["c"], error="build failed: RUN")
    manifest.set_image("e" * 64, failed)
    manifest.tasks["d"] = TaskRecord(None, None, "COPY ../x reaches outside the build context")
    path = tmp_path / "manifest.json"
    save_manifest(path, manifest)
    validate(json.loads(path.read_text()))


def test_the_schema_rejects_what_the_model_never_writes(tmp_path: Path) -> None:
    data = json.loads(EXAMPLE.read_text())
    next(iter(data["images"].values()))["digest"] = "latest"
    with pytest.raises(jsonschema.ValidationError):
        validate(data)


IMAGE = "944228b255e444a29b1757fa422bc9bfecbdbef5d0b4f8d12cdcaeedef52ca58"
VERIFIER_IMAGE = "fc4e805594edd8917be15e68e431b5a386394f4f62679907f1da6316e2701a07"
TASK = "scientific_computing/task-001"


def edited_example(path: tuple[str, ...], value: object) -> Any:
    """The example manifest with the value at `path` (keys, outermost first) set to `value`."""
    data = json.loads(EXAMPLE.read_text())
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return data


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("registry",), ""),
        (("updated_at",), None),
        (("images",), []),
        (("images", IMAGE), "an image"),
        (("images", IMAGE, "digest"), "latest"),
        (("images", IMAGE, "digest"), "sha256:" + "0" * 63),
        (("images", IMAGE, "image_id"), 42),
        (("images", IMAGE, "tasks"), [TASK, 1]),
        (("images", IMAGE, "verifier_tasks"), TASK),
        (("images", IMAGE, "build_args"), {"A": 1}),
        (("images", IMAGE, "sif"), False),
        (("tasks", TASK, "image"), "localhost:5000/ns/env@latest"),
        (("tasks", TASK, "image"), "localhost:5000/ns/env:tag"),
        (("tasks", TASK, "error"), ["RUN failed"]),
        (("tasks", TASK, "verifier"), "separate"),
        (("tasks", TASK, "verifier", "image"), ["ns/env"]),
        (("tasks", TASK, "verifier", "sif"), 1),
    ],
)
def test_the_loader_refuses_what_the_schema_refuses(
    tmp_path: Path, path: tuple[str, ...], value: object
) -> None:
    """Hand edits the schema rejects are refused on loading too, naming the entry and value."""
    data = edited_example(path, value)
    with pytest.raises(jsonschema.ValidationError):
        validate(data)
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps(data))
    with pytest.raises(InputError) as refused:
        load_manifest(manifest)
    assert refused.value.message.startswith(f"{manifest}: ")
    assert ".".join(path[1:]) in refused.value.message and repr(value) in refused.value.message
    assert "\n" not in refused.value.message


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("images", IMAGE, "repository"), "reg/ns/env@x"),  # the schema checks `reference`
        (("tasks", TASK, "verifier", "image"), "reg/ns/env@sha256:xyz"),  # built: pinned
    ],
)
def test_the_loader_checks_the_references_it_builds_on(
    tmp_path: Path, path: tuple[str, ...], value: str
) -> None:
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps(edited_example(path, value)))
    with pytest.raises(InputError, match=r"is not a (repository|pinned reference)"):
        load_manifest(manifest)


def test_a_missing_field_is_named(tmp_path: Path) -> None:
    data = json.loads(EXAMPLE.read_text())
    del data["tasks"][TASK]["error"]
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps(data))
    with pytest.raises(InputError, match=f"tasks.{TASK} has no 'error'"):
        load_manifest(manifest)


def test_the_loader_reads_the_example(tmp_path: Path) -> None:
    manifest = load_manifest(EXAMPLE)
    assert manifest.tasks[TASK].verifier is not None
    assert manifest.images[VERIFIER_IMAGE].verifier_tasks
