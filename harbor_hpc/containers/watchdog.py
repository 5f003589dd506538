"""The memory watchdog: holds a container to the task's memory as Docker's cgroup does.

Apptainer on clusters rarely has cgroups to enforce `memory_mb`, and a container
that eats the node's memory takes its neighbours down with it. The watchdog sums
PSS (shared pages split between their users, so the container is not charged for
the host's libraries) over the container's whole process tree, and once the sum passes the
threshold it does what the kernel's OOM killer does in a Docker container's memory cgroup: it
kills the task's biggest process (never our server or Apptainer's processes), and the task
goes on, as under Docker the agent goes on after its `python3` was killed. Only where that
is not enough (the memory is held by files in the container's tmpfs mounts, or by no process
of the task's) does it kill the whole tree.

Files in the container's tmpfs mounts (/dev/shm, /dev) are RAM as well, charged to no process:
the watchdog adds what those file systems hold, read through descriptors that the in-container
server keeps open on them (`tmpfs_paths`, /proc/PID/fd/N on the host; the container's own
paths are behind its FUSE root, which the host cannot enter). The root file system is a
disk-backed overlay, so what the task writes there is not memory.

PSS is expensive to read (the kernel walks every mapping), RSS is cheap and never
smaller than PSS; walking the tree for its RSS still costs a third of a millisecond.
So every watchdog of a process runs in one shared thread that looks every `interval_sec`
(50 ms by default) at one number: how many bytes the node's kernel has handed out since
boot (/proc/vmstat's pgalloc counters, which only grow). A tree cannot grow by more than
that, so its RSS is summed only once the node allocated as much as the tree's headroom
below the threshold (or RECHECK_SEC passed), and PSS only while the RSS sum is above the
threshold. A process writing a GB per second is still caught within a tick of the
crossing and overshoots by a few tens of MB at most, where polling PSS every 1 to 3 s let
one reach four times its limit; an idle fleet of environments costs next to nothing.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import psutil

MB = 1024 * 1024
# The longest a watched tree goes without its memory being summed: growth that allocates no
# page (mapping a file already in the page cache, or the share of pages that the tree shares
# with processes that ended) does not show in the node's allocation counter.
RECHECK_SEC = 5.0


@dataclass(frozen=True)
class MemoryBreach:
    """What the watchdog saw when it killed the tree."""

    peak_bytes: int
    threshold_bytes: int
    limit_bytes: int
    tmpfs_bytes: int = 0

    def describe(self) -> str:
        # The peak rounds up and the threshold down, so a peak just over the threshold never
        # reads as equal to it.
        where = "PSS"
        if self.tmpfs_bytes:
            where = (
                f"PSS of its processes plus {-(-self.tmpfs_bytes // MB)} MB of files "
                "in its tmpfs mounts such as /dev/shm"
            )
        return (
            f"memory limit exceeded: the container reached a peak of "
            f"{-(-self.peak_bytes // MB)} MB ({where}), over the kill threshold of "
            f"{self.threshold_bytes // MB} MB for the task's memory limit of "
            f"{self.limit_bytes // MB} MB"
        )


@dataclass(frozen=True)
class OomKill:
    """A process of the task's the watchdog killed, as the kernel's OOM killer would have."""

    pid: int
    command: str
    process_bytes: int
    container_bytes: int
    threshold_bytes: int
    limit_bytes: int

    def describe(self) -> str:
        return (
            f"out of memory: killed process {self.pid} ({self.command}) of "
            f"{-(-self.process_bytes // MB)} MB, the biggest of the task's, when the container "
            f"reached {-(-self.container_bytes // MB)} MB (PSS), over the kill threshold of "
            f"{self.threshold_bytes // MB} MB for the task's memory limit of "
            f"{self.limit_bytes // MB} MB, as the kernel's OOM killer does under Docker; the "
            "task goes on"
        )


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def _read(path: str) -> bytes:
    # Plain open/read: pathlib costs twice as much, and a check reads a file per process.
    with open(path, "rb") as file:
        return file.read()


def oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has ended in this process's memory cgroup,
    where its containers run too (a Slurm job's under ConstrainRAMSpace, limited to the job's
    --mem); None where no memory cgroup says (no cgroups, or none readable). A read of a file
    this process keeps open: a few microseconds."""
    fd = _oom_kill_file()
    if fd is None:
        return None
    try:
        for line in os.pread(fd, 4096, 0).splitlines():
            key, _, value = line.partition(b" ")
            if key == b"oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return None


