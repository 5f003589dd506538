"""fetch against a loopback hub: the real huggingface_hub client downloads, fetch places."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from harbor_hpc.core.errors import HarborHpcError, InputError
from harbor_hpc.fetch import Hub, fetch, plan_fetch
from harbor_hpc.fetch.place import STATE_FILE
from tests.fetch.test_unpack import HONEST, Entry, write_tar, write_zip
from tests.support.fakehub import FakeHub, dead_endpoint
from tests.support.hub_data import REPO_ID, write_task_archive

MIXED = "skill_based/mixed/*.tar.gz"


def _snapshot(root: Path) -> dict[str, int]:
    """Every path under `root` (hidden lock file aside) with its mtime, to prove nothing moved."""
    return {
        str(path.relative_to(root)): path.lstat().st_mtime_ns
        for path in root.rglob("*")
        if path.name != ".harbor-hpc-fetch.lock"
    }


def test_subset_lands_as_task_folders_and_only_it_moves(
    fake_hub: FakeHub, hub: Hub, tmp_path: Path
) -> None:
    dest = tmp_path / "tasks"

    report = fetch(REPO_ID, dest, include=[MIXED], hub=hub)

    assert report.unpacked == [
        "skill_based/mixed/data_science.tar.gz",
        "skill_based/mixed/scientific_computing.tar.gz",
    ]
    assert report.tasks == [
        "skill_based/mixed/data_science/clean-csv",
        "skill_based/mixed/scientific_computing/fit-curve",
        "skill_based/mixed/scientific_computing/solve-ode",
    ]
    assert report.tasks_by_folder() == {"skill_based": 3}
    assert sorted(fake_hub.downloads()) == report.unpacked
    touched = {path for _method, path in fake_hub.requests}
    assert not any("security.tgz" in path or "README" in path for path in touched)
    solve = dest / "skill_based/mixed/scientific_computing/fit-curve/solution/solve.sh"
    assert os.access(solve, os.X_OK)
    assert not (dest / "skill_based/easy").exists()


def test_rerun_touches_nothing(fake_hub: FakeHub, hub: Hub, tmp_path: Path) -> None:
    dest = tmp_path / "tasks"
    fetch(REPO_ID, dest, hub=hub)
    before = _snapshot(dest)
    downloads = len(fake_hub.downloads())

    again = fetch(REPO_ID, dest, hub=hub)

    assert again.unpacked == [] and again.files_placed == []
    assert len(again.unchanged) == 3 and again.files_unchanged == ["README.md"]
    assert len(fake_hub.downloads()) == downloads, "nothing downloaded twice"
    assert _snapshot(dest) == before
    assert len(again.tasks) == 4


def test_changed_archive_replaces_its_folder(
    fake_hub: FakeHub, hub: Hub, dataset: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "tasks"
    fetch(REPO_ID, dest, include=[MIXED], hub=hub)
    write_task_archive(
        dataset / "skill_based/mixed/scientific_computing.tar.gz", ["fit-curve"], flavour=" v2"
    )

    report = fetch(REPO_ID, dest, include=[MIXED], hub=hub)

    assert report.unpacked == ["skill_based/mixed/scientific_computing.tar.gz"]
    assert report.unchanged == ["skill_based/mixed/data_science.tar.gz"]
    folder = dest / "skill_based/mixed/scientific_computing"
    assert sorted(p.name for p in folder.iterdir()) == ["fit-curve"], "old content gone"
    assert (folder / "fit-curve/instruction.md").read_text() == "Do fit-curve v2.\n"
    assert not list(dest.glob(".harbor-hpc-staging-*"))


def test_interrupted_unpack_is_redone(hub: Hub, tmp_path: Path) -> None:
    """A run that died between marking an archive pending and finishing it is redone."""
    dest = tmp_path / "tasks"
    fetch(REPO_ID, dest, include=[MIXED], hub=hub)
    state_path = dest / STATE_FILE
    state = json.loads(state_path.read_text())
    state["archives"]["skill_based/mixed/data_science.tar.gz"]["sha256"] = None
    state_path.write_text(json.dumps(state))
    (dest / ".harbor-hpc-staging-dead").mkdir()

    report = fetch(REPO_ID, dest, include=[MIXED], hub=hub)

    assert report.unpacked == ["skill_based/mixed/data_science.tar.gz"]
    assert not (dest / ".harbor-hpc-staging-dead").exists()


@pytest.mark.parametrize(
    ("name", "entries"),
    [
        ("dotdot.tar.gz", [*HONEST, Entry("../../../escaped")]),
        ("abs.tgz", [*HONEST, Entry("/tmp/harbor-hpc-escaped")]),
        ("link.tar", [Entry("out", "symlink", target="../../.."), Entry("out/escaped")]),
        ("fifo.tar.gz", [*HONEST, Entry("pkg/pipe", "fifo")]),
        ("link.zip", [*HONEST, Entry("pkg/up", "symlink", target="../../..")]),
    ],
)
def test_hostile_archive_is_refused_and_others_go_on(
    name: str, entries: list[Entry], dataset: Path, hf_cache: Path, tmp_path: Path
) -> None:
    hostile = dataset / "skill_based/mixed" / name
    (write_zip if name.endswith(".zip") else write_tar)(hostile, entries)
    dest = tmp_path / "tasks"

    with FakeHub(dataset, REPO_ID) as served:
        report = fetch(
            REPO_ID,
            dest,
            include=["skill_based/mixed/*"],
            hub=Hub(endpoint=served.url, cache_dir=hf_cache),
        )

    [failure] = report.failed
    assert failure.path == f"skill_based/mixed/{name}"
    assert failure.member is not None and failure.member in failure.message
    assert len(report.unpacked) == 2 and len(report.tasks) == 3
    written = {p.relative_to(dest).as_posix() for p in dest.rglob("*")}
    assert not any("pkg" in path or "escaped" in path for path in written)
    assert not (tmp_path / "escaped").exists()
    assert not list(dest.glob(".harbor-hpc-staging-*"))


def test_foreign_folder_is_not_replaced(hub: Hub, tmp_path: Path) -> None:
    dest = tmp_path / "tasks"
    mine = dest / "skill_based/mixed/data_science"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine\n")

    report = fetch(REPO_ID, dest, include=[MIXED], hub=hub)

    assert [f.path for f in report.failed] == ["skill_based/mixed/data_science.tar.gz"]
    assert "did not create" in report.failed[0].message
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    assert report.unpacked == ["skill_based/mixed/scientific_computing.tar.gz"]


def test_dry_run_writes_nothing(fake_hub: FakeHub, hub: Hub, tmp_path: Path) -> None:
    dest = tmp_path / "tasks"

    plan = plan_fetch(REPO_ID, dest, include=[MIXED, "README.md"], hub=hub)

    assert [(s.path, s.action) for s in plan.steps] == [
        ("README.md", "copy to README.md"),
        ("skill_based/mixed/data_science.tar.gz", "download and unpack into skill_based/mixed/"),
        (
            "skill_based/mixed/scientific_computing.tar.gz",
            "download and unpack into skill_based/mixed/",
        ),
    ]
    assert not dest.exists()
    assert fake_hub.downloads() == []

    fetch(REPO_ID, dest, include=[MIXED], hub=hub)
    again = plan_fetch(REPO_ID, dest, include=[MIXED], hub=hub)
    assert {s.action for s in again.steps} == {"skip: already unpacked, unchanged"}
    assert {s.to_json()["state"] for s in again.steps} == {"skipped"}


def test_no_file_matches_is_bad_input(hub: Hub, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no file matches --include nowhere/"):
        fetch(REPO_ID, tmp_path / "tasks", include=["nowhere/"], hub=hub)
    assert not (tmp_path / "tasks").exists()


def test_unknown_repository(hub: Hub, tmp_path: Path) -> None:
    with pytest.raises(HarborHpcError, match=r"org/missing .*: no such dataset"):
        fetch("org/missing", tmp_path / "tasks", hub=hub)


def test_unknown_revision(hub: Hub, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no revision 'v9'"):
        fetch(REPO_ID, tmp_path / "tasks", revision="v9", hub=hub)


def test_token(dataset: Path, hf_cache: Path, tmp_path: Path) -> None:
    with FakeHub(dataset, REPO_ID, token="hf_good") as served:
        refused = Hub(endpoint=served.url, cache_dir=hf_cache, token="hf_wrong")
        with pytest.raises(HarborHpcError, match="refused the token") as error:
            fetch(REPO_ID, tmp_path / "tasks", hub=refused)
        assert error.value.hint is not None and "HF_TOKEN" in error.value.hint

        accepted = Hub(endpoint=served.url, cache_dir=hf_cache, token="hf_good")
        assert len(fetch(REPO_ID, tmp_path / "tasks", hub=accepted).tasks) == 4


def test_dead_hub(hf_cache: Path, tmp_path: Path) -> None:
    dead = Hub(endpoint=dead_endpoint(), cache_dir=hf_cache)
    with pytest.raises(HarborHpcError, match="the hub cannot be reached"):
        fetch(REPO_ID, tmp_path / "tasks", hub=dead)
    with pytest.raises(HarborHpcError, match="the hub cannot be reached"):
        plan_fetch(REPO_ID, tmp_path / "tasks", hub=dead)


def test_plain_files_follow_the_repository(hub: Hub, dataset: Path, tmp_path: Path) -> None:
    dest = tmp_path / "tasks"
    fetch(REPO_ID, dest, include=["README.md"], hub=hub)
    (dataset / "README.md").write_text("# terminal tasks, v2\n")

    report = fetch(REPO_ID, dest, include=["README.md"], hub=hub)

    assert report.files_placed == ["README.md"]
    assert (dest / "README.md").read_text() == "# terminal tasks, v2\n"
    assert [p.name for p in dest.iterdir() if p.name.endswith(".tmp")] == []
