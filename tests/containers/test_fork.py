"""Forks, snapshots and restores of a live sandbox (issue 58, containers/snapshot.py): the
children see the parent's files at the fork, each writes apart, and nothing is left."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from harbor_hpc.containers.environment import SingularityEnvironment
from harbor_hpc.containers.errors import SnapshotRefused
from harbor_hpc.containers.probes import missing_subid_ranges
from harbor_hpc.containers.snapshot import PREFIX, held_bytes, pack_layers, unpack_layers
from harbor_hpc.containers.watchdog import process_tree
from harbor_hpc.core.scratch import sweep
from tests.containers.test_compose import POD, PROBE, write_compose
from tests.support.environments import make_environment, started
from tests.support.processes import ENDED_WITHIN_S, container_processes, gone_within

pytestmark = [pytest.mark.apptainer, pytest.mark.docker]

# Before the fork: a file, a package installed with dpkg, a file of another user of the image,
# a file of the image removed (a whiteout) and a folder of it made anew (opaque), and a process.
BEFORE = (
    "echo parent > /root/a.txt && mkdir -p /tmp/p/DEBIAN /tmp/p/usr/share/hh-pkg"
    " && printf 'Package: hh-pkg\\nVersion: 1\\nArchitecture: all\\nMaintainer: t <t@t>\\n"
    "Description: t\\n' > /tmp/p/DEBIAN/control && echo 42 > /tmp/p/usr/share/hh-pkg/answer"
    " && dpkg-deb --build /tmp/p /tmp/p.deb >/dev/null && dpkg -i /tmp/p.deb >/dev/null"
    " && touch /tmp/theirs && chown 65534:65534 /tmp/theirs && rm /etc/issue"
    " && rm -rf /usr/share/doc && mkdir /usr/share/doc && touch /usr/share/doc/only"
    " && (setsid sleep 600 >/dev/null 2>&1 </dev/null &)"
)
SEEN = (
    "cat /root/a.txt; dpkg -s hh-pkg | grep Status; cat /usr/share/hh-pkg/answer;"
    " stat -c %u /tmp/theirs; test -e /etc/issue || echo no-issue; ls /usr/share/doc;"
    " pgrep -x sleep >/dev/null && echo sleeping || echo no-sleep"
)
CARRIED = "parent\nStatus: install ok installed\n42\n65534\nno-issue\nonly\n"


async def out(environment: SingularityEnvironment, command: str) -> str:
    result = await environment.exec(command)
    assert result.return_code == 0, result
    return result.stdout or ""


def snapshots(scratch: Path) -> list[Path]:
    return sorted(scratch.glob(f"{PREFIX}*"))


def test_a_fork_carries_the_files_and_each_child_writes_apart(
    debian_sif: Path, tmp_path: Path
) -> None:
    scratch = tmp_path / "scratch"

    async def main() -> dict[str, object]:
        seen: dict[str, object] = {}
        async with started(debian_sif, tmp_path, tmp_path / "env", scratch_dir=scratch) as parent:
            await out(parent, BEFORE)
            children = await parent.fork(3)
            try:
                assert parent.process_pid is not None
                seen["stopped"] = [
                    pid
                    for pid in process_tree(parent.process_pid)
                    if psutil.Process(pid).status() == psutil.STATUS_STOPPED
                ]
                seen["children"] = [await out(child, SEEN) for child in children]
                seen["parent"] = await out(parent, SEEN)
                # Writes after the fork: each its own.
                await out(parent, "echo later > /root/parent.txt")
                for index, child in enumerate(children):
                    await out(child, f"echo {index} > /root/a.txt && rm /usr/share/hh-pkg/answer")
                seen["after"] = [
                    await out(env, "cat /root/a.txt; ls /root; ls /usr/share/hh-pkg")
                    for env in [parent, *children]
                ]
                seen["trials"] = [child.trial_paths.trial_dir for child in children]
                seen["names"] = {env.hostname for env in [parent, *children]}
                seen["held"] = snapshots(scratch)
            finally:
                for child in children:
                    await child.stop(delete=True)
            seen["after children"] = snapshots(scratch)
        return seen

    seen = asyncio.run(main())
    # Every child has the parent's files at the fork (owners, the package, what it removed)
    # and none of its processes; the parent's sleep goes on (stopped for the copy, resumed).
    assert seen["stopped"] == []  # stopped for the copy, every process goes on
    assert seen["children"] == [CARRIED + "no-sleep\n"] * 3
    assert seen["parent"] == CARRIED + "sleeping\n"
    assert seen["after"] == [
        "parent\na.txt\nparent.txt\nanswer\n",
        "0\na.txt\n",
        "1\na.txt\n",
        "2\na.txt\n",
    ]
    trials = seen["trials"]
    assert isinstance(trials, list)
    assert all(t.parent == tmp_path and t.name.startswith("trial.fork-") for t in trials)
    assert len(seen["names"]) == 4  # type: ignore[arg-type]
    # One copy for the three, removed with the last of them.
    assert len(seen["held"]) == 1  # type: ignore[arg-type]
    assert seen["after children"] == []
    assert held_bytes() == 0
    assert gone_within(ENDED_WITHIN_S, lambda: container_processes(debian_sif)) == []


def test_eight_forks_at_once_and_a_fork_of_a_fork(debian_sif: Path, tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"

    async def main() -> tuple[list[str], str, list[Path]]:
        async with started(debian_sif, tmp_path, tmp_path / "env", scratch_dir=scratch) as parent:
            await out(parent, "echo one > /root/one && rm /etc/issue")
            children = await parent.fork(8)
            try:
                said = await asyncio.gather(*(out(c, "cat /root/one") for c in children))
                await out(children[0], "echo two > /root/two && rm /root/one")
                (grandchild,) = await children[0].fork(1)
                try:
                    deep = await out(
                        grandchild, "ls /root; test -e /etc/issue || echo no-issue; cat /root/two"
                    )
                finally:
                    await grandchild.stop(delete=True)
            finally:
                await asyncio.gather(*(child.stop(delete=True) for child in children))
            return list(said), deep, snapshots(scratch)

    said, deep, left = asyncio.run(main())
    assert said == ["one\n"] * 8
    assert deep == "two\nno-issue\ntwo\n"  # the grandchild sees both layers, /root/one removed
    assert left == []


def test_a_snapshot_is_restored_after_its_parent_stopped_and_is_capped(
    debian_sif: Path, tmp_path: Path
) -> None:
    scratch = tmp_path / "scratch"

    async def main() -> tuple[str, str, list[Path]]:
        parent = make_environment(
            debian_sif, tmp_path, tmp_path / "env", scratch_dir=scratch, snapshot_storage_mb=2
        )
        await parent.start(force_build=False)
        try:
            await out(parent, "echo saved > /root/saved")
            snapshot = await parent.snapshot()
            await out(parent, "head -c 3000000 /dev/zero > /root/big")
            with pytest.raises(SnapshotRefused) as refused:
                await parent.snapshot()
        finally:
            await parent.stop(delete=True)
        try:
            (restored,) = await parent.restore(snapshot)
            try:
                text = await out(restored, "cat /root/saved; ls /root")
            finally:
                await restored.stop(delete=True)
        finally:
            snapshot.release()
        return text, str(refused.value), snapshots(scratch)

    text, refused, left = asyncio.run(main())
    assert text == "saved\nsaved\n"
    assert "snapshot_storage_mb=2" in refused and refused.startswith("task unit: its upper holds")
    assert left == []


def test_a_snapshots_copy_for_another_node_counts_against_its_cap(
    debian_sif: Path, tmp_path: Path
) -> None:
    """What a Ray host on another node does with a snapshot it fetches (ray/host.py): its
    layers packed where it was taken, unpacked here, and held within snapshot_storage_mb with
    this process's other snapshots."""
    scratch = tmp_path / "scratch"
    subids = not missing_subid_ranges()

    async def main() -> tuple[int, int, str, str]:
        async with started(debian_sif, tmp_path, tmp_path / "env", scratch_dir=scratch) as parent:
            await out(parent, "head -c 3000000 /dev/urandom > /root/big && rm /etc/issue")
            taken = await parent.snapshot(step=2)
        try:
            archives = [tmp_path / f"layer-{k}.tar" for k in range(len(taken.layers))]
            pack_layers(taken, archives, subids)
            held = held_bytes()
            copy = unpack_layers(
                archives, scratch, source=taken.source, step=2, env={}, subids=subids,
                limit_bytes=None,
            )  # fmt: skip
            counted = held_bytes() - held
            try:
                (restored,) = await parent.restore(copy)
                try:
                    seen = await out(restored, "wc -c < /root/big; test -e /etc/issue || echo gone")
                finally:
                    await restored.stop(delete=True)
                with pytest.raises(SnapshotRefused) as refused:
                    unpack_layers(
                        archives, scratch, source=taken.source, step=2, env={}, subids=subids,
                        limit_bytes=held_bytes() + 2**20,
                    )  # fmt: skip
            finally:
                copy.release()
            return counted, taken.bytes, seen, str(refused.value)
        finally:
            taken.release()

    before = held_bytes()
    counted, taken_bytes, seen, refused = asyncio.run(main())
    assert counted == taken_bytes > 3_000_000  # the copy counts what the snapshot counts
    assert seen == "3000000\ngone\n"
    assert refused.startswith("its copy on this node holds 2.9 MB, and this process's")
    assert "remove snapshots no longer needed, or raise snapshot_storage_mb" in refused
    assert (
        held_bytes() == before and snapshots(scratch) == []
    )  # each copy gone with its last holder


