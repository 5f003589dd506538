"""Whether Apptainer can run task containers here, for this user, probed for real.

The runtime needs a binary that starts (the environment's `preflight`), a flag set that runs
images (`runtime.run_flags`) and the task container as `runtime.task_container_command` starts
it. These probes try exactly those, and the host facts they depend on (user namespaces, subuid
ranges, /dev/fuse, squashfuse, a setuid starter, slirp4netns), on a tiny image of their own:
`harbor-hpc doctor` shows what they find, with what to do about each gap. `build_findings` does
the same for `build --builder apptainer` (the build role): a real `apptainer build --fakeroot`,
whether its RUN steps can be other users (a subuid range), and the scratch space builds unpack
images into. Every probe is bounded in time (core.proc) and reports a failure as a `Finding`,
never an exception.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import resource
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from harbor_hpc.containers import gpus
from harbor_hpc.containers.container import IMAGE_VIEW, server_mounts
from harbor_hpc.containers.holder import root_path
from harbor_hpc.containers.limits import ONE_ID
from harbor_hpc.containers.network import (
    egress_problem,
    netns_problem,
    network_hint,
    own_network_problem,
)
from harbor_hpc.containers.roots import UNPACK_AS_ROOT
from harbor_hpc.containers.sif import node_architecture, write_sif
from harbor_hpc.core.config import load_config
from harbor_hpc.core.errors import HarborHpcError, InputError
from harbor_hpc.core.files import file_lock, filesystem_type
from harbor_hpc.core.probe import Finding, Status, current_user
from harbor_hpc.core.proc import Ran, run
from harbor_hpc.core.scratch import PrivateDir
from harbor_hpc.images.layers import squash_command
from harbor_hpc.runtimes import container_runtime
from harbor_hpc.runtimes.apptainer import (
    CANDIDATE_FLAGS,
    FAKEROOT,
    FAKEROOT_HINT,
    OVERLAY_OFF,
    OVERLAY_OFF_FIX,
    PROBE_TIMEOUT_S,
    SQUASHFS_COMPRESSION,
    TESTED,
    ZSTD_MINIMUM,
    Compression,
    apptainer_here,
    apptainer_version,
    build_command,
    find_apptainer,
    first_that_runs,
    refuses_overlay_folders,
    sif_compression,
    site_policy_fix,
    task_container_command,
)
from harbor_hpc.runtimes.enroot import find_enroot, private_env

log = logging.getLogger(__name__)

BUILD_TIMEOUT_S = 120.0
LOW_FREE_BYTES = 10 * 2**30
_INSTALL_FIX = (
    "`module load apptainer` (or singularity) on a cluster, else install Apptainer; "
    "HARBOR_HPC_APPTAINER=/path/to/apptainer names a binary off PATH"
)
_BROKEN_FIX = "the install looks broken: reinstall it, or load another module"


def findings(cache_dir: Path) -> list[Finding]:
    """Everything about Apptainer here: the install, the host's support for it, and a real run
    of an image in each mode the runtime may use (the image is kept in `cache_dir`); or, where
    enroot is the runtime (a node without Apptainer), what enroot's containers get here."""
    try:
        chosen = container_runtime()
    except HarborHpcError as exc:
        return [Finding("runtime", Status.MISSING, exc.message, exc.hint or "")]
    if chosen.name == "enroot":
        return enroot_findings()
    install = install_findings()
    if any(finding.status is Status.MISSING for finding in install):
        return install
    binary = find_apptainer()
    build_config = apptainer_build_config(binary)
    userns = userns_finding()
    found = [
        *install,
        userns,
        setuid_finding(build_config),
        subid_finding(),
        container_root_finding(),
        unpacked_roots_finding(),
        fuse_finding(),
        squashfuse_finding(build_config),
        trial_scratch_finding(),
        network_finding(),
        network_policy_finding(),
        compose_finding(),
        gpu_finding(),
        fleet_finding(),
    ]
    if userns.status is not Status.OK and not _is_setuid_root(_suid_starter_path(build_config)):
        found.append(
            Finding(
                "privileges",
                Status.MISSING,
                "neither unprivileged user namespaces nor a setuid install",
                "an admin enables user namespaces (sysctl user.max_user_namespaces=15000) "
                "or installs apptainer-suid",
            )
        )
    enroot = find_enroot()
    if enroot is not None:
        found.append(
            Finding("runtime", Status.OK, f"Apptainer; enroot too ({enroot}): runtime=enroot")
        )
    return [*found, *run_findings(binary, cache_dir)]


