"""A container's root as an overlay of our own, mounted in namespaces the environment holds.

Apptainer mounts its kernel overlay without `userxattr`: in its user namespace the overlay cannot
keep its xattrs, and renaming a directory fails (EXDEV: dpkg fails). From a .sif it stacks
fuse-overlayfs on squashfuse instead, two FUSE daemons every file goes through. So each
environment holds a user, mount and pid namespace of its own (`Holder`: root there is the user,
the user's /etc/subuid range the image's other users, as Apptainer's --fakeroot maps them; a user
without a range is root alone there, and Apptainer's fakeroot command, nested, fakes the rest, as
Apptainer alone does for that user), and in
it mounts each of its containers' roots: the kernel's overlay with `userxattr` (Linux 5.11 and
later), its lower the image unpacked on the node (roots.py) or else the .sif's squashfs through
squashfuse (a first use needs no unpack), its upper and work folders on the trial's scratch disk.
Apptainer runs nested in the namespaces, as root there, on the merged folder with `--writable`.

Where a node refuses it (`root_path`, asked once per process and scratch disk), the next best:
Apptainer's own overlay on the .sif (kernels before 5.11, no user namespaces of our own, a
scratch disk the overlay takes no upper on). fuse-overlayfs mounted in our namespace was tried
as a step between: dpkg and renames work there, but the image's other users cannot execute
its files (`su nobody -c sh`: "Operation not supported"), which Apptainer's own overlay allows.
`harbor-hpc doctor` says which path the node takes and why. Holders are started ahead (a spare
per process, `Holder.take`), so their start is off the environment's.

The namespaces' first process (templates/root_holder.py) mounts what the driver asks, reaps the
namespace's orphans, and ends when the driver does, even by SIGKILL: its stdin is the driver's
pipe. Its end takes every process and mount of the namespaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil

from harbor_hpc.containers.gpus import driver_files
from harbor_hpc.containers.sif import root_partition
from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.core.proc import run
from harbor_hpc.core.scratch import remove_private_dir
from harbor_hpc.core.templates import template_path
from harbor_hpc.runtimes.apptainer import find_apptainer

HOLD = (
    *("unshare", "--user", "--map-root-user", "--mount", "--pid"),
    *("--fork", "--kill-child", "--mount-proc"),
)
# The user's /etc/subuid and /etc/subgid ranges for the image's other users, as --fakeroot maps
# them; without a range, root alone (Apptainer's fakeroot command, nested, fakes the rest:
# runtimes/apptainer.py ONE_ID_FLAGS).
WITH_RANGES = ("--map-auto",)


def hold(subids: bool) -> tuple[str, ...]:
    """`unshare` making the namespaces, mapping the user's ranges where `subids`."""
    return (*HOLD, *WITH_RANGES) if subids else HOLD


# The overlay's options: `userxattr` keeps its xattrs in the user namespace; `volatile` skips
# its syncs of the upper's whole filesystem (the node's scratch disk, which other users write
# too): an unmount synced it, so each container's stop waited on the node's writeback. An
# upper lives as long as its container and is never mounted again.
OVERLAY_OPTIONS = "userxattr,volatile"
# Mount points every container needs in its root (Apptainer makes none in a --writable folder).
BASE_DIRS = ("/dev", "/proc", "/sys", "/tmp", "/var/tmp")
START_TIMEOUT_S = 30.0
MOUNT_TIMEOUT_S = 150.0


@dataclass(frozen=True)
class RootPath:
    """The path containers' roots take on a node: `own` (the kernel's overlay in our own
    namespaces), or Apptainer's own overlay on the .sif, `why` saying why."""

    own: bool
    why: str = ""
    subids: bool = True  # the namespaces map the user's /etc/subuid range (else root alone)

    def describe(self, runtime: str = "apptainer") -> str:
        """In the words of the trial's log and doctor, for the containers `runtime` starts."""
        ids = ""
        if not self.subids:
            rest = (
                "Apptainer's fakeroot command fakes the rest"
                if runtime == "apptainer"
                else "enroot has no fakeroot command: chown to the image's other users, and "
                "useradd, fail"
            )
            ids = f" (root alone: no /etc/subuid range; {rest})"
        if self.own:
            return f"the kernel's overlay (userxattr) in a user namespace of its own{ids}"
        return f"Apptainer's own overlay on the .sif ({self.why})"


class HolderFailed(RuntimeError):
    """The namespaces could not be made or a root not mounted: the words say why."""


def helper(name: str) -> str | None:
    """`name` (squashfuse_ll) on PATH, else the one Apptainer ships beside it."""
    found = shutil.which(name)
    if found:
        return found
    try:
        apptainer = Path(os.path.realpath(find_apptainer()))
    except HarborHpcError:
        return None
    shipped = apptainer.parent.parent / "libexec" / "apptainer" / "bin" / name
    return str(shipped) if os.access(shipped, os.X_OK) else None


