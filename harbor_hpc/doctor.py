"""What this machine has for each role, probed for real: the checks behind `harbor-hpc doctor`.

Two roles need different parts. The cluster role (login and compute nodes) needs Apptainer that
can actually run an image for this user, and a reachable Slurm; the build role needs a Docker
Engine. Every probe is bounded in time and turns any failure into a `Check` that says what is
wrong and how to fix it, so the doctor still answers on a machine where every tool is missing.

`part_problem` is the short form the test suite uses (root `conftest.py`): None when a part
works here, else why not.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import platform
import pwd
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from harbor_hpc.apptainer.network import ADMIN_HINT, own_network_problem
from harbor_hpc.apptainer.runtime import (
    CANDIDATE_FLAGS,
    FAKEROOT,
    FAKEROOT_HINT,
    container_flags,
    find_apptainer,
    remove_private_dir,
)
from harbor_hpc.core.config import Config, cache_dir
from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.core.files import file_lock
from harbor_hpc.core.proc import Ran, run

log = logging.getLogger(__name__)

Part = Literal["apptainer", "slurm", "docker", "cache", "harbor", "python"]


class Role(StrEnum):
    CLUSTER = "cluster"
    BUILD = "build"
    ALL = "all"


class Status(StrEnum):
    OK = "ok"
    WARN = "warn"
    MISSING = "missing"


# The parts a role cannot work without; the others are reported but never fail the doctor.
REQUIRED_PARTS: dict[Role, tuple[Part, ...]] = {
    Role.CLUSTER: ("apptainer", "slurm"),
    Role.BUILD: ("docker",),
    Role.ALL: ("apptainer", "slurm", "docker"),
}
# Which role looks at a part; "all" parts are shown for every role.
PART_ROLE: dict[Part, str] = {
    "apptainer": "cluster",
    "slurm": "cluster",
    "cache": "cluster",
    "docker": "build",
    "harbor": "all",
    "python": "all",
}
PART_TITLES: dict[Part, str] = {
    "apptainer": "Apptainer",
    "slurm": "Slurm",
    "docker": "Docker",
    "cache": "SIF cache",
    "harbor": "Harbor",
    "python": "Python",
}

# Short enough that a hung tool cannot stall the doctor, long enough for a busy login node.
QUICK_TIMEOUT = 5.0
EXEC_TIMEOUT = 30.0
BUILD_TIMEOUT = 120.0
LOW_FREE_BYTES = 10 * 2**30
MIN_HARBOR = (0, 24)
SIDE_DEPS = (
    "typer",
    "rich",
    "spython",
    "docker",
    "tomlkit",
    "huggingface-hub",
    "submitit",
    "psutil",
)


@dataclass(frozen=True)
class Check:
    part: Part
    name: str
    status: Status
    detail: str
    fix: str = ""

    @property
    def role(self) -> str:
        return PART_ROLE[self.part]

    def as_dict(self) -> dict[str, str]:
        return {
            "role": self.role,
            "part": self.part,
            "check": self.name,
            "status": str(self.status),
            "detail": self.detail,
            "fix": self.fix,
        }


@dataclass(frozen=True)
class Report:
    role: Role
    checks: list[Check]

    @property
    def missing_parts(self) -> list[Part]:
        """Parts the role needs that have a check in the `missing` state."""
        broken = {check.part for check in self.checks if check.status is Status.MISSING}
        return [part for part in REQUIRED_PARTS[self.role] if part in broken]

    @property
    def ok(self) -> bool:
        return not self.missing_parts


def resolve_cache_dir(flag: Path | None) -> Path:
    """The store the user chose, as every command resolves it; a broken config file does not
    stop the doctor: it is ignored here, and the CLI reports it."""
    try:
        return cache_dir(flag)
    except HarborHpcError:
        return cache_dir(flag, Config())


def run_doctor(role: Role = Role.CLUSTER, cache_dir: Path | None = None) -> Report:
    """Every check the role looks at, the parts probed in parallel (each waits on tools)."""
    wanted = [
        part for part, part_role in PART_ROLE.items() if role == "all" or part_role in (role, "all")
    ]
    cache = resolve_cache_dir(cache_dir)
    with ThreadPoolExecutor(max_workers=len(wanted)) as pool:
        results = list(pool.map(lambda part: probe_part(part, cache), wanted))
    return Report(role, [check for checks in results for check in checks])


def part_problem(part: str) -> str | None:
    """None when `part` ("docker", "slurm" or "apptainer") works here, else a short reason."""
    testable: dict[str, Part] = {name: name for name in REQUIRED_PARTS[Role.ALL]}
    if part not in testable:
        raise ValueError(f"unknown part {part!r}, expected one of {', '.join(testable)}")
    checks = probe_part(testable[part], resolve_cache_dir(None))
    for check in checks:
        if check.status is Status.MISSING:
            return f"{check.name}: {check.detail}"
    return None


def probe_part(part: Part, cache_dir: Path) -> list[Check]:
    """The checks of one part; a probe that breaks becomes a check, never an exception."""
    probes: dict[Part, Callable[[], list[Check]]] = {
        "apptainer": lambda: probe_apptainer(cache_dir),
        "slurm": probe_slurm,
        "docker": probe_docker,
        "cache": lambda: probe_cache(cache_dir),
        "harbor": probe_harbor,
        "python": probe_python,
    }
    try:
        return probes[part]()
    except Exception as exc:  # the doctor reports; it must not crash on what it diagnoses
        log.debug("probe %s failed", part, exc_info=True)
        status = Status.MISSING if part in REQUIRED_PARTS[Role.ALL] else Status.WARN
        return [
            Check(part, "probe", status, f"the check itself failed: {type(exc).__name__}: {exc}")
        ]


def current_user() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


# --- Apptainer -----------------------------------------------------------------------------


def probe_apptainer(cache_dir: Path) -> list[Check]:
    try:
        binary = find_apptainer()
    except HarborHpcError as exc:
        fix = (
            "`module load apptainer` (or singularity) on a cluster, else install Apptainer; "
            "HARBOR_HPC_APPTAINER=/path/to/apptainer names a binary off PATH"
        )
        return [Check("apptainer", "binary", Status.MISSING, exc.message, fix)]
    checks = [Check("apptainer", "binary", Status.OK, binary)]
    version = run([binary, "--version"])
    if not version.ok:
        fix = "the install looks broken: reinstall it, or load another module"
        checks.append(Check("apptainer", "version", Status.MISSING, version.why(), fix))
        return checks
    checks.append(Check("apptainer", "version", Status.OK, version.stdout.strip()))
    build_config = apptainer_build_config(binary)
    setuid = setuid_check(build_config)
    userns = userns_check()
    checks += [
        userns,
        setuid,
        subid_check(),
        fuse_check(),
        squashfuse_check(build_config),
        network_check(),
    ]
    setuid_install = _is_setuid_root(_suid_starter_path(build_config))
    if userns.status is not Status.OK and not setuid_install:
        checks.append(
            Check(
                "apptainer",
                "privileges",
                Status.MISSING,
                "neither unprivileged user namespaces nor a setuid install",
                "an admin enables user namespaces (sysctl user.max_user_namespaces=15000) "
                "or installs apptainer-suid",
            )
        )
    checks += exec_checks(binary, cache_dir)
    return checks


def apptainer_build_config(binary: str) -> dict[str, str]:
    """`apptainer buildcfg` as a dict (install prefix, libexec dir, whether setuid)."""
    answer = run([binary, "buildcfg"])
    if not answer.ok:
        return {}
    pairs = (line.split("=", 1) for line in answer.stdout.splitlines() if "=" in line)
    return {key.strip(): value.strip() for key, value in pairs}


def userns_check() -> Check:
    """Whether this user may create a user namespace: the sysctls, then a real `unshare`."""
    limit = _read_int("/proc/sys/user/max_user_namespaces")
    if limit == 0:
        return Check(
            "apptainer",
            "user namespaces",
            Status.WARN,
            "disabled (user.max_user_namespaces = 0)",
            "an admin runs `sysctl -w user.max_user_namespaces=15000`",
        )
    if _read_int("/proc/sys/kernel/unprivileged_userns_clone") == 0:
        return Check(
            "apptainer",
            "user namespaces",
            Status.WARN,
            "disabled for unprivileged users (kernel.unprivileged_userns_clone = 0)",
            "an admin runs `sysctl -w kernel.unprivileged_userns_clone=1`",
        )
    attempt = run([sys.executable, "-c", "import os; os.unshare(os.CLONE_NEWUSER)"])
    if not attempt.ok:
        fix = "an admin allows unprivileged user namespaces (sysctl, AppArmor or seccomp policy)"
        return Check("apptainer", "user namespaces", Status.WARN, attempt.why(), fix)
    return Check("apptainer", "user namespaces", Status.OK, f"available (limit {limit})")


def setuid_check(build_config: dict[str, str]) -> Check:
    starter = _suid_starter_path(build_config)
    if _is_setuid_root(starter):
        return Check("apptainer", "setuid", Status.OK, f"setuid install ({starter})")
    if not starter.exists():
        return Check("apptainer", "setuid", Status.OK, "not a setuid install (uses namespaces)")
    return Check(
        "apptainer",
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


def subid_check() -> Check:
    """`--fakeroot` maps the user onto a range from /etc/subuid and /etc/subgid."""
    user, uid = current_user(), str(os.getuid())
    absent = [
        path for path in ("/etc/subuid", "/etc/subgid") if not _has_subid_range(path, user, uid)
    ]
    if absent:
        return Check(
            "apptainer",
            "fakeroot ids",
            Status.WARN,
            f"no line for {user} in {' and '.join(absent)}: --fakeroot is limited",
            f"an admin adds `{user}:100000:65536` (a free range) to /etc/subuid and /etc/subgid",
        )
    if os.getuid() != 0 and not shutil.which("newuidmap"):
        return Check(
            "apptainer",
            "fakeroot ids",
            Status.WARN,
            "newuidmap is not on PATH",
            "an admin installs the uidmap package",
        )
    return Check("apptainer", "fakeroot ids", Status.OK, f"{user} has subuid and subgid ranges")


def _has_subid_range(path: str, user: str, uid: str) -> bool:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return False
    return any(line.split(":", 1)[0] in (user, uid) for line in lines if line.count(":") == 2)


def fuse_check() -> Check:
    """Unprivileged Apptainer mounts a SIF with squashfuse, which needs /dev/fuse."""
    if not os.path.exists("/dev/fuse"):
        return Check(
            "apptainer",
            "/dev/fuse",
            Status.WARN,
            "absent: images are unpacked to a temporary folder at every start (slow)",
            "an admin loads the fuse module (`modprobe fuse`)",
        )
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return Check(
            "apptainer",
            "/dev/fuse",
            Status.WARN,
            f"not readable and writable by {current_user()}: images are unpacked at every start",
            "an admin runs `chmod 666 /dev/fuse`",
        )
    return Check("apptainer", "/dev/fuse", Status.OK, "readable and writable")


def network_check() -> Check:
    """A network namespace of its own for every container that may use the network."""
    problem = own_network_problem()
    if problem is None:
        return Check("apptainer", "own network", Status.OK, "slirp4netns, /dev/net/tun usable")
    return Check(
        "apptainer",
        "own network",
        Status.WARN,
        f"{problem}: containers with network share the node's (ports collide, none below 1024)",
        ADMIN_HINT,
    )


def squashfuse_check(build_config: dict[str, str]) -> Check:
    bundled = Path(build_config.get("LIBEXECDIR", "/usr/libexec")) / "apptainer/bin"
    for name in ("squashfuse_ll", "squashfuse"):
        found = shutil.which(name) or shutil.which(name, path=str(bundled))
        if found:
            return Check("apptainer", "squashfuse", Status.OK, found)
    return Check(
        "apptainer",
        "squashfuse",
        Status.WARN,
        "neither squashfuse_ll nor squashfuse found: images are unpacked at every start",
        "install squashfuse (`apt-get install squashfuse`, or `module load squashfuse`)",
    )


def exec_checks(binary: str, cache_dir: Path) -> list[Check]:
    """The proof: run a tiny image, as this user, in each mode the runtime may use."""
    try:
        with probe_image(binary, cache_dir) as image:
            return _exec_in_modes(binary, image)
    except HarborHpcError as exc:
        return [
            Check(
                "apptainer",
                "run an image",
                Status.WARN,
                f"not tried: {exc.message}",
                exc.hint or "",
            )
        ]


def _exec_in_modes(binary: str, image: Path) -> list[Check]:
    """The task container exactly as the environment starts it (root, overlay, no network);
    then each flag set `run_flags` tries without root, for `fakeroot=false`."""
    failures: dict[str, str] = {}
    run_check = None
    for flags in CANDIDATE_FLAGS:
        label = " ".join(flags) or "plain"
        attempt = _exec(binary, image, flags)
        if attempt.ok:
            failed = "".join(f" ({mode} failed: {why})" for mode, why in failures.items())
            how = f"with {label}" if flags else "plain"
            run_check = Check("apptainer", "run an image", Status.OK, f"runs {how}{failed}")
            break
        failures[label] = attempt.why()
    if run_check is None:
        run_check = Check(
            "apptainer",
            "run an image",
            Status.MISSING,
            "; ".join(f"{mode}: {why}" for mode, why in failures.items()),
            "see the rows above (user namespaces, /dev/fuse); `apptainer exec` of any image "
            "must work for this user",
        )
    return [_task_container_check(binary, image), run_check]


def _task_container_check(binary: str, image: Path) -> Check:
    """Root in the container, writing its image through an overlay on the scratch space
    ($TMPDIR), in a network namespace of its own: what every task gets."""
    scratch = Path(tempfile.mkdtemp(prefix="harbor-hpc-doctor-"))
    try:
        (scratch / "overlay").mkdir()
        flags = container_flags(overlay=scratch / "overlay", own_network=True)
        attempt = _exec(binary, image, (*FAKEROOT, *flags), ': > /harbor-hpc-probe && [ "$HOME" ]')
    finally:
        remove_private_dir(scratch)
    if attempt.ok:
        return Check(
            "apptainer",
            "task container",
            Status.OK,
            f"root inside, writable overlay on {scratch.parent}, no-network namespace",
        )
    return Check(
        "apptainer",
        "task container",
        Status.MISSING,
        f"--fakeroot with an overlay fails ({attempt.why()}): tasks cannot run as in Docker",
        FAKEROOT_HINT,
    )


def _exec(binary: str, image: Path, flags: tuple[str, ...], script: str = "true") -> Ran:
    return run([binary, "exec", *flags, str(image), "/bin/sh", "-c", script], timeout=EXEC_TIMEOUT)


@contextmanager
def probe_image(binary: str, cache_dir: Path) -> Iterator[Path]:
    """A tiny SIF (a shell and its libraries), built once into the cache, else a temp folder."""
    cached = cache_dir / ".doctor" / f"probe-{platform.machine()}.sif"
    if not cached.is_file():
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            with file_lock(cached.with_suffix(".lock"), timeout=BUILD_TIMEOUT):
                if not cached.is_file():
                    _build_probe_image(binary, cached)
        except OSError as exc:
            log.info("cannot keep the test image in %s (%s): using a temporary one", cached, exc)
    if cached.is_file():
        yield cached
        return
    with tempfile.TemporaryDirectory(prefix="harbor-hpc-doctor-") as scratch:
        image = Path(scratch) / cached.name
        _build_probe_image(binary, image)
        yield image


def _build_probe_image(binary: str, target: Path) -> None:
    with tempfile.TemporaryDirectory(prefix=".rootfs-", dir=target.parent) as scratch:
        rootfs = Path(scratch) / "rootfs"
        _make_rootfs(rootfs)
        partial = Path(scratch) / "probe.sif"
        built = run([binary, "build", "--force", str(partial), str(rootfs)], timeout=BUILD_TIMEOUT)
        if not built.ok:
            raise HarborHpcError(
                f"could not build a tiny test image: {built.why()}",
                hint="mksquashfs (squashfs-tools) must be on PATH for `apptainer build`",
            )
        os.replace(partial, target)


def _make_rootfs(rootfs: Path) -> None:
    """A root file system holding /bin/sh: a static busybox if there is one, else the host's
    shell with the libraries `ldd` names (which keeps the image under 2 MB)."""
    (rootfs / "bin").mkdir(parents=True)
    (rootfs / "etc").mkdir()
    for name in ("passwd", "group"):  # apptainer appends the user to these
        (rootfs / "etc" / name).write_text("")
    busybox = shutil.which("busybox")
    if busybox:
        linked = run(["ldd", busybox])
        if "not a dynamic" in linked.stdout + linked.stderr:
            shutil.copy(busybox, rootfs / "bin" / "sh")
            return
    shell = shutil.which("sh") or "/bin/sh"
    libraries = run(["ldd", shell])
    if not libraries.ok:
        raise HarborHpcError(
            f"no image to run: cannot list the libraries of {shell} ({libraries.why()})",
            hint="install busybox-static, or put ldd on PATH",
        )
    shutil.copy(shell, rootfs / "bin" / "sh")
    for line in libraries.stdout.splitlines():
        path = next((word for word in line.split() if word.startswith("/")), None)
        if path:
            destination = rootfs / path.lstrip("/")
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, destination)  # follows symlinks: the image holds real files


# --- Slurm ---------------------------------------------------------------------------------


def probe_slurm() -> list[Check]:
    checks = []
    for tool in ("sbatch", "squeue", "scontrol", "sinfo"):
        if not shutil.which(tool):
            return [
                Check(
                    "slurm",
                    "commands",
                    Status.MISSING,
                    f"{tool} is not on PATH",
                    "on a cluster: `module load slurm`; else install slurm-client "
                    "(`apt-get install slurm-client`)",
                )
            ]
    version = run(["sbatch", "--version"])
    checks.append(Check("slurm", "commands", Status.OK, version.stdout.strip() or "sbatch found"))
    ping = run(["scontrol", "ping"], timeout=10)
    # One line per controller ("Slurmctld(primary) at HOST is UP"); a backup may be down.
    controllers = [line.strip() for line in ping.stdout.splitlines() if "Slurmctld" in line]
    if not any(line.endswith(" is UP") for line in controllers):
        return [*checks, _controller_down(ping, controllers)]
    checks.append(Check("slurm", "controller", Status.OK, "; ".join(controllers)))
    checks.append(partitions_check())
    return checks


def _controller_down(ping: Ran, controllers: list[str]) -> Check:
    reason = "; ".join(controllers) if controllers else ping.why()
    said = (ping.stdout + ping.stderr).lower()
    if "munge" in said or "authentication" in said:
        fix = "start munged (`systemctl start munge`, or `sudo -u munge munged`) on every node"
    else:
        fix = (
            "start the controller (`systemctl start slurmctld`, or `slurmctld`) and munged; "
            "check SLURM_CONF points at the cluster's slurm.conf"
        )
    return Check("slurm", "controller", Status.MISSING, f"not reachable: {reason}", fix)


def partitions_check() -> Check:
    listing = run(["sinfo", "--noheader", "--format=%P %a %D %T"], timeout=10)
    if not listing.ok:
        fix = "check `sinfo` by hand; the controller answers but lists nothing"
        return Check("slurm", "partitions", Status.MISSING, listing.why(), fix)
    return judge_partitions(listing.stdout)


def judge_partitions(sinfo_output: str) -> Check:
    """Whether some partition can run jobs, from `sinfo --noheader --format="%P %a %D %T"`."""
    states: dict[str, set[str]] = {}
    for line in sinfo_output.splitlines():
        fields = line.split()
        if len(fields) == 4:
            name, availability, _nodes, state = fields
            states.setdefault(name, set()).add(state if availability == "up" else "down")
    if not states:
        fix = "an admin adds a PartitionName= line to slurm.conf"
        return Check("slurm", "partitions", Status.MISSING, "no partition defined", fix)
    usable = sorted(
        name
        for name, node_states in states.items()
        if any(state.rstrip(_WAKING_SUFFIXES) in _USABLE_STATES for state in node_states)
    )
    summary = ", ".join(f"{name} ({'/'.join(sorted(s))})" for name, s in sorted(states.items()))
    if not usable:
        return Check(
            "slurm",
            "partitions",
            Status.MISSING,
            f"no partition has a node that can run jobs: {summary}",
            "an admin starts slurmd on the nodes (`systemctl start slurmd`), then "
            "`scontrol update nodename=NODE state=resume`",
        )
    return Check("slurm", "partitions", Status.OK, summary)


# sinfo's state names (%T) of nodes that take or run jobs. A suffix marks a node that is
# powered down (~) or powering up (#) or due for maintenance ($ @ ^ -): Slurm wakes or keeps
# using those, so they count; "*" (not responding) does not.
_USABLE_STATES = {"idle", "mixed", "allocated", "completing", "planned"}
_WAKING_SUFFIXES = "~#$@^-"


# --- Docker --------------------------------------------------------------------------------


def probe_docker() -> list[Check]:
    import docker  # imported here: it takes a few tenths of a second and only this probe needs it

    where = os.environ.get("DOCKER_HOST") or "the default socket (/var/run/docker.sock)"
    try:
        client = docker.from_env(timeout=int(QUICK_TIMEOUT))
        try:
            client.ping()
            version = client.version()
        finally:
            client.close()
    except Exception as exc:  # docker raises DockerException, requests errors, or OSError
        return [
            Check(
                "docker",
                "engine",
                Status.MISSING,
                f"{where}: {_docker_reason(exc)}",
                _docker_fix(exc),
            )
        ]
    detail = (
        f"Docker {version.get('Version', '?')} (API {version.get('ApiVersion', '?')}) at {where}"
    )
    return [Check("docker", "engine", Status.OK, detail)]


def _docker_reason(exc: Exception) -> str:
    text = str(exc)
    if "Permission denied" in text:
        return "permission denied on the socket"
    if "No such file" in text or "FileNotFoundError" in text:
        return "no socket there"
    if "Connection refused" in text:
        return "connection refused (is dockerd running?)"
    return text[-200:]


def _docker_fix(exc: Exception) -> str:
    if "Permission denied" in str(exc):
        return f"an admin adds {current_user()} to the docker group (then log in again)"
    return (
        "start the engine (`systemctl start docker`, or `dockerd &`), or point at one: "
        "`export DOCKER_HOST=unix:///run/user/$UID/docker.sock` (rootless) or tcp://HOST:2375"
    )


# --- The .sif cache, Harbor, Python ----------------------------------------------------------


def probe_cache(cache_dir: Path) -> list[Check]:
    fix = "pass --cache-dir DIR, set cache_dir in harbor-hpc.toml, or export HARBOR_HPC_CACHE"
    existing = cache_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return [Check("cache", "folder", Status.WARN, f"{existing} is not a folder", fix)]
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == cache_dir else f"cannot be created in {existing}"
        return [Check("cache", "folder", Status.WARN, f"{cache_dir} {what}", fix)]
    free = shutil.disk_usage(existing).free
    state = "exists" if existing == cache_dir else "will be created"
    detail = f"{cache_dir} ({state}, {free / 2**30:.1f} GiB free)"
    if free < LOW_FREE_BYTES:
        return [
            Check(
                "cache",
                "folder",
                Status.WARN,
                f"{detail}: images take 0.1 to several GiB each",
                f"free space, or {fix}",
            )
        ]
    return [Check("cache", "folder", Status.OK, detail)]


def probe_harbor() -> list[Check]:
    fix = "install it into this environment: `uv sync` in the checkout, or `pip install harbor`"
    try:
        importlib.import_module("harbor")
        version = importlib.metadata.version("harbor")
    except Exception as exc:
        return [Check("harbor", "package", Status.WARN, f"not importable: {exc}", fix)]
    if _version_tuple(version) < MIN_HARBOR:
        wanted = ".".join(map(str, MIN_HARBOR))
        return [Check("harbor", "package", Status.WARN, f"{version}, needs >= {wanted}", fix)]
    return [Check("harbor", "package", Status.OK, f"harbor {version}")]


def probe_python() -> list[Check]:
    here = f"Python {sys.version.split()[0]} ({sys.executable})"
    absent = []
    for name in SIDE_DEPS:
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            absent.append(name)
    if absent:
        return [
            Check(
                "python",
                "packages",
                Status.WARN,
                f"{here}; not installed: {', '.join(absent)}",
                "`uv sync` in the checkout, or reinstall harbor-hpc",
            )
        ]
    return [Check("python", "packages", Status.OK, f"{here}; {len(SIDE_DEPS)} dependencies found")]


def _version_tuple(version: str) -> tuple[int, ...]:
    numbers = []
    for piece in version.split("."):
        digits = "".join(char for char in piece if char.isdigit())
        if not digits:
            break
        numbers.append(int(digits))
    return tuple(numbers)


def _read_int(path: str) -> int | None:
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None


def checks_as_json(checks: list[Check]) -> list[dict[str, Any]]:
    return [check.as_dict() for check in checks]