def enroot_findings() -> list[Finding]:
    """enroot as the runtime (enroot.py): it starts containers on a root of our own only, so
    that root's path must be open here; GPUs are not passed to its containers yet."""
    (install,) = enroot_install_findings()
    if install.status is Status.MISSING:
        return [install]
    try:
        beside = f"; Apptainer too ({find_apptainer()}): runtime=apptainer takes it"
    except HarborHpcError:
        beside = ", no Apptainer"
    found = [
        Finding(install.name, install.status, install.detail + beside),
        userns_finding(),
        subid_finding(),
    ]
    if not apptainer_here():
        found.append(layer_convert_finding())
    return [
        *found,
        container_root_finding("enroot"),
        unpacked_roots_finding(),
        trial_scratch_finding(),
        network_finding(),
        network_policy_finding(),
        compose_finding(),
        Finding(
            "gpus",
            Status.WARN,
            "not passed to enroot's containers yet: tasks that ask for GPUs fail",
            "run them on nodes with Apptainer (runtime=apptainer)",
        ),
    ]


def layer_convert_finding() -> Finding:
    """`convert` where there is no Apptainer: the image's layers laid out and squashed by
    us (images/layers.py), as root of a user namespace, with mksquashfs."""
    missing = [name for name in ("unshare", "mksquashfs") if shutil.which(name) is None]
    if missing:
        return Finding(
            "convert",
            Status.MISSING,
            f"no Apptainer, and no {' or '.join(missing)} to make .sif files from image layers",
            "install squashfs-tools and util-linux, or convert where Apptainer is",
        )
    owners = "" if not missing_subid_ranges() else " (every file root's: no /etc/subuid range)"
    return Finding(
        "convert", Status.OK, f".sif files made from the images' layers, without Apptainer{owners}"
    )


_VERSION_FIX = (
    "load a newer Apptainer (`module load apptainer`), or name one with HARBOR_HPC_APPTAINER"
)


def enroot_install_findings() -> list[Finding]:
    """The enroot binary (on PATH or HARBOR_HPC_ENROOT), and whether it starts at all."""
    binary = find_enroot()
    if binary is None:
        return [Finding("runtime", Status.MISSING, "enroot is not on PATH", "`module load enroot`")]
    with tempfile.TemporaryDirectory(prefix="harbor-hpc-enroot-") as folder:
        # As our containers run it: the site's enroot.conf is not theirs (enroot.private_env).
        version = run(["env", "-i", *private_env(Path(folder), Path(folder)), binary, "version"])
    if not version.ok:
        return [Finding("runtime", Status.MISSING, f"enroot: {version.why()}", _BROKEN_FIX)]
    return [Finding("runtime", Status.OK, f"enroot {version.stdout.strip()} ({binary})")]


def install_findings() -> list[Finding]:
    """The binary (on PATH or HARBOR_HPC_APPTAINER), and whether it starts at all."""
    try:
        binary = find_apptainer()
    except HarborHpcError as exc:
        return [Finding("binary", Status.MISSING, exc.message, _INSTALL_FIX)]
    version = run([binary, "--version"])
    if not version.ok:
        return [
            Finding("binary", Status.OK, binary),
            Finding("version", Status.MISSING, version.why(), _BROKEN_FIX),
        ]
    said = version.stdout.strip()
    parsed = apptainer_version(binary)
    problem = parsed.problem() if parsed is not None else None
    if problem is not None:
        found = Finding("version", Status.MISSING, problem, _VERSION_FIX)
    elif parsed is not None and parsed.release < ZSTD_MINIMUM:
        found = Finding(
            "version",
            Status.WARN,
            f"{said}: images are converted with gzip (zstd, which starts containers about twice "
            "as fast, needs Apptainer 1.4)",
            _VERSION_FIX,
        )
    else:
        found = Finding("version", Status.OK, f"{said} (tested: {TESTED})")
    return [Finding("binary", Status.OK, binary), found]


def install_problem(runtime: str | None = None) -> str | None:
    """None when the runtime that starts this node's containers (`container_runtime`, with
    the environment's `runtime` setting) is there and starts, else what is wrong and the fix."""
    try:
        chosen = container_runtime(runtime)
    except HarborHpcError as exc:
        return f"{exc.message}; {exc.hint}"
    install = install_findings() if chosen.name == "apptainer" else enroot_install_findings()
    for finding in install:
        if finding.status is Status.MISSING:
            return f"{finding.detail}; {finding.fix}"
    return None


def apptainer_build_config(binary: str) -> dict[str, str]:
    """`apptainer buildcfg` as a dict (install prefix, libexec dir, whether setuid)."""
    answer = run([binary, "buildcfg"])
    if not answer.ok:
        return {}
    pairs = (line.split("=", 1) for line in answer.stdout.splitlines() if "=" in line)
    return {key.strip(): value.strip() for key, value in pairs}


