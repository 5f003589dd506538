import json
import multiprocessing
from pathlib import Path

import pytest

from harbor_hpc.core.errors import InputError
from harbor_hpc.tasks.manifest import ImageRecord, Manifest, load_manifest, update_manifest


def test_round_trip_and_task_view(tmp_path: Path) -> None:
    path = tmp_path / "manifest.json"
    with update_manifest(path, create=Manifest("reg/ns", str(tmp_path))) as manifest:
        manifest.set_image(
            "h1", ImageRecord("reg/ns/env", "h1", ["a", "b"], digest="sha256:" + "0" * 64)
        )
        manifest.set_image("h2", ImageRecord("reg/ns/env", "h2", ["c"], error="RUN failed"))
    loaded = load_manifest(path)
    assert loaded.tasks["a"].image == "reg/ns/env@sha256:" + "0" * 64
    assert loaded.tasks["c"].error == "RUN failed" and loaded.tasks["c"].image is None
    image = loaded.image_of("b")
    assert image is not None and image.tagged == "reg/ns/env:h1"
    assert json.loads(path.read_text())["images"]["h1"]["reference"] == image.reference


def _add_sif(path: str, key: str) -> None:
    with update_manifest(Path(path)) as manifest:
        manifest.images[key].sif = f"/cache/{key}.sif"


def test_concurrent_updates_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "manifest.json"
    keys = [f"h{i}" for i in range(8)]
    with update_manifest(path, create=Manifest("reg/ns", str(tmp_path))) as manifest:
        for key in keys:
            manifest.set_image(key, ImageRecord("reg/ns/env", key, [key]))
    ctx = multiprocessing.get_context("spawn")  # fork is unsafe once threads run
    procs = [ctx.Process(target=_add_sif, args=(str(path), key)) for key in keys]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(30)
    assert {k: v.sif for k, v in load_manifest(path).images.items()} == {
        key: f"/cache/{key}.sif" for key in keys
    }


def test_not_a_manifest(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text('{"hello": 1}')
    with pytest.raises(InputError, match="not a harbor-hpc manifest"):
        load_manifest(path)
