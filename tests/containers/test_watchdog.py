"""The memory and disk watchdogs on real processes of this machine (no container needed)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from harbor_hpc.containers.watchdog import (
    MB,
    RECHECK_SEC,
    DiskKill,
    DiskWatchdog,
    MemoryBreach,
    MemoryWatchdog,
    OomKill,
    process_tree,
    tree_pss_bytes,
)

# Grows by 20 MB every few milliseconds (about 2 GB/s at most), touching every page.
GROWER = """
import time
chunks = []
for _ in range(300):
    chunks.append(b"x" * (20 << 20))
    time.sleep(0.005)
print("survived", flush=True)
"""


# Once told to, maps a file and reads every page of it; then waits to be killed.
MAPPER = """
import mmap, sys, time
sys.stdin.readline()
with open(sys.argv[1], "rb") as file:
    pages = mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ)
sum(pages[offset] for offset in range(0, len(pages), 4096))
print("mapped", flush=True)
time.sleep(60)
"""


@pytest.fixture
def sleeping_tree() -> Iterator[subprocess.Popen[bytes]]:
    """A bash with 49 sleeping children: a tree of 50 processes."""
    tree = subprocess.Popen(
        ["bash", "-c", "for i in $(seq 49); do sleep 60 & done; wait"], start_new_session=True
    )
    deadline = time.monotonic() + 10
    while len(process_tree(tree.pid)) < 50 and time.monotonic() < deadline:
        time.sleep(0.05)
    yield tree
    for process in psutil.Process(tree.pid).children(recursive=True):
        process.kill()
    tree.kill()
    tree.wait()


def test_process_tree_finds_every_descendant(sleeping_tree: subprocess.Popen[bytes]) -> None:
    expected = {sleeping_tree.pid} | {
        child.pid for child in psutil.Process(sleeping_tree.pid).children(recursive=True)
    }
    assert set(process_tree(sleeping_tree.pid)) == expected
    assert len(expected) == 50


def test_tree_under_threshold_is_left_alone(sleeping_tree: subprocess.Popen[bytes]) -> None:
    pss = tree_pss_bytes(sleeping_tree.pid)
    assert 0 < pss < 200 * MB
    watchdog = MemoryWatchdog(sleeping_tree.pid, limit_bytes=1024 * MB)
    assert watchdog.check() is None
    assert sleeping_tree.poll() is None


def test_grower_is_killed_soon_after_crossing_with_small_overshoot() -> None:
    limit = 400 * MB
    breaches: list[MemoryBreach] = []
    grower = subprocess.Popen(
        [sys.executable, "-c", GROWER], stdout=subprocess.PIPE, start_new_session=True
    )
    watchdog = MemoryWatchdog(grower.pid, limit_bytes=limit, on_breach=breaches.append)
    started = time.monotonic()
    watchdog.start()
    try:
        grower.wait(timeout=30)
    finally:
        watchdog.stop()
        grower.kill()
    elapsed = time.monotonic() - started
    assert grower.returncode == -9
    assert grower.stdout is not None and b"survived" not in grower.stdout.read()
    assert breaches and breaches[0] is watchdog.breach
    breach = breaches[0]
    assert breach.threshold_bytes == int(limit * 0.95)
    # Killed before overshooting the threshold by half again (Harbor's reached 4x).
    assert breach.threshold_bytes < breach.peak_bytes < 1.5 * breach.threshold_bytes
    assert elapsed < 15
    message = breach.describe()
    assert (
        "memory" in message
        and "400 MB" in message
        and f"{-(-breach.peak_bytes // MB)} MB" in message
    )


def test_over_the_limit_the_tasks_biggest_process_is_killed_and_the_rest_goes_on() -> None:
    """As the kernel's OOM killer in a Docker container's cgroup: the process that overran
    (below the server, never the server), and the tree lives on; where no one kill is enough,
    the whole tree."""
    limit = 400 * MB
    # The "server" and, below it, a sleeper and a grower; the grower's exit status is printed.
    server = subprocess.Popen(
        ["bash", "-c", f"sleep 60 & {sys.executable} -c '{GROWER}'; echo $?; wait"],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    kills: list[OomKill] = []
    watchdog = MemoryWatchdog(
        server.pid, limit_bytes=limit, servers=lambda: [server.pid], on_kill=kills.append
    )
    watchdog.start()
    try:
        assert server.stdout is not None
        assert server.stdout.readline() == "137\n"  # killed: SIGKILL's 128 + 9
        assert server.poll() is None and watchdog.breach is None
        (kill,) = kills
        assert "range(300)" in kill.command and kill.process_bytes > 200 * MB
        assert kill.container_bytes > kill.threshold_bytes == int(limit * 0.95)
        assert "the task goes on" in kill.describe()
        assert len(process_tree(server.pid)) == 2  # the server and its sleeper
    finally:
        watchdog.stop()
        for process in psutil.Process(server.pid).children(recursive=True):
            process.kill()
        server.kill()
        server.wait()


def test_over_storage_mb_the_biggest_writer_is_killed_and_the_rest_goes_on(tmp_path: Path) -> None:
    """A task's files past its storage_mb: the process that wrote them is killed (not the
    server, not a process that wrote nothing), and a small write after it is left alone."""
    server = subprocess.Popen(
        ["bash", "-c", f"sleep 60 & dd if=/dev/zero of={tmp_path}/big bs=1M count=2000 2>/dev/null;"
         f" echo $?; echo small > {tmp_path}/after; echo done; wait"],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    kills: list[DiskKill] = []
    watchdog = DiskWatchdog(
        tmp_path, limit_bytes=100 * MB, servers=lambda: [server.pid], on_kill=kills.append
    )
    watchdog.start()
    try:
        assert server.stdout is not None
        assert server.stdout.readline() == "137\n"  # dd, killed
        assert server.stdout.readline() == "done\n"
        (kill,) = kills
        # What dd wrote since the watchdog's last look: as much as the machine let it by then.
        assert kill.command.startswith("dd if=/dev/zero") and kill.written_bytes > 0
        assert 100 * MB < kill.disk_bytes < 1000 * MB
        assert "storage_mb of 100 MB" in kill.describe()
        assert (tmp_path / "after").read_text() == "small\n"
        assert server.poll() is None
    finally:
        watchdog.stop()
        for process in psutil.Process(server.pid).children(recursive=True):
            process.kill()
        server.kill()
        server.wait()


def test_stop_ends_the_watch_and_kills_nothing(sleeping_tree: subprocess.Popen[bytes]) -> None:
    # No node allocates this much: only the first check and RECHECK_SEC's look at the tree.
    watchdog = MemoryWatchdog(sleeping_tree.pid, limit_bytes=1 << 50, interval_sec=0.01)
    watchdog.start()
    time.sleep(0.5)
    watchdog.stop()
    checks = watchdog.checks
    time.sleep(RECHECK_SEC + 0.5)
    assert watchdog.checks == checks == 1
    assert watchdog.breach is None
    assert sleeping_tree.poll() is None


def test_one_thread_watches_every_tree() -> None:
    """A trainer's fleet of environments in one process: one watchdog thread, not one each."""
    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(32)]
    watchdogs = [MemoryWatchdog(sleeper.pid, limit_bytes=1024 * MB) for sleeper in sleepers]
    try:
        for watchdog in watchdogs:
            watchdog.start()
        deadline = time.monotonic() + 10
        while any(watchdog.checks == 0 for watchdog in watchdogs):
            assert time.monotonic() < deadline, "not every tree was looked at"
            time.sleep(0.05)
        names = [thread.name for thread in threading.enumerate()]
        assert names.count("memory-watchdog") == 1
    finally:
        for watchdog in watchdogs:
            watchdog.stop()
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()