def userns_finding() -> Finding:
    """Whether this user may create a user namespace: the sysctls, then a real `unshare`."""
    limit = _read_int("/proc/sys/user/max_user_namespaces")
    if limit == 0:
        return Finding(
            "user namespaces",
            Status.WARN,
            "disabled (user.max_user_namespaces = 0)",
            "an admin runs `sysctl -w user.max_user_namespaces=15000`",
        )
    if _read_int("/proc/sys/kernel/unprivileged_userns_clone") == 0:
        return Finding(
            "user namespaces",
            Status.WARN,
            "disabled for unprivileged users (kernel.unprivileged_userns_clone = 0)",
            "an admin runs `sysctl -w kernel.unprivileged_userns_clone=1`",
        )
    attempt = run([sys.executable, "-c", "import os; os.unshare(os.CLONE_NEWUSER)"])
    if not attempt.ok:
        fix = "an admin allows unprivileged user namespaces (sysctl, AppArmor or seccomp policy)"
        return Finding("user namespaces", Status.WARN, attempt.why(), fix)
    return Finding("user namespaces", Status.OK, f"available (limit {limit})")


def setuid_finding(build_config: dict[str, str]) -> Finding:
    starter = _suid_starter_path(build_config)
    if _is_setuid_root(starter):
        return Finding("setuid", Status.OK, f"setuid install ({starter})")
    if not starter.exists():
        return Finding("setuid", Status.OK, "not a setuid install (uses namespaces)")
    return Finding(
        "setuid",
        Status.WARN,
        f"{starter} exists but is not setuid root",
        f"an admin runs `chown root {starter} && chmod u+s {starter}`, or removes it",
    )


def _suid_starter_path(build_config: dict[str, str]) -> Path:
    return Path(build_config.get("LIBEXECDIR", "/usr/libexec")) / "apptainer/bin/starter-suid"


def _is_setuid_root(path: Path) -> bool:
    try:
        mode = path.stat()
    except OSError:
        return False
    return mode.st_uid == 0 and bool(mode.st_mode & 0o4000)


def missing_subid_ranges() -> list[str]:
    """Those of /etc/subuid and /etc/subgid that hold no range for this user."""
    user, uid = current_user(), str(os.getuid())
    return [
        path for path in ("/etc/subuid", "/etc/subgid") if not _has_subid_range(path, user, uid)
    ]


def subid_finding() -> Finding:
    """`--fakeroot` maps the user onto a range from /etc/subuid and /etc/subgid."""
    user = current_user()
    absent = missing_subid_ranges()
    if absent:
        return Finding(
            "fakeroot ids",
            Status.WARN,
            f"no line for {user} in {' and '.join(absent)}: tasks run with {ONE_ID}",
            f"an admin adds `{user}:100000:65536` (a free range) to /etc/subuid and /etc/subgid",
        )
    if os.getuid() != 0 and not shutil.which("newuidmap"):
        return Finding(
            "fakeroot ids",
            Status.WARN,
            "newuidmap is not on PATH",
            "an admin installs the uidmap package",
        )
    return Finding("fakeroot ids", Status.OK, f"{user} has subuid and subgid ranges")


def container_root_finding(runtime: str = "apptainer") -> Finding:
    """Which path a task container's root takes on this node, and why not a faster one
    (holder.py), for the scratch folder trials use by default ($TMPDIR). enroot starts
    containers on a root of our own only: without one, none start."""
    path = root_path(Path(tempfile.gettempdir()), subids=not missing_subid_ranges())
    if path.own:
        detail = f"{path.describe(runtime)}; forks and snapshots: yes"
        return Finding("container root", Status.OK, detail)
    if "subuid" in path.why:
        hint = "the subuid and subgid ranges above"
    elif "squashfuse" in path.why:
        hint = "install squashfuse (its squashfuse_ll) on the nodes"
    else:
        hint = (
            "Linux 5.11 or later lets a user mount the kernel's overlay in a user namespace, "
            "on a local disk"
        )
    if runtime == "enroot":
        return Finding(
            "container root",
            Status.MISSING,
            f"{path.describe()}: enroot starts containers on a root of our own only",
            hint,
        )
    return Finding(
        "container root",
        Status.WARN,
        f"{path.describe()}; forks and snapshots: no (they copy a root of our own)",
        f"{hint}; meanwhile containers start and write as Apptainer alone gives them (named "
        "in each trial's log)",
    )


