"""Roots of our own (holder.py): the mount points a --writable root needs, and the next best path
where a node refuses the kernel's overlay (Apptainer's own), end to end on a real scratch disk
that refuses it, as the tester."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from harbor_hpc.containers.holder import BASE_DIRS, bind_targets, root_path
from harbor_hpc.containers.probes import missing_subid_ranges
from tests.support.environments import started
from tests.support.small_disk import small_disk


def test_the_mount_points_are_the_binds_targets_files_for_files(tmp_path: Path) -> None:
    source = tmp_path / "hosts"
    source.write_text("127.0.0.1 localhost\n")
    folder = tmp_path / "logs"
    folder.mkdir()
    options = [
        "--env", "A=B", "-B", f"{source}:/etc/hosts", "--bind", f"{folder}:/logs/agent:ro",
        "-B", f"{tmp_path / 'x.sif'}:/staging/.hh/image:id=4,image-src=/", "-B", str(folder),
    ]  # fmt: skip
    dirs, files = bind_targets(options)
    assert files == ["/etc/hosts"]
    assert dirs == [*BASE_DIRS, "/logs/agent", "/staging/.hh/image", str(folder)]


@pytest.mark.apptainer
@pytest.mark.docker
@pytest.mark.small_disk
@pytest.mark.apptainer_only
def test_a_scratch_disk_the_kernels_overlay_refuses_takes_apptainers_own_overlay(
    debian_sif: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A scratch disk the kernel's overlay takes no upper on (a FUSE file system: fuse2fs): the
    next best, Apptainer's own overlay on the .sif, named in the trial's log, and the task's
    root writes."""
    # What a FUSE upper without allow_other lets the image's other users do is that disk's
    # matter (dpkg fails there, on either path): root's write is what is asked here.
    write = "echo 42 > /root/answer && cat /root/answer"
    with small_disk(tmp_path, megabytes=400) as disk:
        path = root_path(disk, subids=not missing_subid_ranges())
        assert not path.own and "refused" in path.why, path

        async def main() -> tuple[str, str]:
            async with started(debian_sif, tmp_path / "env", scratch_dir=str(disk)) as env:
                root = await env.exec("awk '$2 == \"/\" {print $3}' /proc/mounts | tail -n 1")
                done = await env.exec(write)
                return root.stdout or "", (done.stdout or "") + (done.stderr or "")

        root, installed = asyncio.run(main())
    assert root == "fuse.fuse-overlayfs\n"
    assert installed == "42\n"
    assert caplog.text.count(f"container root: {path.describe()}") == 1