_paths: dict[tuple[Path, bool], RootPath] = {}
_paths_lock = threading.Lock()


def give_up(scratch: Path, why: str) -> None:
    """This process's containers with upper folders in `scratch` take Apptainer's own overlay
    from now on: `why` (the site refused a folder as a container, say)."""
    with _paths_lock:
        for subids in (False, True):
            _paths[scratch, subids] = RootPath(False, why, subids)


def root_path(scratch: Path, *, subids: bool) -> RootPath:
    """The path containers' roots take with upper folders in `scratch` for this user (`subids`:
    whether the user has an /etc/subuid and /etc/subgid range): tried once per process."""
    with _paths_lock:
        if (scratch, subids) not in _paths:
            _paths[scratch, subids] = _probe(scratch, subids)
        return _paths[scratch, subids]


def _probe(scratch: Path, subids: bool) -> RootPath:
    if {",", ":"} & set(str(scratch)):
        why = f"the scratch folder {scratch} holds ',' or ':' (overlays refuse it)"
        return RootPath(False, why, subids)
    if helper("squashfuse_ll") is None:
        return RootPath(False, "no squashfuse_ll (squashfuse) to mount the .sif with", subids)
    refused = _try_overlay(scratch, subids)
    if refused is None:
        return RootPath(True, "", subids)
    if "unrecognized option" in refused:
        why = f"this node's unshare is older than util-linux 2.38: {refused}"
        return RootPath(False, why, subids)
    why = f"the kernel's overlay with {OVERLAY_OPTIONS} (Linux 5.11 and later) refused: {refused}"
    return RootPath(False, why, subids)


def _try_overlay(scratch: Path, subids: bool) -> str | None:
    """Mount the kernel's overlay in a namespace of our own over a lower folder in `scratch`,
    and rename a directory of the lower in it: None when that works, else why not."""
    try:
        folder = Path(tempfile.mkdtemp(prefix="harbor-hpc-probe-", dir=scratch))
    except OSError as exc:
        return f"cannot write in {scratch}: {exc.strerror}"
    try:
        for name in ("lower/a", "upper", "work", "merged"):
            (folder / name).mkdir(parents=True)
        dirs = f"lowerdir={folder}/lower,upperdir={folder}/upper,workdir={folder}/work"
        mount = f"mount -t overlay overlay -o {dirs},{OVERLAY_OPTIONS} {folder}/merged"
        done = run(
            [*hold(subids), "sh", "-c", f"{mount} && mv {folder}/merged/a {folder}/merged/b"],
            timeout=START_TIMEOUT_S,
        )
        return None if done.ok else " ".join(done.why().split())
    finally:
        remove_private_dir(folder)


def bind_targets(options: Sequence[str]) -> tuple[list[str], list[str]]:
    """The folders and files Apptainer's `-B SOURCE:TARGET[:OPTIONS]` options in `options` bind
    onto (and its --nv or --rocm, the GPU driver's tools): their mount points, which a --writable
    root must have."""
    dirs: list[str] = list(BASE_DIRS)
    files: list[str] = []
    for driver in {"--nv", "--rocm"} & set(options):
        files += driver_files(driver)
    for flag, value in itertools.pairwise(options):
        if flag not in {"-B", "--bind"}:
            continue
        source, _, rest = value.partition(":")
        target, _, extra = rest.partition(":")
        target = target or source
        image_bind = "image-src" in extra
        (files if os.path.isfile(source) and not image_bind else dirs).append(target)
    return dirs, files


# Docker's default /dev/shm (`shm_size`): a task that writes more there meets a full disk.
DOCKER_SHM_BYTES = 64 * 1024 * 1024


def shm_bind(state: Path) -> list[str]:
    """Apptainer's option binding the /dev/shm `mount` made in `state` at /dev/shm."""
    return ["-B", f"{state / 'shm'}:/dev/shm"]