def unpacked_roots_finding() -> Finding:
    """Whether `unpacked_roots` can unpack images here, owners kept (roots.py)."""
    if shutil.which("unsquashfs") is None:
        return Finding(
            "unpacked roots",
            Status.WARN,
            "no unsquashfs on PATH: `unpacked_roots` runs every image from its .sif",
            "install squashfs-tools",
        )
    tried = run([*UNPACK_AS_ROOT, "true"])
    if tried.ok:
        return Finding(
            "unpacked roots",
            Status.OK,
            "images unpack with their owners (`unpacked_roots`: a reused image's root is read "
            "without FUSE)",
        )
    return Finding(
        "unpacked roots",
        Status.WARN,
        f"`{' '.join(UNPACK_AS_ROOT)}` fails ({tried.why()}): "
        "`unpacked_roots` runs every image from its .sif",
        "unshare of util-linux 2.38 or later, and the subuid and subgid ranges above",
    )


def _has_subid_range(path: str, user: str, uid: str) -> bool:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return False
    return any(line.split(":", 1)[0] in (user, uid) for line in lines if line.count(":") == 2)


def fuse_finding() -> Finding:
    """Unprivileged Apptainer mounts a SIF with squashfuse, which needs /dev/fuse."""
    if not os.path.exists("/dev/fuse"):
        return Finding(
            "/dev/fuse",
            Status.WARN,
            "absent: images are unpacked to a temporary folder at every start (slow)",
            "an admin loads the fuse module (`modprobe fuse`)",
        )
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return Finding(
            "/dev/fuse",
            Status.WARN,
            f"not readable and writable by {current_user()}: images are unpacked at every start",
            "an admin runs `chmod 666 /dev/fuse`",
        )
    return Finding("/dev/fuse", Status.OK, "readable and writable")


def squashfuse_finding(build_config: dict[str, str]) -> Finding:
    bundled = Path(build_config.get("LIBEXECDIR", "/usr/libexec")) / "apptainer/bin"
    for name in ("squashfuse_ll", "squashfuse"):
        found = shutil.which(name) or shutil.which(name, path=str(bundled))
        if found:
            return Finding("squashfuse", Status.OK, found)
    return Finding(
        "squashfuse",
        Status.WARN,
        "neither squashfuse_ll nor squashfuse found: images are unpacked at every start",
        "install squashfuse (`apt-get install squashfuse`, or `module load squashfuse`)",
    )


def network_finding() -> Finding:
    """A network namespace of its own for every container that may use the network."""
    problem = own_network_problem()
    if problem is None:
        return Finding("own network", Status.OK, "slirp4netns, /dev/net/tun usable")
    return Finding(
        "own network",
        Status.WARN,
        f"{problem}: containers with network share the node's (ports collide, none below 1024)",
        network_hint(),
    )


def network_policy_finding() -> Finding:
    """What a task may ask of its network beyond the internet (Harbor's capabilities)."""
    problem = egress_problem()
    if problem is None:
        return Finding(
            "network policies",
            Status.OK,
            "no network, allowlists (hostnames, *.wildcards, IPv4/IPv6 addresses and CIDRs), "
            "a policy per phase",
        )
    if netns_problem() is not None:
        return Finding(
            "network policies",
            Status.WARN,
            f"none: {problem}; tasks that ask for no network, an allowlist or a policy per "
            "phase are refused",
            network_hint(),
        )
    return Finding(
        "network policies",
        Status.WARN,
        f"no network only: {problem}; tasks with an allowlist or a policy per phase are refused",
        network_hint() if own_network_problem() else "an admin installs nftables (`nft`)",
    )


def compose_finding() -> Finding:
    """Whether a compose task's services can run beside it (pod.py): `nsenter` joins them to
    the task's namespaces; without a network of its own they share the node's."""
    if shutil.which("nsenter") is None:
        return Finding(
            "compose services",
            Status.WARN,
            "nsenter is not on PATH: compose tasks fail to start",
            "an admin installs util-linux",
        )
    if own_network_problem() is None:
        return Finding(
            "compose services",
            Status.OK,
            "each service in its own image beside the task, one network namespace (a pod)",
        )
    return Finding(
        "compose services",
        Status.WARN,
        "services run beside the task on the node's network (their ports collide with other "
        "users')",
        network_hint(),
    )


# What one idle environment holds, measured at 16 to 512 at once (bench/bench_fleet.py): its
# container's processes and threads (ulimit -u counts each), its process's open files, and the
# memory (PSS) of its container's tree; and a user namespace.
TASKS_PER_ENVIRONMENT = 25
FILES_PER_ENVIRONMENT = 9
MB_PER_ENVIRONMENT = 25
# A node that holds fewer of one user's environments at once than this is worth a warning.
FLEET_WARN_BELOW = 256
# What Apptainer and the kernel say when a limit of the node runs out, and which limit it is.
_RAN_OUT = {
    "Resource temporarily unavailable": "processes and threads (ulimit -u)",
    "Too many open files": "open files (ulimit -n)",
    "Cannot allocate memory": "memory",
    "No space left on device": "user namespaces (user.max_user_namespaces) or disk space",
}


