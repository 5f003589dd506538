"""`manifests/manifest.schema.json` describes exactly what `manifest.py` writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from harbor_hpc.tasks.manifest import ImageRecord, Manifest, TaskRecord, save_manifest

jsonschema = pytest.importorskip("jsonschema")

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"
CONTEXT = "0123456789abcdef" * 4
DIGEST = "sha256:" + "f" * 64


def validate(data: Any) -> None:
    schema = json.loads((MANIFESTS / "manifest.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(data, schema, cls=jsonschema.Draft202012Validator)


def test_example_is_valid() -> None:
    validate(json.loads((MANIFESTS / "example.json").read_text()))


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
    data = json.loads((MANIFESTS / "example.json").read_text())
    next(iter(data["images"].values()))["digest"] = "latest"
    with pytest.raises(jsonschema.ValidationError):
        validate(data)