@dataclass(frozen=True)
class _MemoryCgroup:
    root: Path  # where its hierarchy is mounted
    folder: Path  # this process's cgroup in it
    v1: bool


def _memory_cgroups() -> list[_MemoryCgroup]:
    """This process's memory cgroups, as /proc/self/cgroup names them: the v1 memory
    hierarchy's (listed first), then the v2 unified one's."""
    try:
        lines = _read("/proc/self/cgroup").decode().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            root, v1 = Path("/sys/fs/cgroup/memory"), True
        elif controllers == "":
            root, v1 = Path("/sys/fs/cgroup"), False
        else:
            continue
        found.append(_MemoryCgroup(root, root / path.strip("/"), v1))
    return found


def memory_limit_mb() -> int | None:
    """The memory this process's cgroup and those above it may hold (a Slurm job's --mem under
    ConstrainRAMSpace), in MB; None where none is set or readable (cgroup v1 and v2)."""
    cgroups = _memory_cgroups()
    if not cgroups:
        return None
    group = cgroups[0]
    name = "memory.limit_in_bytes" if group.v1 else "memory.max"
    limits = []
    for folder in (group.folder, *group.folder.parents):
        if not folder.is_relative_to(group.root):
            break
        with contextlib.suppress(OSError, ValueError):
            limits.append(int(_read(str(folder / name)).strip()))
    # No limit reads "max" (v2, skipped) or a huge number (v1).
    real = [limit for limit in limits if limit < 1 << 60]
    return min(real) // MB if real else None


@functools.cache
def _oom_kill_file() -> int | None:
    """A descriptor on the file of this process's memory cgroup that counts OOM kills (v2's
    memory.events counts the cgroups below too)."""
    for group in _memory_cgroups():
        name = group.folder / ("memory.oom_control" if group.v1 else "memory.events")
        with contextlib.suppress(OSError):
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC)
            if b"oom_kill " in os.pread(fd, 4096, 0):
                return fd
            os.close(fd)
    return None


def tree_rss(root_pid: int) -> tuple[list[int], int]:
    """`root_pid` and all its descendants, and the sum of their resident memory.

    One read of /proc/PID/stat (thread count and RSS) and one of each thread's
    /proc/PID/task/TID/children per process: walking only the tree, where psutil's
    `children(recursive=True)` reads every process on the node each time.
    """
    tree: list[int] = []
    total = 0
    pending = [root_pid]
    seen: set[int] = set()
    while pending:
        pid = pending.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            # Fields after the command name (which may hold spaces): state is [0],
            # num_threads [17], rss in pages [21].
            fields = _read(f"/proc/{pid}/stat").rsplit(b")", 1)[1].split()
            threads = [str(pid)] if fields[17] == b"1" else os.listdir(f"/proc/{pid}/task")
        except (OSError, IndexError):
            continue
        tree.append(pid)
        total += int(fields[21]) * _PAGE_SIZE
        for tid in threads:
            with contextlib.suppress(OSError):
                pending.extend(
                    int(child) for child in _read(f"/proc/{pid}/task/{tid}/children").split()
                )
    return tree, total


def process_tree(root_pid: int) -> list[int]:
    """`root_pid` and all its descendants (see `tree_rss`)."""
    return tree_rss(root_pid)[0]


def rss_bytes(pid: int) -> int:
    """Resident memory of one process (0 when it is gone)."""
    try:
        return int(_read(f"/proc/{pid}/statm").split()[1]) * _PAGE_SIZE
    except (OSError, IndexError, ValueError):
        return 0