def ran_out(said: str) -> str | None:
    """Which of the node's limits a failed start's words `said` name, as a sentence; None."""
    for words, limit in _RAN_OUT.items():
        if words in said:
            return (
                f"this node ran out of {limit} for you ({words!r}): each environment holds about "
                f"{TASKS_PER_ENVIRONMENT} processes and threads, {FILES_PER_ENVIRONMENT} open "
                f"files and {MB_PER_ENVIRONMENT} MB; `harbor-hpc doctor` says how many fit here"
            )
    return None


def fleet_finding() -> Finding:
    """How many environments this node holds for this user at once, and what runs out first."""
    bounds: dict[str, int] = {}
    processes = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    if processes != resource.RLIM_INFINITY:
        bounds[f"processes and threads (ulimit -u {processes})"] = (
            processes // TASKS_PER_ENVIRONMENT
        )
    files = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if files != resource.RLIM_INFINITY:
        # The hard limit: the environment raises its process's soft limit to it.
        bounds[f"open files of one process (ulimit -Hn {files})"] = files // FILES_PER_ENVIRONMENT
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) // 1024
                bounds[f"memory ({available} MB available)"] = available // MB_PER_ENVIRONMENT
    with contextlib.suppress(OSError, ValueError):
        namespaces = int(Path("/proc/sys/user/max_user_namespaces").read_text())
        bounds[f"user namespaces (user.max_user_namespaces {namespaces})"] = namespaces
    if not bounds:
        return Finding("fleet", Status.OK, "no limit of this node's bounds how many environments")
    first = min(bounds, key=lambda name: bounds[name])
    fit = bounds[first]
    detail = (
        f"room for about {fit} environments at once for you here, beside what their tasks use "
        f"(memory_mb, cpus): {first} runs out first (each holds about "
        f"{TASKS_PER_ENVIRONMENT} processes and threads, {FILES_PER_ENVIRONMENT} open files, "
        f"{MB_PER_ENVIRONMENT} MB)"
    )
    if fit >= FLEET_WARN_BELOW:
        return Finding("fleet", Status.OK, detail)
    return Finding(
        "fleet",
        Status.WARN,
        detail,
        "run fewer environments per node, or ask the admins to raise that limit "
        "(limits.conf for ulimits, sysctl for namespaces)",
    )


def gpu_finding() -> Finding:
    """Whether containers on this node can be given GPUs (a task's `gpus`)."""
    driver = gpus.node_driver()
    variable, devices = gpus.given_devices()
    given = f"; this process was given {variable}={','.join(devices)}" if devices else ""
    if driver is not None:
        kind = "NVIDIA" if driver == "--nv" else "AMD ROCm"
        return Finding(
            "GPUs", Status.OK, f"{kind} driver, given to containers with {driver}{given}"
        )
    return Finding(
        "GPUs",
        Status.WARN,
        f"no NVIDIA or AMD GPU driver on this node{given}: containers here get no GPU",
        "tasks that ask for GPUs run on the nodes Slurm gives them (harbor-hpc submit asks "
        "for them); run doctor there to check",
    )


def run_findings(binary: str, cache_dir: Path) -> list[Finding]:
    """The proof: run a tiny image, as this user, as the task container and in each mode
    `run_flags` may pick."""
    try:
        with probe_image(binary, cache_dir) as image:
            return [task_container_finding(image), exec_finding(image)]
    except HarborHpcError as exc:
        return [Finding("run an image", Status.WARN, f"not tried: {exc.message}", exc.hint or "")]


def exec_finding(image: Path) -> Finding:
    """Each flag set `run_flags` tries without root (for `fakeroot=false`), in its order."""
    flags, failures = first_that_runs(image, CANDIDATE_FLAGS)
    tried = {" ".join(tried) or "plain": why for tried, why in failures}
    if flags is None:
        said = "; ".join(f"{mode}: {why}" for mode, why in tried.items())
        return Finding(
            "run an image",
            Status.MISSING,
            said,
            site_policy_fix(said)
            or "see the rows above (user namespaces, /dev/fuse); `apptainer exec` of any image "
            "must work for this user",
        )
    failed = "".join(f" ({mode} failed: {why})" for mode, why in tried.items())
    how = f"with {' '.join(flags)}" if flags else "plain"
    return Finding("run an image", Status.OK, f"runs {how}{failed}")


