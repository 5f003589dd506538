"""Images unpacked on the node's disk (`unpacked_roots`), the lower folders of containers' own
roots: shared, kept owned as in the image, removed least recently used first but never while a
container runs from them, and the .sif whenever unpacking fails; with `auto` (the default) from an
image's second start, in the background (no start waits for it), on a disk and under a share of
its free space. Directories are renamed there as under Docker. Real unsquashfs, unshare and
Apptainer, as the tester."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from harbor_hpc.containers.probes import missing_subid_ranges
from harbor_hpc.containers.roots import RETRY_AFTER_S, UnpackedRoots
from harbor_hpc.containers.sif import root_partition
from harbor_hpc.core.scratch import remove_private_dir
from tests.support.cli import cli, cli_json
from tests.support.environments import started
from tests.support.processes import ENDED_WITHIN_S, container_processes, gone_within, left_naming
from tests.support.sample_tasks import make_task
from tests.support.small_disk import small_disk

pytestmark = [pytest.mark.apptainer, pytest.mark.docker]


def copy_of(sif: Path, folder: Path, name: str) -> Path:
    """Another image as far as the roots go (its own path and time)."""
    folder.mkdir(parents=True, exist_ok=True)
    copy = folder / name
    shutil.copyfile(sif, copy)
    return copy


def roots_in(folder: Path) -> list[str]:
    """The roots made (not one being made: `.KEY.partial`)."""
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def test_containers_run_from_one_unpacked_root(debian_sif: Path, tmp_path: Path) -> None:
    """Two trials of one image share one unpack; each writes only its own overlay; the kernel's
    overlayfs serves it, volatile (its stop syncs nothing of the node's disk); every file has
    the owner, mode and size it has from the .sif."""
    scratch = tmp_path / "scratch"
    listing = (
        # A folder's size is its file system's (0 through fuse-overlayfs, 4096 on ext4).
        "find /usr /etc /var /opt /home /root \\( -type d -printf '%u:%g %m %p\\n' \\)"
        " -o -printf '%u:%g %m %s %p\\n' 2>/dev/null | sort"
        f" | md5sum; id -u; touch /usr/made && echo wrote; {ROOT}"
    )

    async def main() -> list[str]:
        outputs = []
        for name, roots in (("sif", 0), ("one", 2), ("two", 2)):
            async with started(
                debian_sif, tmp_path / name, scratch_dir=str(scratch), unpacked_roots=roots
            ) as environment:
                outputs.append((await environment.exec(listing)).stdout or "")
        return outputs

    from_sif, one, two = asyncio.run(main())
    digest = from_sif.split()[0]
    assert from_sif.split("\n")[1:3] == ["0", "wrote"] and lower_of(from_sif) == "sif"
    assert one.split("\n")[:3] == two.split("\n")[:3] == [f"{digest}  -", "0", "wrote"]
    assert lower_of(one) == lower_of(two) == "unpacked"
    for output in (from_sif, one, two):  # newer kernels say `fsync=volatile`
        options = output.strip().splitlines()[-1].split()[1].split(",")
        assert {"volatile", "fsync=volatile"} & set(options)
    folder = scratch / f"harbor-hpc-roots-{os.getuid()}"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    (root,) = roots_in(folder)
    assert (folder / root / "usr" / "bin" / "python3").exists()
    assert not (folder / root / "usr" / "made").exists()
    assert gone_within(ENDED_WITHIN_S, lambda: container_processes(debian_sif)) == []
    assert gone_within(ENDED_WITHIN_S, lambda: left_naming(str(folder))) == []


def test_roots_in_use_stay_and_the_least_recently_used_go(debian_sif: Path, tmp_path: Path) -> None:
    images = [copy_of(debian_sif, tmp_path / "images", f"{name}.sif") for name in "abc"]
    partition = root_partition(debian_sif)
    assert partition is not None
    # Room for one image (what an unpack asks: four times the packed size), never for two.
    roots = UnpackedRoots(tmp_path / "roots", cap_bytes=partition.size * 6)
    a = roots.lease(images[0])
    b = roots.lease(images[1])
    assert a is not None and b is not None
    assert len(roots_in(roots.folder)) == 2  # over the cap, but `a` is in use
    b.release()
    c = roots.lease(images[2])
    assert c is not None
    assert sorted(roots_in(roots.folder)) == sorted([a.root.name, c.root.name])  # b went
    a.release()
    c.release()


def test_one_unpack_for_leases_at_once(debian_sif: Path, tmp_path: Path) -> None:
    roots = UnpackedRoots(tmp_path / "roots", cap_bytes=1 << 40)
    with ThreadPoolExecutor(3) as pool:
        leases = list(pool.map(lambda _: roots.lease(debian_sif), range(3)))
    assert all(lease is not None for lease in leases)
    assert len({lease.root for lease in leases if lease is not None}) == 1
    assert len(roots_in(roots.folder)) == 1
    for lease in leases:
        assert lease is not None
        lease.release()


@pytest.mark.small_disk
@pytest.mark.apptainer_only  # its small disk (FUSE) refuses the kernel's overlay: Apptainer's own
def test_an_image_that_does_not_fit_runs_from_its_sif(debian_sif: Path, tmp_path: Path) -> None:
    with small_disk(tmp_path, megabytes=16) as disk:
        roots = UnpackedRoots(disk / "roots", cap_bytes=1 << 40)
        assert roots.lease(debian_sif) is None
        assert roots_in(roots.folder) == []  # nothing half-unpacked left
        failed = [path.name for path in roots.folder.iterdir() if path.suffix == ".failed"]
        assert len(failed) == 1
        # Not tried again for a while: the next trial starts at once, from the .sif.
        assert RETRY_AFTER_S >= 60 and roots.lease(debian_sif) is None

        async def main() -> str:
            async with started(
                debian_sif, tmp_path / "env", unpacked_roots=2, scratch_dir=str(disk)
            ) as environment:
                return (await environment.exec(ROOT)).stdout or ""

        # From its .sif: through a root of our own, or (this disk, a FUSE mount, is no upper
        # the kernel's overlay takes) Apptainer's own.
        assert lower_of(asyncio.run(main())) in {"sif", "fuse.fuse-overlayfs"}


def test_an_image_bigger_than_the_cap_runs_from_its_sif(debian_sif: Path, tmp_path: Path) -> None:
    """`unpacked_roots = 0.01` (10 MB): the image (some 60 MB packed) is never unpacked."""
    roots = UnpackedRoots.on_node(tmp_path, 0.01)
    assert roots is not None
    assert roots.lease(debian_sif) is None
    assert roots_in(roots.folder) == [] and list(roots.folder.glob(".*.partial")) == []


def test_a_roots_folder_of_someone_else_is_not_used(debian_sif: Path, tmp_path: Path) -> None:
    roots = UnpackedRoots(tmp_path / "roots", cap_bytes=1 << 40)
    roots.folder.mkdir(mode=0o755)
    roots.folder.chmod(0o755)  # open to others: not a private folder
    assert roots.lease(debian_sif) is None
    assert roots_in(roots.folder) == []


# The file system at / in a container and its options: the last line of the output.
ROOT = "awk '$2 == \"/\" {print $3, $4}' /proc/mounts | tail -n 1"


def lower_of(output: str) -> str:
    """What the root in `output` (ending with ROOT's line) is mounted over: "sif" (an own root
    over the .sif's squashfs), "unpacked" (over an unpacked root), else the file system's type
    (Apptainer's own: fuse.fuse-overlayfs)."""
    kind, options = ([*output.strip().splitlines()[-1].split(), ""])[:2]
    if kind != "overlay":
        return kind
    lower = next(part for part in options.split(",") if part.startswith("lowerdir="))
    return (
        "unpacked"
        if "/harbor-hpc-roots-" in lower
        else "sif"
        if lower.endswith("/root/image")
        else lower
    )


def root_mount(environment_folder: Path, sif: Path, scratch: Path) -> str:
    """What / is mounted over (`lower_of`) in a container started with the default
    `unpacked_roots` (auto)."""

    async def main() -> str:
        async with started(sif, environment_folder, scratch_dir=str(scratch)) as environment:
            return lower_of((await environment.exec(ROOT)).stdout or "")

    return asyncio.run(main())


def wait_for_root(folder: Path, seconds: float = 120) -> list[str]:
    deadline = time.monotonic() + seconds
    while not (folder.is_dir() and roots_in(folder)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return roots_in(folder) if folder.is_dir() else []


@pytest.mark.skipif(bool(missing_subid_ranges()), reason="unpacking keeps owners with a range")
def test_auto_unpacks_an_image_that_starts_again_in_the_background(
    debian_sif: Path, tmp_path: Path
) -> None:
    """The first start only marks the image seen; the second mounts the .sif too and unpacks
    it meanwhile; the starts after it mount the root."""
    image = copy_of(debian_sif, tmp_path / "images", "once-then-again.sif")
    scratch = tmp_path / "scratch"
    folder = scratch / f"harbor-hpc-roots-{os.getuid()}"
    assert root_mount(tmp_path / "first", image, scratch) == "sif"
    assert roots_in(folder) == []
    assert root_mount(tmp_path / "second", image, scratch) == "sif"
    assert len(wait_for_root(folder)) == 1
    assert root_mount(tmp_path / "third", image, scratch) == "unpacked"
    assert gone_within(ENDED_WITHIN_S, lambda: container_processes(image)) == []


@pytest.mark.skipif(bool(missing_subid_ranges()), reason="unpacking keeps owners with a range")
def test_a_start_that_finds_its_image_being_unpacked_does_not_wait_for_it(
    debian_sif: Path, tmp_path: Path
) -> None:
    """A fleet started together: another process of the node unpacks the image (its unsquashfs
    slowed by a minute), and a start meanwhile mounts the .sif at once, however long the
    unpack takes."""
    image = copy_of(debian_sif, tmp_path / "images", "fleet.sif")
    scratch = tmp_path / "scratch"
    slow = tmp_path / "bin" / "unsquashfs"
    slow.parent.mkdir()
    slow.write_text(f'#!/bin/sh\nsleep 60\nexec {shutil.which("unsquashfs")} "$@"\n')
    slow.chmod(0o755)
    unpacker = (
        "import sys, threading; from pathlib import Path;"
        "from harbor_hpc.containers.roots import UnpackedRoots;"
        "roots = UnpackedRoots.on_node(Path(sys.argv[1]), 'auto'); assert roots;"
        "image = Path(sys.argv[2]); roots.lease(image); roots.lease(image);"
        "[t.join() for t in threading.enumerate() if t.name.startswith('harbor-hpc-unpack')]"
    )
    path = f"{slow.parent}:{os.environ['PATH']}"
    other = subprocess.Popen(
        [sys.executable, "-c", unpacker, str(scratch), str(image)], env={**os.environ, "PATH": path}
    )
    folder = scratch / f"harbor-hpc-roots-{os.getuid()}"
    deadline = time.monotonic() + 30
    while not list(folder.glob(".*.lock")) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert root_mount(tmp_path / "fleet", image, scratch) == "sif"
        assert other.poll() is None  # the unpack still under way
    finally:
        other.kill()
        other.wait()


@pytest.mark.skipif(bool(missing_subid_ranges()), reason="unpacking keeps owners with a range")
def test_an_unpack_under_way_into_one_folder_leaves_another_folders_to_its_own(
    debian_sif: Path, tmp_path: Path
) -> None:
    """One process, two roots folders (two scratch disks): the image's unpack into the first
    (slowed by a minute) does not keep it from being unpacked into the second."""
    image = copy_of(debian_sif, tmp_path / "images", "two-folders.sif")
    slow = tmp_path / "bin" / "unsquashfs"
    slow.parent.mkdir()
    real = shutil.which("unsquashfs")
    slow.write_text(f'#!/bin/sh\ncase "$*" in *slow-disk*) sleep 60;; esac\nexec {real} "$@"\n')
    slow.chmod(0o755)
    unpacker = """if True:
        import os, sys, time
        from pathlib import Path
        from harbor_hpc.containers.roots import UnpackedRoots
        image, both = Path(sys.argv[3]), [UnpackedRoots(Path(f), None) for f in sys.argv[1:3]]
        for roots in both:
            roots.lease(image), roots.lease(image)  # seen, then unpacked in the background
        deadline = time.monotonic() + 50
        while not [p for p in both[1].folder.iterdir() if p.is_dir() and p.name[0] != "."]:
            if time.monotonic() > deadline:
                os._exit(1)
            time.sleep(0.1)
        os._exit(0)  # not waiting for the slow unpack
    """
    folders = [str(tmp_path / "slow-disk"), str(tmp_path / "fast-disk")]
    other = subprocess.Popen(
        [sys.executable, "-c", unpacker, *folders, str(image)],
        env={**os.environ, "PATH": f"{slow.parent}:{os.environ['PATH']}"},
        start_new_session=True,
    )
    try:
        assert other.wait(timeout=90) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(other.pid, 9)
    assert len(roots_in(tmp_path / "fast-disk")) == 1 and roots_in(tmp_path / "slow-disk") == []


@pytest.mark.skipif(bool(missing_subid_ranges()), reason="unpacking keeps owners with a range")
def test_a_process_that_ends_after_its_start_finishes_the_unpack_it_began(
    debian_sif: Path, tmp_path: Path
) -> None:
    """A Slurm element that runs one trial and ends: its process, ending right after the start
    that began the background unpack, finishes it first, so the node's next start has the
    root."""
    image = copy_of(debian_sif, tmp_path / "images", "one-trial-elements.sif")
    scratch = tmp_path / "scratch"
    element = (
        "import sys; from pathlib import Path;"
        "from harbor_hpc.containers.roots import UnpackedRoots;"
        "roots = UnpackedRoots.on_node(Path(sys.argv[1]), 'auto'); assert roots;"
        "assert roots.lease(Path(sys.argv[2])) is None"
    )
    for _ in range(2):  # the first marks the image seen, the second begins the unpack
        subprocess.run([sys.executable, "-c", element, str(scratch), str(image)], check=True)
    folder = scratch / f"harbor-hpc-roots-{os.getuid()}"
    assert len(roots_in(folder)) == 1
    assert list(folder.glob(".*.partial")) == []


@pytest.mark.skipif(bool(missing_subid_ranges()), reason="unpacking keeps owners with a range")
def test_what_a_killed_unpack_left_goes_at_the_next_unpack(
    debian_sif: Path, tmp_path: Path
) -> None:
    """A process killed (SIGKILL, its whole session) after unsquashfs wrote the image but before
    the root was renamed into place leaves a partial folder of the subuids' files; the next
    unpack on the node, of another image, removes it."""
    image = copy_of(debian_sif, tmp_path / "images", "killed.sif")
    folder = tmp_path / "roots"
    unpacked = tmp_path / "unsquashfs-done"
    slow = tmp_path / "bin" / "unsquashfs"
    slow.parent.mkdir()
    real = shutil.which("unsquashfs")
    slow.write_text(f'#!/bin/sh\n{real} "$@" && touch {unpacked} && sleep 120\n')
    slow.chmod(0o755)
    unpacker = (
        "import sys; from pathlib import Path;"
        "from harbor_hpc.containers.roots import UnpackedRoots;"
        "UnpackedRoots(Path(sys.argv[1]), cap_bytes=1 << 40).lease(Path(sys.argv[2]))"
    )
    other = subprocess.Popen(
        [sys.executable, "-c", unpacker, str(folder), str(image)],
        env={**os.environ, "PATH": f"{slow.parent}:{os.environ['PATH']}"},
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while not unpacked.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(other.pid, 9)
    other.wait(timeout=30)
    partials = list(folder.glob(".*.partial"))
    assert len(partials) == 1 and (partials[0] / "etc").is_dir()
    roots = UnpackedRoots(folder, cap_bytes=1 << 40)
    lease = roots.lease(debian_sif)
    assert lease is not None
    lease.release()
    assert list(folder.glob(".*.partial")) == []
    assert len(roots_in(folder)) == 1


def test_a_scratch_folder_in_memory_takes_an_own_root_over_the_sif(
    debian_sif: Path, tmp_path: Path
) -> None:
    """`auto` with the scratch folder in memory (a tmpfs): nothing unpacked; the root is our own
    over the .sif, its upper on the tmpfs (whose user xattrs Linux 6.6 and later keeps)."""
    scratch = Path(tempfile.mkdtemp(prefix="harbor-hpc-test-", dir="/dev/shm"))
    try:
        assert root_mount(tmp_path / "env", debian_sif, scratch) == "sif"
    finally:
        remove_private_dir(scratch)


@pytest.mark.skipif(bool(missing_subid_ranges()), reason="unpacking keeps owners with a range")
def test_a_task_that_renames_directories_scores_from_an_unpacked_root_as_from_the_sif(
    debian_sif: Path, tmp_path: Path
) -> None:
    """A task that renames a directory as dpkg does scores 1 over the .sif and over an unpacked
    root alike (Apptainer's own overlay over a folder refused it: EXDEV), and its trial names no
    limit."""
    tasks = tmp_path / "tasks"
    make_task(tasks, "renames", kind="renames_a_directory", image=str(debian_sif))
    scratch = tmp_path / "scratch"
    for run, roots in (("sif", "0"), ("roots", "2")):
        cli(
            "submit", str(tasks), "--agent", "oracle", "--run-dir", str(tmp_path / run),
            "--executor", "local", "--scratch-dir", str(scratch), "--wait",
            "--environment-kwarg", f"unpacked_roots={roots}", check=False,
        )  # fmt: skip
        (trial,) = cli_json("status", str(tmp_path / run))
        assert (trial["state"], trial["reward"], trial["limits"]) == ("done", 1.0, []), trial
    assert len(roots_in(scratch / f"harbor-hpc-roots-{os.getuid()}")) == 1


def test_auto_puts_no_roots_in_memory(tmp_path: Path) -> None:
    assert UnpackedRoots.on_node(Path("/dev/shm"), "auto") is None  # a tmpfs: never
    assert UnpackedRoots.on_node(tmp_path, 0) is None  # 0: none
    roots = UnpackedRoots.on_node(tmp_path, "auto")
    assert roots is not None and roots.cap_bytes is None


@pytest.mark.small_disk
def test_auto_leaves_an_image_past_a_quarter_of_the_disk_packed(
    debian_sif: Path, tmp_path: Path
) -> None:
    """The image (some 60 MB packed) would fit the disk of 400 MB, not a quarter of it."""
    with small_disk(tmp_path, megabytes=400) as disk:
        roots = UnpackedRoots(disk / "roots", cap_bytes=None)
        assert roots.lease(debian_sif) is None and roots.lease(debian_sif) is None
        deadline = time.monotonic() + 60
        while not list(roots.folder.glob("*.failed")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [path.suffix for path in roots.folder.glob("*.failed")] == [".failed"]
        assert roots_in(roots.folder) == []