def test_growth_that_allocates_nothing_is_caught_by_the_recheck(tmp_path: Path) -> None:
    """Pages of a file already in the page cache, mapped by the tree: PSS that the node's
    allocation counter never saw, caught by the look at least every RECHECK_SEC."""
    cached = tmp_path / "cached.bin"
    cached.write_bytes(b"x" * (300 * MB))
    mapper = subprocess.Popen(
        [sys.executable, "-c", MAPPER, str(cached)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert mapper.stdin is not None and mapper.stdout is not None
    breaches: list[MemoryBreach] = []
    watchdog = MemoryWatchdog(mapper.pid, limit_bytes=200 * MB, on_breach=breaches.append)
    try:
        watchdog.start()
        while watchdog.checks == 0:  # the first look, before the mapping
            time.sleep(0.01)
        mapper.stdin.write("map\n")
        mapper.stdin.flush()
        assert mapper.stdout.readline() == "mapped\n"
        mapper.wait(timeout=RECHECK_SEC + 20)
    finally:
        watchdog.stop()
        mapper.kill()
        mapper.wait()
    assert mapper.returncode == -9
    assert breaches and breaches[0].peak_bytes > 200 * MB


def test_a_peak_just_over_the_threshold_never_reads_as_equal() -> None:
    threshold = int(512 * MB * 0.95)  # 486.4 MB
    breach = MemoryBreach(peak_bytes=threshold + 1, threshold_bytes=threshold, limit_bytes=512 * MB)
    assert "peak of 487 MB" in breach.describe() and "threshold of 486 MB" in breach.describe()