def task_container_finding(image: Path) -> Finding:
    """The task container as the environment starts it: root inside, writing its image through
    an overlay on the scratch space ($TMPDIR), in a network namespace of its own where the
    user may make one (else on the node's, as the environment starts it there), with the
    server's mounts (the image view among them)."""
    attempt = _try_task_container(image)
    if refuses_overlay_folders(attempt.why()):  # the environment then writes in memory: so here
        in_memory = _try_task_container(image)
        if in_memory.ok:
            return Finding(
                "task container",
                Status.WARN,
                "root inside, but writing in memory (--writable-tmpfs): this node's "
                "apptainer.conf allows no overlay folder, so a task may write no more than "
                "`sessiondir max size`",
                "ask the cluster admins for `allow container dir = yes` (overlay folders on disk)",
            )
        attempt = in_memory
    if attempt.ok:
        network = "no-network namespace" if netns_problem() is None else "the node's network"
        return Finding(
            "task container",
            Status.OK,
            f"root inside, writable overlay on {Path(tempfile.gettempdir())}, {network}",
        )
    why = attempt.why()
    own = root_path(Path(tempfile.gettempdir()), subids=not missing_subid_ranges())
    if OVERLAY_OFF in why and own.own:
        return Finding(
            "task container",
            Status.WARN,
            "this node's apptainer.conf turns Apptainer's overlays off (enable overlay = no): "
            f"task containers take {own.describe()} (the container root line), never Apptainer's",
            "tasks with fakeroot=false need `enable overlay = yes` in apptainer.conf",
        )
    return Finding(
        "task container",
        Status.MISSING,
        f"--fakeroot with an overlay fails ({why}): tasks cannot run as in Docker",
        OVERLAY_OFF_FIX if OVERLAY_OFF in why else site_policy_fix(why) or FAKEROOT_HINT,
    )


def _try_task_container(image: Path) -> Ran:
    """The task container's command, as the environment builds it, run once."""
    netns = netns_problem() is None
    private = PrivateDir("harbor-hpc-doctor-")
    scratch = private.path
    try:
        (scratch / "overlay").mkdir()
        (scratch / "staging" / ".hh" / "image").mkdir(parents=True)
        command = task_container_command(
            image,
            FAKEROOT,
            [
                "/bin/sh",
                "-c",
                f': > /harbor-hpc-probe && [ "$HOME" ] && [ -x {IMAGE_VIEW}/bin/sh ]',
            ],
            overlay=scratch / "overlay",
            own_network=netns,
            options=server_mounts(scratch / "staging", image),
        )
        return run(command, timeout=PROBE_TIMEOUT_S)
    finally:
        private.remove()


@contextmanager
def probe_image(
    binary: str | None, cache_dir: Path, compression: Compression | None = None
) -> Iterator[Path]:
    """A tiny SIF (PROBE_PROGRAMS and their libraries), built once into the cache, else a temp
    folder, by Apptainer's `binary` (None: without Apptainer); compressed as the store's images
    are, so that the probes run what tasks will run.
    Its name says what it holds: an image of an older harbor-hpc (a shell only) is not used."""
    compression = compression or sif_compression()
    squashed = f"-{SQUASHFS_COMPRESSION}" if compression.name == SQUASHFS_COMPRESSION else ""
    holds = hashlib.sha256(" ".join(PROBE_PROGRAMS).encode()).hexdigest()[:8]
    cached = cache_dir / ".doctor" / f"probe-{platform.machine()}-{holds}{squashed}.sif"
    if not cached.is_file():
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            with file_lock(cached.with_suffix(".lock"), timeout=BUILD_TIMEOUT_S):
                if not cached.is_file():
                    _build_probe_image(binary, cached, compression)
        except OSError as exc:
            log.info("cannot keep the test image in %s (%s): using a temporary one", cached, exc)
    if cached.is_file():
        yield cached
        return
    with tempfile.TemporaryDirectory(prefix="harbor-hpc-doctor-") as scratch:
        image = Path(scratch) / cached.name
        _build_probe_image(binary, image, compression)
        yield image


def _build_probe_image(binary: str | None, target: Path, compression: Compression) -> None:
    """The probe image at `target`, built by Apptainer (`binary`), or where the node has none
    (enroot's) squashed here and written as Apptainer writes a SIF."""
    with tempfile.TemporaryDirectory(prefix=".rootfs-", dir=target.parent) as scratch:
        rootfs = Path(scratch) / "rootfs"
        _make_rootfs(rootfs)
        partial = Path(scratch) / "probe.sif"
        if binary is None:
            squashfs = Path(scratch) / "root.sqfs"
            command = squash_command(rootfs, squashfs, (*compression.squashfs_args, "-all-root"))
            built = run(command, timeout=BUILD_TIMEOUT_S)
            if built.ok:
                write_sif(squashfs, {}, node_architecture(), partial)
        else:
            built = run(
                build_command(
                    "--force", str(partial), str(rootfs), binary=binary, compression=compression
                ),
                timeout=BUILD_TIMEOUT_S,
            )
        if not built.ok:
            raise HarborHpcError(
                f"could not build a tiny test image: {built.why()}",
                hint="mksquashfs (squashfs-tools) must be on PATH for `apptainer build`",
            )
        os.replace(partial, target)