@pytest.mark.apptainer_only  # fakeroot=false: Apptainer's own overlay, as the user
def test_a_fork_where_the_root_is_not_our_own_is_refused_naming_why(
    debian_sif: Path, tmp_path: Path
) -> None:
    async def main() -> str:
        async with started(debian_sif, tmp_path, fakeroot=False) as environment:
            with pytest.raises(SnapshotRefused) as refused:
                await environment.fork(2)
            return str(refused.value)

    said = asyncio.run(main())
    assert said == (
        "task unit: a snapshot copies the container's own root (the kernel's overlay), and this "
        "container's is not one: fakeroot=false (`harbor-hpc doctor`)"
    )


DRIVER_THAT_DIES = """
import asyncio, json, os, signal, sys
from pathlib import Path
from tests.support.environments import make_environment

async def main():
    folder = Path(sys.argv[2])
    parent = make_environment(sys.argv[1], folder, folder / "env", scratch_dir=folder / "scratch")
    await parent.start(force_build=False)
    await parent.exec("echo x > /root/x && chown 65534 /root/x")
    children = await parent.fork(2)
    print(json.dumps([env.process_pid for env in [parent, *children]]), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


def test_nothing_is_left_when_the_driver_of_forks_is_killed(
    debian_sif: Path, tmp_path: Path
) -> None:
    driver = subprocess.run(
        [sys.executable, "-c", DRIVER_THAT_DIES, str(debian_sif), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert driver.returncode == -signal.SIGKILL, driver.stderr
    pids = json.loads(driver.stdout)
    assert len(pids) == 3
    deadline = time.monotonic() + ENDED_WITHIN_S
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in pids if Path(f"/proc/{pid}").exists()] == []
    assert gone_within(ENDED_WITHIN_S, lambda: container_processes(debian_sif)) == []
    # The snapshot (files of the image's other users among them) goes with the next sweep.
    scratch = tmp_path / "scratch"
    (left,) = snapshots(scratch)
    assert sweep(PREFIX, scratch) == [left]
    assert snapshots(scratch) == []


def test_a_fork_of_a_compose_pod_gets_a_pod_of_its_own(debian_sif: Path, tmp_path: Path) -> None:
    """A pod's fork: the main container's files carried, its services and volumes started
    anew beside each child (as `docker commit` carries neither), each reachable by name."""
    env_dir = tmp_path / "environment"
    write_compose(env_dir, POD.format(image=debian_sif, probe=PROBE))
    parent = make_environment(
        str(debian_sif), tmp_path, env_dir, memory_mb=1024, scratch_dir=str(tmp_path / "scratch")
    )
    probe = (
        'cat /root/m; cat /shared/seed; ls /shared; python3 -c "import os, urllib.request as u;'
        " print(u.urlopen(os.environ['API_URL']).status)\""
    )

    async def main() -> tuple[list[str], list[str]]:
        await parent.start(force_build=False)
        try:
            await out(parent, "echo main > /root/m && echo parent > /shared/note")
            children = await parent.fork(2)
            try:
                seen = [await out(child, probe) for child in children]
                api = [
                    (await child.service_exec("hostname; ls /shared", service="api")).stdout or ""
                    for child in children
                ]
            finally:
                await asyncio.gather(*(child.stop(delete=True) for child in children))
        finally:
            await parent.stop(delete=True)
        return seen, api

    seen, api = asyncio.run(main())
    assert seen == ["main\nseeded\nseed\n200\n"] * 2
    assert api == ["api\nseed\n"] * 2
