"""`harbor-hpc fetch` as users run it: a fresh process that reads HF_* from the environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fetch.test_unpack import HONEST, Entry, write_tar
from tests.support.fakehub import FakeHub, dead_endpoint
from tests.support.hub_data import REPO_ID


def run_fetch(
    *args: str, endpoint: str, hf_home: Path, token: str | None = None, offline: bool = False
) -> subprocess.CompletedProcess[str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("HF_", "HUGGING_FACE_"))
    }
    # COLUMNS: rich wraps at 80 columns when stderr is not a terminal; keep each message whole.
    env.update(
        HF_ENDPOINT=endpoint,
        HF_HOME=str(hf_home),
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        COLUMNS="400",
    )
    if token is not None:
        env["HF_TOKEN"] = token
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "harbor_hpc", "fetch", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_one_clear_error(result: subprocess.CompletedProcess[str], expected: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert expected in result.stderr, result.stderr
    assert result.stdout == ""


def test_json_report_and_rerun(fake_hub: FakeHub, tmp_path: Path) -> None:
    dest = tmp_path / "tasks"
    args = (REPO_ID, "--dest", str(dest), "--include", "skill_based/mixed/", "--json")

    first = run_fetch(*args, endpoint=fake_hub.url, hf_home=tmp_path / "hf")
    second = run_fetch(*args, endpoint=fake_hub.url, hf_home=tmp_path / "hf")

    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    assert report["tasks_by_folder"] == {"skill_based": 3}
    assert len(report["archives"]["unpacked"]) == 2
    assert (tmp_path / "hf/hub/datasets--org--terminal-tasks").is_dir(), "HF_HOME honoured"
    rerun = json.loads(second.stdout)
    assert rerun["archives"]["unpacked"] == [] and len(rerun["archives"]["unchanged"]) == 2


def test_refused_archive_exits_nonzero(dataset: Path, tmp_path: Path) -> None:
    write_tar(dataset / "skill_based/mixed/evil.tar.gz", [*HONEST, Entry("../../escaped")])
    with FakeHub(dataset, REPO_ID) as served:
        result = run_fetch(
            REPO_ID,
            "--dest",
            str(tmp_path / "tasks"),
            "--include",
            "skill_based/mixed/*",
            endpoint=served.url,
            hf_home=tmp_path / "hf",
        )

    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "skill_based/mixed/evil.tar.gz: refused, member '../../escaped'" in result.stderr
    assert "3 tasks" in result.stdout


def test_dead_hub_is_one_clear_line(tmp_path: Path) -> None:
    result = run_fetch(
        REPO_ID, "--dest", str(tmp_path / "tasks"), endpoint=dead_endpoint(), hf_home=tmp_path
    )
    assert_one_clear_error(result, "the hub cannot be reached")
    assert not (tmp_path / "tasks").exists()


@pytest.mark.parametrize(
    ("repo", "token", "expected"),
    [
        ("org/missing", None, "org/missing on http://127.0.0.1"),
        (REPO_ID, "hf_wrong", "the hub refused the token (HTTP 401)"),
        (REPO_ID, None, "no such dataset (or it is private and the token cannot read it)"),
    ],
)
def test_hub_refusals_are_one_clear_line(
    repo: str, token: str | None, expected: str, dataset: Path, tmp_path: Path
) -> None:
    with FakeHub(dataset, REPO_ID, token="hf_good") as served:
        result = run_fetch(
            repo,
            "--dest",
            str(tmp_path / "tasks"),
            endpoint=served.url,
            hf_home=tmp_path,
            token=token,
        )
    assert_one_clear_error(result, expected)


def test_dry_run_lists_and_writes_nothing(fake_hub: FakeHub, tmp_path: Path) -> None:
    dest = tmp_path / "tasks"
    result = run_fetch(
        REPO_ID,
        "--dest",
        str(dest),
        "--dry-run",
        "-i",
        "*.tgz",
        endpoint=fake_hub.url,
        hf_home=tmp_path / "hf",
    )
    assert result.returncode == 0, result.stderr
    assert "skill_based/easy/security.tgz" in result.stdout
    assert "download and unpack into skill_based/easy/" in result.stdout
    assert not dest.exists() and fake_hub.downloads() == []


def test_offline_works_from_the_cache_alone(fake_hub: FakeHub, tmp_path: Path) -> None:
    args = (REPO_ID, "--dest", str(tmp_path / "tasks"), "-i", "*.tgz", "--json")
    online = run_fetch(*args, endpoint=fake_hub.url, hf_home=tmp_path / "hf")
    assert online.returncode == 0, online.stderr
    requests = len(fake_hub.requests)

    offline = run_fetch(*args, endpoint=fake_hub.url, hf_home=tmp_path / "hf", offline=True)
    empty = run_fetch(*args, endpoint=fake_hub.url, hf_home=tmp_path / "empty", offline=True)

    assert offline.returncode == 0, offline.stderr
    assert json.loads(offline.stdout)["tasks"] == ["skill_based/easy/security/find-secret"]
    assert len(fake_hub.requests) == requests, "offline means no request at all"
    assert_one_clear_error(empty, "HF_HUB_OFFLINE is set and the files asked for are not in")