# What the probe image holds: a shell, and what Apptainer's own scripts in the container run
# (`/.singularity.d/libs/fakeroot`, the fakeroot command Apptainer runs for users without
# subuid ranges, parses its options with `getopt` and runs `cat`, `sed`, `cut`, `ls`, `sleep`),
# as any image a task runs in has them.
PROBE_PROGRAMS = ("sh", "cat", "getopt", "sed", "cut", "ls", "sleep")


def _make_rootfs(rootfs: Path) -> None:
    """A root file system holding PROBE_PROGRAMS in /bin: a static busybox's applets if there
    is one, else the host's programs with the libraries `ldd` names (under 2 MB)."""
    (rootfs / "bin").mkdir(parents=True)
    (rootfs / "etc").mkdir()
    for name in ("passwd", "group"):  # apptainer appends the user to these
        (rootfs / "etc" / name).write_text("")
    busybox = shutil.which("busybox")
    if busybox:
        linked = run(["ldd", busybox])
        if "not a dynamic" in linked.stdout + linked.stderr:
            shutil.copy(busybox, rootfs / "bin" / "busybox")
            for program in PROBE_PROGRAMS:
                (rootfs / "bin" / program).symlink_to("busybox")
            return
    for program in PROBE_PROGRAMS:
        _copy_program(program, rootfs)


def _copy_program(name: str, rootfs: Path) -> None:
    found = shutil.which(name) or f"/bin/{name}"
    libraries = run(["ldd", found])
    if not libraries.ok:
        raise HarborHpcError(
            f"no image to run: cannot list the libraries of {found} ({libraries.why()})",
            hint="install busybox-static, or put ldd on PATH",
        )
    shutil.copy(found, rootfs / "bin" / name)
    for line in libraries.stdout.splitlines():
        path = next((word for word in line.split() if word.startswith("/")), None)
        if path:
            destination = rootfs / path.lstrip("/")
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, destination)  # follows symlinks: the image holds real files


# Filesystems on which a fakeroot build's files (owned by the user's subordinate ids) often
# cannot be written.
_NETWORK_FILESYSTEMS = ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "fuse.sshfs")
_BUILD_ADMIN_HINT = (
    "an admin enables unprivileged user namespaces (user.max_user_namespaces > 0) and adds "
    "/etc/subuid + /etc/subgid ranges for you; else build on a machine with Docker "
    "(--builder docker)"
)


def build_findings(cache_dir: Path, scratch: Path | None = None) -> list[Finding]:
    """Whether `build --builder apptainer` works here, for this user."""
    # Imported here: the builder brings the image layer, which the environment (that imports
    # this module) does not need.
    from harbor_hpc.containers.builder import scratch_dir

    install = install_findings()
    if any(finding.status is Status.MISSING for finding in install):
        return install
    folder = scratch_dir(scratch)
    return [
        fakeroot_build_finding(find_apptainer(), cache_dir, folder),
        subid_finding(),
        Finding(
            "overlay",
            Status.OK,
            "not needed: a build writes its image as a folder on the scratch space",
        ),
        scratch_finding(folder),
    ]


def fakeroot_build_finding(binary: str, cache_dir: Path, scratch: Path) -> Finding:
    """A real `apptainer build --fakeroot` of a tiny definition on the probe image, counting the
    ids its %post can be (one: root mapped to you alone; more: your subuid range)."""
    script = 'n=0; while read -r a b c; do n=$((n+1)); done </proc/self/uid_map; echo "maps: $n"'
    try:
        with probe_image(binary, cache_dir) as image:
            scratch.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(prefix="harbor-hpc-doctor-", dir=scratch) as work:
                recipe = Path(work) / "probe.def"
                recipe.write_text(f"Bootstrap: localimage\nFrom: {image}\n\n%post\n{script}\n")
                env = {**os.environ, "APPTAINER_TMPDIR": work, "SINGULARITY_TMPDIR": work}
                built = run(
                    [binary, "build", "--fakeroot", f"{work}/probe.sif", str(recipe)],
                    timeout=BUILD_TIMEOUT_S,
                    env=env,
                )
    except (HarborHpcError, OSError) as exc:
        why = exc.message if isinstance(exc, HarborHpcError) else str(exc)
        return Finding("fakeroot build", Status.WARN, f"not tried: {why}", _BUILD_ADMIN_HINT)
    if not built.ok:
        return Finding("fakeroot build", Status.MISSING, built.why(), _BUILD_ADMIN_HINT)
    maps = next(
        (int(line.split()[-1]) for line in built.stdout.splitlines() if line.startswith("maps: ")),
        0,
    )
    if maps <= 1:
        return Finding(
            "fakeroot build",
            Status.WARN,
            "works, as root mapped to you alone: RUN steps that use other users (apt-get, "
            "useradd, USER, chown) fail",
            f"an admin adds `{current_user()}:100000:65536` (a free range) to /etc/subuid and "
            "/etc/subgid",
        )
    return Finding(
        "fakeroot build", Status.OK, "works: root in a user namespace with your subuid range"
    )