def pss_bytes(pid: int) -> int:
    """Proportional set size of one process (0 when it is gone).

    /proc/PID/smaps_rollup directly (psutil reads more than PSS from it); psutil where the
    kernel has no rollup, RSS where PSS is not readable at all.
    """
    try:
        for line in _read(f"/proc/{pid}/smaps_rollup").splitlines():
            if line.startswith(b"Pss:"):
                return int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    except (OSError, ValueError, IndexError):
        return rss_bytes(pid)
    try:
        return int(psutil.Process(pid).memory_full_info().pss)
    except (psutil.Error, AttributeError):
        return rss_bytes(pid)


def tree_pss_bytes(root_pid: int) -> int:
    return sum(pss_bytes(pid) for pid in process_tree(root_pid))


def tmpfs_bytes(paths: tuple[str, ...]) -> int:
    """What the file systems at `paths` hold (0 for one that is gone)."""
    total = 0
    for path in paths:
        with contextlib.suppress(OSError):
            fs = os.statvfs(path)
            total += (fs.f_blocks - fs.f_bfree) * fs.f_frsize
    return total


def tree_processes(root_pid: int) -> list[psutil.Process]:
    """The tree as psutil handles, which remember each process's start time: killing
    through them later cannot hit an unrelated process that reused a pid."""
    processes = []
    for pid in process_tree(root_pid):
        with contextlib.suppress(psutil.Error):
            processes.append(psutil.Process(pid))
    return processes