class Holder:
    """An environment's own user, mount and pid namespaces, in which its containers' roots are
    mounted (`mount`) and its containers run (`enter`), until `stop`. `take` gives one."""

    def __init__(self, subids: bool) -> None:
        self.subids = subids
        self._process: subprocess.Popen[bytes] | None = None
        self._init: int | None = None  # the host pid of the namespaces' first process
        self._asking = threading.Lock()

    @classmethod
    async def take(cls, path: RootPath) -> Holder:
        """A started holder for `path` (its ids): the spare this process started beforehand
        where it has one (its start is then off the environment's), and another spare started
        for the next."""
        assert path.own
        subids = path.subids
        with _spares_lock:
            spare = _spares.pop(subids, None)
            _spares[subids] = _starting.submit(cls._started, subids)
        if spare is not None:
            with contextlib.suppress(HolderFailed):
                holder = await asyncio.wrap_future(spare)
                if holder.alive():
                    return holder
                await holder.stop()
        return await asyncio.to_thread(cls._started, subids)

    @classmethod
    def _started(cls, subids: bool) -> Holder:
        holder = cls(subids)
        try:
            holder._start()
        except BaseException:
            holder._end()
            raise
        return holder

    def _start(self) -> None:
        self._process = subprocess.Popen(
            [*hold(self.subids), sys.executable, "-I", "-S", str(template_path("root_holder.py"))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        greeting = self._answer(START_TIMEOUT_S)
        if "ready" not in greeting:
            raise HolderFailed(f"the namespaces did not start: {greeting}")
        children = psutil.Process(self._process.pid).children()
        if not children:
            raise HolderFailed("the namespaces' first process is gone")
        self._init = children[0].pid

    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def _answer(self, timeout: float) -> dict[str, object]:
        """The first process's next line (within `timeout` seconds), parsed."""
        assert self._process is not None and self._process.stdout is not None
        answering = select.poll()  # not select(): a fleet's descriptors pass 1024
        answering.register(self._process.stdout, select.POLLIN)
        line = self._process.stdout.readline() if answering.poll(timeout * 1000) else b""
        if not line:
            self._end()
            said = self._process.stderr.read(4096) if self._process.stderr else b""
            raise HolderFailed(" ".join(said.decode(errors="replace").split()) or "no answer")
        answer: dict[str, object] = json.loads(line)
        return answer

    @property
    def pid(self) -> int | None:
        """The host pid of the namespaces' first process, while they are held."""
        return self._init

    def enter(self, net_of: int | None = None) -> list[str]:
        """The command that runs what follows it in the namespaces (and in the network namespace
        of host pid `net_of`, the pod's)."""
        assert self._init is not None, "the holder is not started"
        enter = ["nsenter", "-t", str(self._init), "-U", "-m", "-p", "--preserve-credentials"]
        if net_of is not None:
            enter.append(f"--net=/proc/{net_of}/ns/net")
        return [*enter, "--"]

    async def mount(
        self,
        state: Path,
        sif: Path,
        lower: Path | None,
        targets: tuple[list[str], list[str]],
        above: Sequence[Path] = (),
    ) -> Path:
        """Mount a container's root: `lower` (an unpacked root) or else `sif`'s squashfs, with
        the layers `above` it (a snapshot's, topmost first: snapshot.py), under an upper and
        work folder in `state`; the mount points `targets` (dirs, files) made in it; and a
        tmpfs of Docker's default size at `state`/shm, its /dev/shm (`shm_bind`). The merged
        folder."""
        for name in ("upper", "work", "merged", "image", "shm"):
            (state / name).mkdir(parents=True)
        request: dict[str, object] = {
            "lower": str(lower or state / "image"),
            "above": [str(layer) for layer in above],
            "upper": str(state / "upper"),
            "work": str(state / "work"),
            "merged": str(state / "merged"),
            "dirs": targets[0],
            "files": targets[1],
            "shm": str(state / "shm"),
            "shm_size": DOCKER_SHM_BYTES,
            "options": OVERLAY_OPTIONS,
        }
        if lower is None:
            partition = root_partition(sif)
            if partition is None:
                raise HolderFailed(f"{sif} has no squashfs root to mount")
            request |= {"sif": str(sif), "offset": partition.offset}
            request["squashfuse"] = helper("squashfuse_ll")
        answer = await asyncio.to_thread(self._ask, request)
        if not answer.get("ok"):
            raise HolderFailed(f"its root over {lower or sif}: {answer.get('error')}")
        return state / "merged"

    def _ask(self, request: dict[str, object]) -> dict[str, object]:
        with self._asking:
            if self._process is None or self._process.stdin is None:
                raise HolderFailed("the namespaces are gone")
            try:
                self._process.stdin.write(json.dumps(request).encode() + b"\n")
                self._process.stdin.flush()
            except OSError as exc:
                raise HolderFailed(f"the namespaces are gone ({exc})") from exc
            return self._answer(MOUNT_TIMEOUT_S)

    async def stop(self) -> None:
        """End the namespaces: every process and mount in them goes."""
        await asyncio.to_thread(self._end)

    def _end(self) -> None:
        process, self._process = self._process, None
        init, self._init = self._init, None
        if init is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(init, signal.SIGKILL)
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            process.communicate()


# Holders started ahead, one per mapping (`Holder.take`), on a thread of their own.
_spares: dict[bool, Future[Holder]] = {}
_spares_lock = threading.Lock()
_starting = ThreadPoolExecutor(max_workers=1, thread_name_prefix="harbor-hpc-holder")