def _nearest_existing(path: Path) -> Path:
    """`path`, or the nearest folder above it that exists (where it would be made)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def scratch_finding(folder: Path) -> Finding:
    """The space builds unpack whole images into: local, writable, and roomy."""
    fix = "pass --scratch-dir DIR (or set APPTAINER_TMPDIR) to a local disk with room"
    existing = _nearest_existing(folder)
    if not os.access(existing, os.W_OK | os.X_OK):
        return Finding("scratch space", Status.MISSING, f"{folder} is not writable", fix)
    free = shutil.disk_usage(existing).free
    detail = f"{folder} ({free / 2**30:.1f} GiB free"
    kind = filesystem_type(existing)
    if kind in _NETWORK_FILESYSTEMS:
        return Finding(
            "scratch space",
            Status.WARN,
            f"{detail}, on {kind}): fakeroot builds often fail on network filesystems",
            fix,
        )
    if free < LOW_FREE_BYTES:
        return Finding("scratch space", Status.WARN, f"{detail}): images unpack to GiBs", fix)
    return Finding("scratch space", Status.OK, f"{detail}, {kind or 'local'})")


def trial_scratch_finding() -> Finding:
    """Where task containers write (their writable layers, /tmp): harbor-hpc.toml's
    scratch_dir, else $TMPDIR or /tmp; on a disk, not in memory."""
    configured = load_config().values.get("scratch_dir")
    folder = Path(configured) if configured else Path(tempfile.gettempdir())
    existing = _nearest_existing(folder)
    free = shutil.disk_usage(existing).free / 2**30
    kind = filesystem_type(existing)
    if kind == "tmpfs":
        return Finding(
            "trial scratch",
            Status.WARN,
            f"{folder} is a tmpfs ({free:.1f} GiB free): what tasks write is held in memory, "
            "which their memory_mb does not count, and a full one fails them",
            "set scratch_dir in harbor-hpc.toml (or TMPDIR) to a folder on a local disk",
        )
    return Finding("trial scratch", Status.OK, f"{folder} ({kind or 'local'}, {free:.1f} GiB free)")


def compression_findings() -> list[Finding]:
    """How .sif images are compressed here and why (`runtime.sif_compression`), a warning
    where zstd could be had by asking the nodes; none where there is no Apptainer to ask."""
    try:
        return [_compression_finding()]
    except InputError as exc:  # a sif_compression harbor-hpc.toml should not have
        return [Finding("compression", Status.WARN, exc.message, exc.hint or "")]
    except HarborHpcError:  # no Apptainer: its part says so
        return []


def _compression_finding() -> Finding:
    compression = sif_compression()
    detail = f"{compression.name}: {compression.why}"
    if compression.askable:
        return Finding(
            "compression",
            Status.WARN,
            detail,
            "`harbor-hpc doctor --nodes` asks them (a small job each); from zstd images "
            "containers start about 100 ms sooner",
        )
    return Finding("compression", Status.OK, detail)


def store_finding(cache_dir: Path) -> Finding:
    """Whether the .sif store can be (or is) a writable folder with room for images."""
    fix = "pass --cache-dir DIR, set cache_dir in harbor-hpc.toml, or export HARBOR_HPC_CACHE"
    existing = _nearest_existing(cache_dir)
    if not existing.is_dir():
        return Finding("folder", Status.WARN, f"{existing} is not a folder", fix)
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == cache_dir else f"cannot be created in {existing}"
        return Finding("folder", Status.WARN, f"{cache_dir} {what}", fix)
    free = shutil.disk_usage(existing).free
    state = "exists" if existing == cache_dir else "will be created"
    detail = f"{cache_dir} ({state}, {free / 2**30:.1f} GiB free)"
    if free < LOW_FREE_BYTES:
        return Finding(
            "folder",
            Status.WARN,
            f"{detail}: images take 0.1 to several GiB each",
            f"free space, or {fix}",
        )
    return Finding("folder", Status.OK, detail)


def _read_int(path: str) -> int | None:
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None