def _mount_namespace(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def namespace_processes(
    tree: list[psutil.Process], shared: int | None = None
) -> list[psutil.Process]:
    """Every process on the node in the container's mount namespace(s), seen from `tree`, but
    the one process `shared` is in (the holder's, holder.py, which the environment's other
    containers share too).

    A daemon that double-forked out of a container without a process-tree anchor (the bash
    server cannot make itself a subreaper) is no longer in the tree, but it stays in the
    container's mount namespace, which no process outside the container shares.
    """
    ours = {_mount_namespace("self"), None}
    if shared is not None:
        ours.add(_mount_namespace(str(shared)))
    namespaces = {_mount_namespace(process.pid) for process in tree} - ours
    if not namespaces:
        return []
    members = []
    # Processes start and end while this walks /proc: each step tolerates one that is gone.
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _mount_namespace(entry) in namespaces:
            with contextlib.suppress(psutil.Error):
                members.append(psutil.Process(int(entry)))
    return members


def whole_container(root_pid: int, shared: int | None = None) -> list[psutil.Process]:
    """The container's process tree under `root_pid`, and what left the tree but stays in its
    mount namespace (not in the one `shared` is in). Walks /proc: on a node with thousands of
    processes, tens of ms."""
    tree = tree_processes(root_pid)
    return tree + namespace_processes(tree, shared)


def kill_processes(processes: list[psutil.Process]) -> None:
    """SIGKILL them all (it cannot be caught, so the order does not matter)."""
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.kill()


def wait_gone(processes: list[psutil.Process], timeout_sec: float) -> list[psutil.Process]:
    """Wait until none of them runs; the ones still running after `timeout_sec`.

    A zombie counts as gone: it is dead, only waiting for its parent (often the node's
    init, outside our reach) to collect its exit status.
    """
    deadline = time.monotonic() + timeout_sec
    while True:
        running = []
        for process in processes:
            with contextlib.suppress(psutil.Error):
                if process.status() != psutil.STATUS_ZOMBIE:
                    running.append(process)
        if not running or time.monotonic() >= deadline:
            return running
        processes = running
        time.sleep(0.02)


_PGALLOC = re.compile(rb"^pgalloc_\w+ (\d+)$", re.MULTILINE)


def allocated_bytes(vmstat: int) -> int:
    """What the node's kernel has allocated since boot, summed over its memory zones (the
    counters only grow: freeing does not lower them), read from `vmstat`, a descriptor on
    /proc/vmstat: the kernel writes the file anew for every read from its start, and keeping
    it open saves two of the three system calls of each tick."""
    return sum(int(pages) for pages in _PGALLOC.findall(os.pread(vmstat, 65536, 0))) * _PAGE_SIZE


class MemoryWatchdog:
    """Watches the process tree under `root_pid` from the process's shared watchdog thread;
    see the module docstring.

    `servers` gives the pids of the containers' command servers: their descendants are the
    task's processes, which an overrun kills one at a time, biggest first (`on_kill` is called
    from the thread after each); without it, or where killing the task's biggest process would
    not bring the tree under the threshold, the whole tree is killed and `on_breach` called.
    """

    def __init__(
        self,
        root_pid: int,
        *,
        limit_bytes: int,
        kill_fraction: float = 0.95,
        interval_sec: float = 0.05,
        tmpfs_paths: tuple[str, ...] = (),
        on_breach: Callable[[MemoryBreach], None] | None = None,
        servers: Callable[[], list[int]] | None = None,
        on_kill: Callable[[OomKill], None] | None = None,
    ) -> None:
        self.root_pid = root_pid
        # Further trees counted with it (`add_root`).
        self.other_roots: tuple[int, ...] = ()
        self.tmpfs_paths = tmpfs_paths
        self.limit_bytes = limit_bytes
        self.threshold_bytes = int(limit_bytes * kill_fraction)
        self.interval_sec = interval_sec
        self.breach: MemoryBreach | None = None
        self.kills: list[OomKill] = []
        self._servers = servers
        self._on_kill = on_kill
        self.checks = 0  # how often the tree's memory was summed
        self._on_breach = on_breach
        # A handle that knows the root's start time: a pid reused after it ended is not it.
        self._root: psutil.Process | None = None
        with contextlib.suppress(psutil.Error):
            self._root = psutil.Process(root_pid)
        # What the last check found (PSS where it read PSS), and the node's allocation
        # counter and the time when it looked; None: look at the next tick.
        self._memory: int | None = None
        self._allocated_at = 0
        self._checked_at = 0.0
        self.next_tick = 0.0
        # Held while the shared thread checks this tree: stop() waits for a kill under way.
        self._checking = threading.RLock()
        self._stopped = False

    def add_root(self, pid: int, tmpfs_paths: tuple[str, ...]) -> None:
        """Count the process tree under `pid` too (a compose service of the pod), and its
        tmpfs mounts."""
        self.other_roots = (*self.other_roots, pid)
        self.tmpfs_paths += tmpfs_paths

    def _trees(self) -> tuple[list[int], int]:
        pids, rss = [], 0
        for root in (self.root_pid, *self.other_roots):
            tree, size = tree_rss(root)
            pids += tree
            rss += size
        return pids, rss

    def start(self) -> None:
        _SHARED.add(self)

    def stop(self) -> None:
        """Stop watching; a check under way ends first (it may still kill the tree)."""
        with self._checking:
            self._stopped = True
        _SHARED.remove(self)

    def check(self) -> MemoryBreach | None:
        """One check; kills the tree and returns the breach when the tree is over the threshold."""
        self.checks += 1
        tree, rss = self._trees()
        in_tmpfs = tmpfs_bytes(self.tmpfs_paths)
        self._memory = rss + in_tmpfs
        if self._memory <= self.threshold_bytes:
            return None
        sizes = {pid: pss_bytes(pid) for pid in tree}
        pss = sum(sizes.values())
        self._memory = pss + in_tmpfs
        if self._memory <= self.threshold_bytes:
            return None
        if self._kill_biggest(sizes):
            return None
        # Recorded before the kill: whoever sees the container die asks for the reason.
        self.breach = MemoryBreach(
            pss + in_tmpfs, self.threshold_bytes, self.limit_bytes, tmpfs_bytes=in_tmpfs
        )
        for root in (self.root_pid, *self.other_roots):
            kill_processes(tree_processes(root))
        return self.breach

    def _kill_biggest(self, sizes: dict[int, int]) -> bool:
        """Kill the task's biggest process where that brings the container under the
        threshold (what Docker's OOM killer would end); whether it did."""
        if self._servers is None:
            return False
        servers = self._servers()
        task = {pid for server in servers for pid in process_tree(server)} - set(servers)
        candidates = [(size, pid) for pid, size in sizes.items() if pid in task]
        if not candidates:
            return False
        size, pid = max(candidates)
        if self._memory is None or self._memory - size > self.threshold_bytes:
            return False
        try:
            victim = psutil.Process(pid)
            command = " ".join(" ".join(victim.cmdline()).split())[:120] or victim.name()
            victim.kill()
        except psutil.Error:
            return True  # it ended meanwhile: look again at the next tick
        kill = OomKill(pid, command, size, self._memory, self.threshold_bytes, self.limit_bytes)
        self.kills.append(kill)
        if self._on_kill is not None:
            self._on_kill(kill)
        # Its pages are freed as it exits: gone (or a zombie) before the next look, which would
        # otherwise count them still and kill another.
        wait_gone([victim], 2.0)
        self._memory = None
        return True

    def tick(self, now: float, allocated: int | None) -> bool:
        """One tick of the shared thread: check the tree if it may have reached the threshold
        since the last check. False once there is nothing more to watch."""
        with self._checking:
            if self._stopped:
                return False
            if (
                self._memory is not None
                and allocated is not None
                and now < self._checked_at + RECHECK_SEC
                and allocated - self._allocated_at < self.threshold_bytes - self._memory
            ):
                return True
            if self._root is None or not self._root.is_running():
                return False
            self._allocated_at, self._checked_at = allocated or 0, now
            breach = self.check()
        if breach is None:
            return True
        if self._on_breach is not None:
            self._on_breach(breach)
        return False


class _Watched(Protocol):
    """What the shared thread ticks: a memory watchdog, or a disk one (DiskWatchdog)."""

    interval_sec: float
    next_tick: float

    def tick(self, now: float, allocated: int | None) -> bool: ...


class _SharedThread:
    """The one thread that runs every started watchdog of the process: N environments
    cost one wake-up and one read of the allocation counter per tick, not N threads polling.
    With nothing to watch it sleeps until a watchdog starts."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._watchdogs: list[_Watched] = []
        self._thread: threading.Thread | None = None
        # A child forked while the thread held the lock would wait for it forever, and the
        # parent's trees are not the child's to watch.
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._changed = threading.Condition()
        self._watchdogs = []
        self._thread = None

    def add(self, watchdog: _Watched) -> None:
        with self._changed:
            watchdog.next_tick = 0.0
            self._watchdogs.append(watchdog)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="memory-watchdog", daemon=True
                )
                self._thread.start()
            self._changed.notify()

    def remove(self, watchdog: _Watched) -> None:
        with self._changed:
            if watchdog in self._watchdogs:
                self._watchdogs.remove(watchdog)

    def _run(self) -> None:
        vmstat: int | None = None
        with contextlib.suppress(OSError):
            vmstat = os.open("/proc/vmstat", os.O_RDONLY)
        while True:
            with self._changed:
                now = time.monotonic()
                due = [watchdog for watchdog in self._watchdogs if watchdog.next_tick <= now]
                if not due:
                    wake_at = min((w.next_tick for w in self._watchdogs), default=None)
                    self._changed.wait(None if wake_at is None else wake_at - now)
                    continue
            allocated = None  # without the counter, every tick checks every tree
            if vmstat is not None:
                with contextlib.suppress(OSError, ValueError):
                    allocated = allocated_bytes(vmstat)
            for watchdog in due:
                if not watchdog.tick(now, allocated):
                    self.remove(watchdog)
                # On a grid of the interval: watchdogs started at different times share
                # their ticks, and a check longer than the interval skips ticks rather than
                # turning this into a busy loop.
                interval = watchdog.interval_sec
                watchdog.next_tick = (math.floor(time.monotonic() / interval) + 1) * interval


_SHARED = _SharedThread()


# The disk a task's writes may take beyond its storage_mb before the next process that writes
# is killed too: room for what the verifier writes after a kill (its reward, its logs).
DISK_SLACK_BYTES = 16 * MB


@dataclass(frozen=True)
class DiskKill:
    """A process of the task's the disk watchdog killed: the one that wrote most since the
    last look, when the container's disk passed the task's storage_mb."""

    pid: int
    command: str
    written_bytes: int
    disk_bytes: int
    limit_bytes: int

    def describe(self) -> str:
        return (
            f"out of disk: killed process {self.pid} ({self.command}), which wrote "
            f"{-(-self.written_bytes // MB)} MB, when the container's files reached "
            f"{-(-self.disk_bytes // MB)} MB, over the task's storage_mb of "
            f"{self.limit_bytes // MB} MB; the task goes on"
        )


def folder_bytes(folder: str) -> int:
    """The disk the files under `folder` take (allocated blocks; folders it may not read, such
    as a container user's private ones, count as empty)."""
    total, pending = 0, [folder]
    while pending:
        with contextlib.suppress(OSError), os.scandir(pending.pop()) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    stat = entry.stat(follow_symlinks=False)
                    total += stat.st_blocks * 512
                    if entry.is_dir(follow_symlinks=False):
                        pending.append(entry.path)
    return total


def written_bytes(pid: int) -> int | None:
    """What process `pid` has written to storage (/proc/PID/io's write_bytes), None when gone."""
    try:
        for line in _read(f"/proc/{pid}/io").splitlines():
            if line.startswith(b"write_bytes:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


class DiskWatchdog:
    """Holds a container's files (everything under `folder`: its root's upper, its staging
    folder) to the task's storage_mb, so that one task cannot fill a node's scratch disk: once
    they pass it, the task's process that wrote most since the last look is killed (the task
    goes on, as a `dd` that met a full disk does), and another only once the files grew by
    DISK_SLACK_BYTES more. `servers` gives the containers' command servers, whose descendants
    are the task's processes.

    Like the memory watchdog, it runs in the shared thread and looks cheaply first: the files
    are summed (a walk of the upper) only once the scratch file system's own use grew by the
    headroom left below the limit since the last sum, or RECHECK_SEC passed."""

    def __init__(
        self,
        folder: Path,
        *,
        limit_bytes: int,
        servers: Callable[[], list[int]],
        on_kill: Callable[[DiskKill], None] | None = None,
        interval_sec: float = 0.1,
    ) -> None:
        self.folder = str(folder)
        self.limit_bytes = limit_bytes
        self.interval_sec = interval_sec
        self.next_tick = 0.0
        self.kills: list[DiskKill] = []
        self.checks = 0
        self._servers = servers
        self._on_kill = on_kill
        self._usage: int | None = None
        self._fs_used_at = 0
        self._checked_at = 0.0
        self._killed_at = 0  # the files' size at the last kill
        self._written: dict[int, int] = {}  # each task process's write_bytes at the last look
        self._lock = threading.Lock()
        self._stopped = False

    def start(self) -> None:
        _SHARED.add(self)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
        _SHARED.remove(self)

    def _fs_used(self) -> int | None:
        try:
            fs = os.statvfs(self.folder)
        except OSError:
            return None
        return (fs.f_blocks - fs.f_bfree) * fs.f_frsize

    def tick(self, now: float, allocated: int | None) -> bool:
        with self._lock:
            if self._stopped:
                return False
            fs_used = self._fs_used()
            if fs_used is None:
                return False  # the folder is gone: the container ended
            if (
                self._usage is not None
                and now < self._checked_at + RECHECK_SEC
                and fs_used - self._fs_used_at < self.limit_bytes - self._usage
            ):
                return True
            self._fs_used_at, self._checked_at = fs_used, now
            kill = self.check()
        if kill is not None and self._on_kill is not None:
            self._on_kill(kill)
        return True

    def check(self) -> DiskKill | None:
        """Sum the files; over the limit, kill the task's biggest writer since the last look."""
        self.checks += 1
        usage = folder_bytes(self.folder)
        self._usage = usage
        servers = self._servers()
        task = {pid for server in servers for pid in process_tree(server)} - set(servers)
        written = {pid: size for pid in task if (size := written_bytes(pid)) is not None}
        grown = {pid: size - self._written.get(pid, 0) for pid, size in written.items()}
        self._written = written
        if usage <= self.limit_bytes or usage < self._killed_at + DISK_SLACK_BYTES:
            return None
        size, pid = max(((size, pid) for pid, size in grown.items()), default=(0, 0))
        if size <= 0:
            return None
        try:
            victim = psutil.Process(pid)
            command = " ".join(" ".join(victim.cmdline()).split())[:120] or victim.name()
            victim.kill()
        except psutil.Error:
            return None
        self._killed_at = usage
        kill = DiskKill(pid, command, size, usage, self.limit_bytes)
        self.kills.append(kill)
        return kill
