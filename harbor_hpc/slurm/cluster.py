"""Every Slurm command harbor-hpc runs: squeue, sinfo, scontrol, scancel, and sbatch (through
submitit, or a batch script of its own for services such as a Ray cluster).

One place, so that every call is bounded in time (a hung `squeue` on a busy login node must not
hang `submit` or `status`), fails in one line that names the command and says what to try, and
has its output read by a pure `parse_*` function tested against recorded output. `sacct` is
never called: clusters often run without accounting, so a job's fate is read from `squeue` and
from the files its trials leave (`harbor_hpc.results`).

Jobs are queued through submitit, whose executor `executor` builds for every caller (trial
arrays, image conversions and builds), for Slurm and for local processes alike; `await_array`
waits for an array whose elements each return a result (conversions, builds).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from harbor_hpc.core.errors import HarborHpcError, InputError, choice
from harbor_hpc.core.proc import QUICK_TIMEOUT_S, Ran, run
from harbor_hpc.core.templates import render_template

if TYPE_CHECKING:  # submitit loads when a job is queued or awaited: `status` needs squeue only
    import submitit

log = logging.getLogger(__name__)

# squeue, sinfo and scontrol answer from the controller's memory: seconds even when it is busy.
QUERY_TIMEOUT_S = QUICK_TIMEOUT_S
# sbatch waits for the controller to accept the job and retries while it is busy.
SBATCH_TIMEOUT_S = 60.0
# How often submitit requeues an element that reached its time limit or was preempted.
MAX_REQUEUES = 3
# How long before its time limit an element is told to stop and requeue (submitit's USR2): long
# enough to write down what ran, never more than a quarter of the limit, so that a short
# `--time` still runs trials before the warning instead of requeueing at once, forever.
REQUEUE_WARNING_S = 90


# The signal submitit's elements take as the warning to requeue (its default, USR2).
JOB_SIGNAL = "USR2"


def requeue_warning_s(time_min: int) -> int:
    return max(1, min(REQUEUE_WARNING_S, time_min * 60 // 4))


# Slurm's own default when the configuration does not say.
DEFAULT_MAX_ARRAY_SIZE = 1001
COMMANDS = ("sbatch", "squeue", "scontrol", "sinfo")
CONTROLLER_HINT = "is the Slurm controller up and answering? (`scontrol ping`)"

# squeue prints not-yet-expanded array elements as `1234_[3-7%2]`.
_ARRAY_RANGE = re.compile(r"^(\d+)_\[([^\]]+)\]$")
# sinfo's state names (%T) of nodes that take or run jobs. A suffix marks a node that is
# powered down (~) or powering up (#) or due for maintenance ($ @ ^ -): Slurm wakes or keeps
# using those, so they count; "*" (not responding) does not.
_USABLE_STATES = {"idle", "mixed", "allocated", "completing", "planned"}
_WAKING_SUFFIXES = "~#$@^-"


class SlurmError(HarborHpcError):
    """A Slurm command that is missing, failed or did not answer in time."""


class SlurmUnreachable(SlurmError):
    """Slurm's controller did not answer (a command timed out, or said it could not reach it):
    the same call a little later may well be answered."""


# How long following jobs goes on while Slurm's controller does not answer: busy controllers
# stall for a minute and more, and the jobs run on meanwhile.
SILENT_S = 600.0


class Silence:
    """How long Slurm's controller has left a caller that follows jobs (`--wait`, a trainer's
    batch, a conversion) unanswered: said when it begins and when it ends; the caller goes on
    with what it knew, until SILENT_S."""

    def __init__(self) -> None:
        self.since: float | None = None

    def unanswered(self, exc: SlurmUnreachable, asked: float, meanwhile: str) -> None:
        """Note `exc`, raised by a call begun at `asked` (monotonic); `meanwhile` says what the
        caller does. Raises `exc` once the controller has been silent for SILENT_S."""
        if self.since is None:
            self.since = asked
            log.warning("%s; %s", exc.message, meanwhile)
        elif time.monotonic() - self.since > SILENT_S:
            raise exc

    def answered(self) -> None:
        if self.since is not None:
            silent = time.monotonic() - self.since
            log.warning("Slurm's controller answers again (after %.0f s)", silent)
        self.since = None


class SubmitLimitReached(SlurmError):
    """sbatch refused a job for the user's limit on queued jobs (MaxSubmitJobs and kin): the
    job fits once some of the user's jobs have left the queue."""


class Executor(StrEnum):
    """Where a run's jobs go; `auto` is Slurm when sbatch is on PATH, else local processes."""

    AUTO = "auto"
    SLURM = "slurm"
    LOCAL = "local"


def sbatch_found() -> bool:
    return shutil.which("sbatch") is not None


def choose_executor(executor: str) -> Executor:
    """The executor `--executor` names, `auto` resolved; Slurm only where sbatch is."""
    chosen = choice(Executor, executor, "--executor")
    if chosen is Executor.AUTO:
        return Executor.SLURM if sbatch_found() else Executor.LOCAL
    if chosen is Executor.SLURM:
        require_sbatch(
            "--executor slurm",
            hint="run on a Slurm login node (`module load slurm`?) or use --executor local",
        )
    return chosen


def require_sbatch(what: str, *, hint: str) -> None:
    if not sbatch_found():
        raise SlurmError(f"{what}, but sbatch is not on PATH", hint=hint)


def _query(command: list[str], *, timeout: float, hint: str, cleanup: bool = False) -> Ran:
    """Run a Slurm query to its end or `timeout` (a `cleanup` even once told to stop); a
    command not on PATH raises, a failure is returned for the caller to judge."""
    if shutil.which(command[0]) is None:
        raise SlurmError(f"{command[0]} is not on PATH", hint=hint)
    return run(command, timeout=timeout, cleanup=cleanup)


def _failed(ran: Ran, hint: str) -> SlurmError:
    kind = SlurmUnreachable if _unanswered(ran.error or ran.stderr) else SlurmError
    return kind(f"`{' '.join(ran.command)}` failed: {ran.why()}", hint=hint)


# --- squeue: which jobs still live ------------------------------------------------------------


def expand_array(job: str) -> list[str]:
    """`1234_[0-2,5%2]` as its elements (`1234_0`, `1234_1`...); any other id as itself."""
    match = _ARRAY_RANGE.match(job)
    if not match:
        return [job]
    base, spec = match.groups()
    ids: list[str] = []
    for part in spec.split("%", 1)[0].split(","):
        first, _, last = part.partition("-")
        ids.extend(f"{base}_{i}" for i in range(int(first), int(last or first) + 1))
    return ids


def queued_jobs(job_ids: Collection[str], *, timeout: float = QUERY_TIMEOUT_S) -> set[str]:
    """Which array elements (`1234_5`) or plain jobs of `job_ids` squeue still knows."""
    return set(queue_reasons(job_ids, timeout=timeout))


def queue_reasons(
    job_ids: Collection[str], *, timeout: float = QUERY_TIMEOUT_S
) -> dict[str, str | None]:
    """The array elements (`1234_5`) or plain jobs of `job_ids` that squeue still knows, each
    with Slurm's reason while it pends (Priority, Resources, PartitionConfig...), else None:
    one squeue call however many jobs."""
    if not job_ids:
        return {}
    hint = f"run this on a login node of the cluster that ran the jobs; {CONTROLLER_HINT}"
    command = ["squeue", "-h", "-r", "-o", "%i|%T|%r", "-j", ",".join(job_ids)]
    ran = _query(command, timeout=timeout, hint=hint)
    if not ran.ok:
        if not ran.error and "Invalid job id" in ran.stderr:
            return {}  # every job has left the queue (squeue only errs for a lone id)
        raise _failed(ran, hint)
    return parse_squeue_reasons(ran.stdout)


def parse_squeue_reasons(text: str) -> dict[str, str | None]:
    """`squeue -h -r -o '%i|%T|%r'` output as each job (array ranges expanded) and the reason
    it pends (None when it does not pend, or Slurm gives none)."""
    found: dict[str, str | None] = {}
    for line in text.splitlines():
        token, _, rest = line.strip().partition("|")
        state, _, reason = rest.partition("|")
        why = reason.strip() if state == "PENDING" and reason.strip() not in ("", "None") else None
        for element in expand_array(token):
            found[element] = why
    return found


# Slurm's reasons for a job that waiting will never start: it asks for more than its partition
# allows (with EnforcePartLimits off, sbatch takes such jobs), a constraint no node has, a QOS
# or account it may not use, a per-job limit it exceeds. Others (Resources, Priority, a node
# down or drained, a per-user limit) end by themselves.
_NEVER_STARTS = re.compile(
    r"^(PartitionConfig|PartitionNodeLimit|PartitionTimeLimit|BadConstraints|InvalidQOS|"
    r"InvalidAccount|QOSNotAllowed|AccountNotAllowed|(QOS|Assoc)Max\w*PerJob\w*)"
)


def never_starts(reason: str | None) -> bool:
    """Whether a pending job with Slurm's `reason` will never start however long it waits."""
    return bool(reason) and bool(_NEVER_STARTS.match(reason or ""))


# --- sinfo and scontrol: what the cluster offers ----------------------------------------------


@dataclass(frozen=True)
class NodeLimits:
    cpus: int
    mem_mb: int
    # The GPU types the partition's nodes offer, as Slurm names them (`gpu:a100:4` -> a100).
    gpu_types: frozenset[str] = frozenset()


def gres_gpu_types(gres: str) -> set[str]:
    """The GPU types of a node's GRES as sinfo shows it (`gpu:a100:4(S:0-1),gpu:h100:2`)."""
    types = set()
    for item in gres.split(","):
        parts = item.split("(", 1)[0].split(":")
        if parts[0] == "gpu" and len(parts) == 3:
            types.add(parts[1])
    return types


def parse_node_limits(text: str) -> NodeLimits | None:
    """The biggest node of `sinfo -h -o "%c %m %G"` output (a `+` marks the smallest of a
    range), with the GPU types of every node."""
    nodes, gpu_types = [], set()
    for line in text.splitlines():
        cpus, _, rest = line.strip().partition(" ")
        mem, _, gres = rest.partition(" ")
        gpu_types |= gres_gpu_types(gres)
        try:
            nodes.append(NodeLimits(int(cpus.rstrip("+")), int(mem.rstrip("+"))))
        except ValueError:
            continue
    biggest = max(nodes, key=lambda node: (node.mem_mb, node.cpus), default=None)
    if biggest is None:
        return None
    return NodeLimits(biggest.cpus, biggest.mem_mb, frozenset(gpu_types))


def partition_limits(
    partition: str | None, *, timeout: float = QUERY_TIMEOUT_S
) -> NodeLimits | None:
    """The biggest node of `partition` (the default partition when None); None when sinfo
    lists none (an unknown partition, which sbatch then refuses by name)."""
    command = ["sinfo", "-h", "-o", "%c %m %G"]
    if partition:
        command += ["-p", partition]
    hint = f"submit needs sinfo to size the jobs; {CONTROLLER_HINT}"
    ran = _query(command, timeout=timeout, hint=hint)
    if not ran.ok:
        raise _failed(ran, hint)
    return parse_node_limits(ran.stdout)


def parse_config(config_text: str) -> dict[str, str]:
    """`scontrol show config` output as KEY -> value (its cgroup.conf section included)."""
    found = {}
    for line in config_text.splitlines():
        key, equals, value = line.partition("=")
        if equals and key.strip() and " " not in key.strip():
            found[key.strip()] = value.strip()
    return found


def parse_max_array_size(config: dict[str, str]) -> int:
    """MaxArraySize of a parsed `scontrol show config`, else Slurm's default."""
    try:
        return int(config["MaxArraySize"])
    except (KeyError, ValueError):
        return DEFAULT_MAX_ARRAY_SIZE


def config(*, timeout: float = QUERY_TIMEOUT_S) -> dict[str, str]:
    """The cluster's configuration, as `scontrol show config` says it (`parse_config`)."""
    hint = f"run submit where Slurm is set up; {CONTROLLER_HINT}"
    ran = _query(["scontrol", "show", "config"], timeout=timeout, hint=hint)
    if not ran.ok:
        raise _failed(ran, hint)
    return parse_config(ran.stdout)


def max_array_size() -> int:
    """How many elements one Slurm array may have: asked once per process and cluster (the
    scontrol found, the slurm.conf it reads), since it changes only with the cluster's
    configuration."""
    return _max_array_size(shutil.which("scontrol"), os.environ.get("SLURM_CONF"))


@cache
def _max_array_size(_scontrol: str | None, _conf: str | None) -> int:
    return parse_max_array_size(config())


def parse_node_address(text: str) -> str | None:
    """NodeAddr of `scontrol show node -o NAME` output (the address Slurm reaches it at)."""
    for field_ in text.split():
        key, _, value = field_.partition("=")
        if key == "NodeAddr" and value and value != "(null)":
            return value
    return None


def node_address(name: str, *, timeout: float = QUERY_TIMEOUT_S) -> str | None:
    """The address Slurm knows node `name` by, None when scontrol does not say."""
    hint = f"run this on a node of the cluster; {CONTROLLER_HINT}"
    ran = _query(["scontrol", "show", "node", "-o", name], timeout=timeout, hint=hint)
    return parse_node_address(ran.stdout) if ran.ok else None


# --- scontrol show assoc_mgr: how many more jobs the user may queue ---------------------------

# A limit on queued jobs with what counts against it now (`MaxSubmitJobs=20(15)`); `N` is none.
_SUBMIT_LIMIT = re.compile(r"\b(?:Max|Grp)SubmitJobs=(\d+)\((\d+)\)")


def parse_submit_room(text: str, user: str) -> int | None:
    """How many more jobs (each array element counts) `user` may queue, from `scontrol show
    assoc_mgr users=USER flags=assoc` output: the least room a MaxSubmitJobs or GrpSubmitJobs
    of the user's associations and their accounts leaves; None when none sets one (or the
    cluster keeps no associations: no accounting)."""
    rooms = []
    for record in text.split("ClusterName=")[1:]:
        owner = re.search(r"\bUserName=(\S*)", record)
        if owner and owner.group(1) and owner.group(1).split("(", 1)[0] != user:
            continue  # another user's association
        rooms += [int(limit) - int(used) for limit, used in _SUBMIT_LIMIT.findall(record)]
    return max(0, min(rooms)) if rooms else None


def submit_room(user: str, *, timeout: float = QUERY_TIMEOUT_S) -> int | None:
    """How many more jobs `user` may queue now (`parse_submit_room`); None when no limit is
    known, which a cluster that refuses to say (older Slurm, a site's PrivateData) also is:
    sbatch's refusal then says it (`SubmitLimitReached`)."""
    command = ["scontrol", "show", "assoc_mgr", f"users={user}", "flags=assoc"]
    ran = _query(command, timeout=timeout, hint=f"submit needs scontrol; {CONTROLLER_HINT}")
    return parse_submit_room(ran.stdout, user) if ran.ok else None


# --- what `harbor-hpc doctor` asks ---------------------------------------------------------


def missing_commands() -> list[str]:
    return [command for command in COMMANDS if shutil.which(command) is None]


def version(*, timeout: float = QUERY_TIMEOUT_S) -> str:
    """`sbatch --version` ("slurm 22.05.8"), or "" when it does not say."""
    ran = run(["sbatch", "--version"], timeout=timeout)
    return ran.stdout.strip() if ran.ok else ""


@dataclass(frozen=True)
class Ping:
    """What `scontrol ping` said: one line per controller, and all of it for a diagnosis."""

    controllers: list[str]
    output: str
    why: str

    @property
    def up(self) -> bool:
        """A backup controller may be down; one that is up is enough."""
        return any(line.endswith(" is UP") for line in self.controllers)


def parse_ping(text: str) -> list[str]:
    """The controller lines of `scontrol ping` ("Slurmctld(primary) at HOST is UP")."""
    return [line.strip() for line in text.splitlines() if "Slurmctld" in line]


def ping(*, timeout: float = QUERY_TIMEOUT_S) -> Ping:
    ran = run(["scontrol", "ping"], timeout=timeout)
    return Ping(parse_ping(ran.stdout), ran.stdout + ran.stderr, ran.why())


@dataclass(frozen=True)
class Partitions:
    """Each partition's node states (all `down` when the partition itself is not up)."""

    states: dict[str, set[str]]

    @property
    def usable(self) -> list[str]:
        """The partitions with a node that runs jobs, or that Slurm wakes to run them."""
        return sorted(
            name
            for name, node_states in self.states.items()
            if any(state.rstrip(_WAKING_SUFFIXES) in _USABLE_STATES for state in node_states)
        )

    @property
    def summary(self) -> str:
        """`debug* (idle), gpu (drained/idle~)`."""
        return ", ".join(
            f"{name} ({'/'.join(sorted(states))})" for name, states in sorted(self.states.items())
        )


def parse_partitions(text: str) -> Partitions:
    """`sinfo --noheader --format="%P %a %D %T"` output: one line per partition and state."""
    states: dict[str, set[str]] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 4:
            name, availability, _nodes, state = fields
            states.setdefault(name, set()).add(state if availability == "up" else "down")
    return Partitions(states)


def partitions(*, timeout: float = QUERY_TIMEOUT_S) -> Partitions:
    hint = "check `sinfo` by hand; the controller answers but lists nothing"
    ran = _query(["sinfo", "--noheader", "--format=%P %a %D %T"], timeout=timeout, hint=hint)
    if not ran.ok:
        raise _failed(ran, hint)
    return parse_partitions(ran.stdout)


# States (sinfo's short names) of a node that can take a job now or soon; any other (down,
# drain, fail, maint, powered off, not responding: a trailing `*`) is not asked.
_TAKES_JOBS = frozenset({"idle", "mix", "alloc", "comp", "resv", "plnd", "boot"})
_FLAGS = "*~#!%$@^-+"


@dataclass(frozen=True)
class PartitionNodes:
    """A partition's nodes as sinfo lists them: those that take jobs, and the others."""

    partition: str
    asked: tuple[str, ...]
    not_taking_jobs: tuple[str, ...]


def parse_partition_nodes(text: str, partition: str | None) -> PartitionNodes:
    """`sinfo -h -N -o "%N|%t|%P"` output: the nodes of `partition`, else of the default one
    (its name marked `*`)."""
    rows = [line.split("|") for line in text.splitlines() if line.count("|") == 2]
    if partition is None:
        partition = next((p.rstrip("*") for _n, _s, p in rows if p.endswith("*")), None)
        if partition is None:
            raise InputError(
                "Slurm names no default partition", hint="pass --partition, or set partition"
            )
    mine = [(node, state) for node, state, p in rows if p.rstrip("*") == partition]
    if not mine:
        known = sorted({p.rstrip("*") for _n, _s, p in rows})
        raise InputError(f"partition {partition!r} has no nodes", hint="known: " + ", ".join(known))
    # sinfo marks a state with a flag: `idle*` a node that missed the controller's last ping
    # (a busy one, often), `idle~` one powered down until a job needs it; the state is the word.
    asked = tuple(sorted({node for node, state in mine if state.rstrip(_FLAGS) in _TAKES_JOBS}))
    others = tuple(sorted({node for node, _state in mine} - set(asked)))
    return PartitionNodes(partition, asked, others)


def partition_nodes(partition: str | None, *, timeout: float = QUERY_TIMEOUT_S) -> PartitionNodes:
    """The nodes of `partition` (None: the default partition), as sinfo lists them now."""
    hint = f"check `sinfo -N` by hand; {CONTROLLER_HINT}"
    ran = _query(["sinfo", "-h", "-N", "-o", "%N|%t|%P"], timeout=timeout, hint=hint)
    if not ran.ok:
        raise _failed(ran, hint)
    return parse_partition_nodes(ran.stdout, partition)


# --- sbatch, through submitit ----------------------------------------------------------------


@dataclass(frozen=True)
class SlurmPlacement:
    """Where a step's jobs go and for how long, as every step takes it (`--partition`,
    `--account`, `--qos`, `--time`, `--sbatch-arg`): None leaves it to Slurm (the time to the
    step, which knows what it runs)."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_min: int | None = None
    # Further sbatch options as typed: `constraint=a100`, `--exclusive`.
    sbatch_args: tuple[str, ...] = ()
    # Shell lines every batch script of ours runs first, in order (`module load apptainer`).
    setup: tuple[str, ...] = ()
    # What harbor-hpc.toml may set (`core.config.configured`); its time_min sizes trials only.
    CONFIGURED: ClassVar[tuple[str, ...]] = ("partition", "account", "qos", "setup")

    def __post_init__(self) -> None:
        object.__setattr__(self, "sbatch_args", tuple(self.sbatch_args))
        object.__setattr__(self, "setup", tuple(self.setup))

    def sbatch(self) -> dict[str, Any]:
        """`sbatch_args` as submitit takes them (`constraint="a100"`, `exclusive=True`)."""
        extra: dict[str, Any] = {}
        for arg in self.sbatch_args:
            key, sep, value = arg.lstrip("-").partition("=")
            if not key:
                raise InputError(
                    f"--sbatch-arg {arg!r} is empty", hint="e.g. --sbatch-arg constraint=a100"
                )
            extra[key.replace("-", "_")] = value if sep else True
        return extra

    def script_lines(self) -> list[str]:
        """The `#SBATCH` lines of a batch script of ours (time aside) for this placement."""
        named = {"partition": self.partition, "account": self.account, "qos": self.qos}
        lines = [f"#SBATCH --{key}={value}" for key, value in named.items() if value]
        for key, value in self.sbatch().items():
            option = key.replace("_", "-")
            lines.append(f"#SBATCH --{option}" if value is True else f"#SBATCH --{option}={value}")
        return lines

    def render(self, name: str, values: Mapping[str, str] | None = None) -> str:
        """The template `slurm/<name>` rendered: its `setup` this placement's lines, as written,
        one a line, and `values` its other placeholders."""
        return render_template(name, {"setup": "\n".join(self.setup), **(values or {})}, "slurm")

    def to_json(self) -> dict[str, Any]:
        return {
            "partition": self.partition,
            "account": self.account,
            "qos": self.qos,
            "time_min": self.time_min,
            "sbatch_args": list(self.sbatch_args),
            "setup": list(self.setup),
        }


@dataclass(frozen=True)
class JobRequest:
    """What each element of an array asks for, where `placement` says."""

    name: str
    time_min: int
    mem_mb: int
    cpus: int
    gpus: int = 0
    # The GPU type as Slurm names it (a GRES type), or None for any.
    gpu_type: str | None = None
    placement: SlurmPlacement = field(default_factory=SlurmPlacement)
    array_parallelism: int | None = None


# An array of one element per image or build context (`convert --slurm`, `build --slurm`):
# each element's time unless the placement names one.
UNIT_TIME_MIN = 60


@dataclass(frozen=True)
class UnitArray:
    """The Slurm array job converting (or building) images, once queued: one element per
    image; its logs in the store (`unit_log_dir`), which every node reaches."""

    job: str
    images: int
    log_dir: Path


def unit_request(
    name: str,
    placement: SlurmPlacement,
    *,
    cpus: int,
    mem_mb: int,
    array_parallelism: int | None = None,
) -> JobRequest:
    """What each element of a unit array `name` asks for, where `placement` says."""
    return JobRequest(
        name,
        time_min=placement.time_min or UNIT_TIME_MIN,
        mem_mb=mem_mb,
        cpus=cpus,
        placement=placement,
        array_parallelism=array_parallelism,
    )


def unit_log_dir(store: Path) -> Path:
    """Where the conversion and build jobs write their logs: in the store."""
    return store.expanduser().absolute() / ".slurm"


@cache
def _bounded_slurm_executor() -> type[submitit.SlurmExecutor]:
    """submitit's Slurm executor with sbatch under coreutils' `timeout`: submitit itself waits
    for sbatch without a limit. (A class made on first use: submitit loads only then.)"""
    import submitit

    # submitit has no public hook for the sbatch command line (bounded here, and rid of an
    # enclosing job's variables: `outside_job`) nor for the batch script's command: this
    # overrides its private `_make_submission_command` and `_make_submission_file_text`
    # (checked with submitit 1.5.4). Should they move, the overrides would silently do
    # nothing; tests/slurm/test_cluster.py then fails at once.
    class BoundedSlurmExecutor(submitit.SlurmExecutor):
        def _make_submission_command(self, submission_file_path: Path) -> list[str]:
            sbatch = super()._make_submission_command(submission_file_path)
            bounded = ["timeout", "--kill-after=5", f"{SBATCH_TIMEOUT_S:g}", *sbatch]
            return [*outside_job(), *bounded]

        def _make_submission_file_text(self, command: str, uid: str) -> str:
            # The element's Python is the batch shell itself, so that the requeue warning
            # Slurm sends the batch shell (`--signal=B:...`) reaches it (`use_srun=False`).
            return super()._make_submission_file_text(f"exec {command}", uid)

    return BoundedSlurmExecutor


# A shell line before submitit's local controller: SIGINT ignored, which the controller and the
# workers it starts inherit (Python then installs no KeyboardInterrupt handler).
LOCAL_JOBS_IGNORE_CTRL_C = "trap '' INT"


def executor(folder: Path, where: Executor, request: JobRequest) -> submitit.Executor:
    """The submitit executor for `request`: Slurm array jobs, or local processes (which take
    only the time limit: there is no scheduler to ask for memory or CPUs)."""
    import submitit

    if where is Executor.LOCAL:
        local = submitit.LocalExecutor(folder=folder, max_num_timeout=MAX_REQUEUES)
        local.update_parameters(
            timeout_min=request.time_min,
            signal_delay_s=requeue_warning_s(request.time_min),
            # Ctrl-C in the terminal that queued them is not for the local jobs (it printed
            # their controllers' tracebacks there and broke their trials): a job ends when its
            # run is cancelled (as leaving a trainer's batch early does) or by SIGTERM, as a
            # Slurm job would.
            setup=[LOCAL_JOBS_IGNORE_CTRL_C],
        )
        return local
    slurm = _bounded_slurm_executor()(folder=folder, max_num_timeout=MAX_REQUEUES)
    warning_s = requeue_warning_s(request.time_min)
    parameters: dict[str, Any] = {
        "job_name": request.name,
        "time": request.time_min,
        "mem": f"{request.mem_mb}M",
        "cpus_per_task": request.cpus,
        "signal_delay_s": warning_s,
        # No srun step inside the element: its Python runs in the batch script (exec), which
        # spares the controller a step's RPCs (an allocation lookup and a step creation) and
        # the node a step's processes, per element. The requeue warning then goes to the
        # batch shell, which is that Python.
        "use_srun": False,
        "additional_parameters": {
            "signal": f"B:{JOB_SIGNAL}@{warning_s}",
            **request.placement.sbatch(),
        },
    }
    optional = {
        "partition": request.placement.partition,
        "account": request.placement.account,
        "qos": request.placement.qos,
        "array_parallelism": request.array_parallelism,
    }
    parameters.update({key: value for key, value in optional.items() if value})
    # submitit writes the batch script; ours is the lines it runs first (slurm/array_setup.sh).
    parameters["setup"] = request.placement.render("array_setup.sh").splitlines()
    if request.gpus:
        # GRES is what every Slurm with GPUs takes; a gres of the user's (--sbatch-arg) wins.
        parameters["gres"] = _gres(request)
    slurm.update_parameters(**parameters)
    return slurm


def _gres(request: JobRequest) -> str:
    kind = f"{request.gpu_type}:" if request.gpu_type else ""
    return f"gpu:{kind}{request.gpus}"


def try_request(request: JobRequest, *, what: str, hint: str) -> None:
    """Ask Slurm whether it would take an element of `request` (`sbatch --test-only`, nothing
    queued): its refusal (a partition, account, QOS or size it does not take) is a `SlurmError`
    naming `what`, as `submit_array`'s; the user's limit on queued jobs is no refusal here."""
    flags = [line.removeprefix("#SBATCH ") for line in request.placement.script_lines()]
    flags += [f"--time={request.time_min}", f"--mem={request.mem_mb}M"]
    flags += [
        f"--cpus-per-task={request.cpus}",
        *([f"--gres={_gres(request)}"] * (request.gpus > 0)),
    ]
    require_sbatch(what, hint="run on a Slurm login node (`module load slurm`?)")
    ran = run(["sbatch", "--test-only", *flags, "--wrap", "true"], timeout=SBATCH_TIMEOUT_S)
    if ran.ok or _SUBMIT_LIMIT_WORDS.search(ran.stderr):
        return
    said = " ".join(ran.stderr.split()) or ran.why()
    raise _refused(what, said, hint, answered=not ran.error)


# What Slurm and submitit set in a job's environment. A job queued from inside one (an element
# queueing the next wave, a submit from an interactive allocation) would inherit each that Slurm
# does not set anew: a single-element array goes out as a plain job, whose submitit read the
# parent's array ids and ran the parent's chunk instead of its own (submitit.helpers.clean_env
# hides the same, and the cluster's name with them, which sbatch needs).
_JOB_VARIABLES = ("SLURM_", "SLURMD_", "SRUN_", "SUBMITIT_")
_CLUSTER_VARIABLES = frozenset({"SLURM_CONF", "SLURM_CLUSTERS"})


def outside_job() -> list[str]:
    """Inside a Slurm job, `env -u NAME...` for the job's variables: the prefix of an sbatch
    command line that hands the job it queues none of them (this process's environment, which
    a trainer's other threads read, is left as it is); outside one, nothing."""
    if "SLURM_JOB_ID" not in os.environ:
        return []
    names = sorted(
        name
        for name in os.environ
        if name.startswith(_JOB_VARIABLES) and name not in _CLUSTER_VARIABLES
    )
    return ["env", *(word for name in names for word in ("-u", name))]


def submit_array(
    pool: submitit.Executor,
    function: Callable[..., Any],
    *arguments: list[Any],
    what: str,
    hint: str,
) -> list[submitit.Job[Any]]:
    """Queue `function` over `arguments` as one array job; a refusal by sbatch (or an sbatch
    that does not answer) is a `SlurmError` naming `what`."""
    from submitit.core.utils import FailedJobError, FailedSubmissionError

    # submitit prints a refusing sbatch's stderr as it raises it: the error carries it already.
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            jobs = pool.map_array(function, *arguments)
        sys.stderr.write(printed.getvalue())
        return jobs
    except (FailedJobError, FailedSubmissionError) as exc:
        # `timeout` exits 124 (137 once killed) and says nothing.
        if getattr(exc.__cause__, "returncode", None) in (124, 137):
            said = f"sbatch did not answer within {SBATCH_TIMEOUT_S:g} s"
            raise _refused(what, said, hint, answered=False) from None
        said = " ".join(str(exc).split()) or type(exc).__name__
        if _SUBMIT_LIMIT_WORDS.search(said):
            raise SubmitLimitReached(f"Slurm refused {what}: {said}", hint=hint) from None
        raise _refused(what, said, hint) from None


# sbatch's words for a job refused for the user's limit on queued jobs (the association's
# AssocMaxSubmitJobLimit, a QOS's QOSMaxSubmitJobPerUserLimit, "job submit limit").
_SUBMIT_LIMIT_WORDS = re.compile(r"MaxSubmitJob|GrpSubmitJob|job submit limit")


# Slurm's words when the controller could not take a call (the cluster's fault: try again)
# rather than refused it (a partition, account, QOS, time or size the cluster does not take);
# `run`'s own when the command did not answer in time.
_UNREACHABLE = ("unable to contact", "timed out", "temporarily unable", "did not answer")


def _unanswered(said: str) -> bool:
    return any(words in said.lower() for words in _UNREACHABLE)


def _refused(what: str, said: str, hint: str, *, answered: bool = True) -> SlurmError:
    """sbatch's refusal of `what`: bad input (exit 2, the request must change) when sbatch
    `answered` so itself; `SlurmUnreachable` (exit 1) when the controller could not be reached."""
    if not answered or _unanswered(said):
        return SlurmUnreachable(f"Slurm refused {what}: {said}", hint=hint, exit_code=1)
    return SlurmError(f"Slurm refused {what}: {said}", hint=hint, exit_code=2)


# --- waiting for an array's results ---------------------------------------------------------

POLL_S = 2.0
# A result file can show up on a shared filesystem a little after its job left the queue.
VANISHED_GRACE_S = 30.0
SQUEUE_EVERY_S = 15.0

Outcome = dict[str, Any]


def await_array(
    jobs: Collection[submitit.Job[Outcome]], *, retry: str
) -> Iterator[tuple[submitit.Job[Outcome], Outcome]]:
    """Each of `jobs` with its outcome as it finishes: the dict its function returned, else
    `{"error", "hint"}` when it failed or left the queue without a result (`retry` says how to
    try again). Result files are read every POLL_S; whether a job without one is still alive
    is asked of `squeue` (not `sacct`, which clusters often lack) every SQUEUE_EVERY_S, none
    taken for gone while the controller does not answer (`Silence`)."""
    pending = list(jobs)
    vanished: dict[str, float] = {}
    last_squeue = time.monotonic()
    silence = Silence()
    while pending:
        for job in [j for j in pending if j.paths.result_pickle.exists()]:
            pending.remove(job)
            yield job, _outcome(job)
        if pending and time.monotonic() - last_squeue >= SQUEUE_EVERY_S:
            last_squeue = time.monotonic()
            try:
                alive = queued_jobs([job.job_id for job in pending])
            except SlurmUnreachable as exc:  # none is taken for gone meanwhile
                silence.unanswered(exc, last_squeue, "waiting for the jobs' results meanwhile")
                vanished.clear()
                continue
            silence.answered()
            now = time.monotonic()
            for job in [j for j in pending if j.job_id not in alive]:
                if now - vanished.setdefault(job.job_id, now) >= VANISHED_GRACE_S:
                    pending.remove(job)
                    log = job.paths.stderr
                    error = f"Slurm job {job.job_id} ended without a result"
                    yield job, {"error": error, "hint": f"see its log {log}; {retry}"}
        if pending:
            time.sleep(POLL_S)


def _outcome(job: submitit.Job[Outcome]) -> Outcome:
    from submitit.core.utils import FailedJobError, UncompletedJobError

    try:
        return job.result()
    except (FailedJobError, UncompletedJobError) as exc:
        last_line = str(exc).strip().splitlines()[-1:] or ["no message"]
        return {"error": f"Slurm job {job.job_id} failed: {last_line[0]}", "hint": None}


# --- one batch script, not a Python function: services that live as long as their job -------


def submit_script(script: Path, *, what: str, hint: str) -> str:
    """Queue `script` (its `#SBATCH` lines say what it needs) and return its job id; a refusal
    by sbatch, or an sbatch that does not answer, is a `SlurmError` naming `what`."""
    require_sbatch(what, hint="run on a Slurm login node (`module load slurm`?)")
    ran = run([*outside_job(), "sbatch", "--parsable", str(script)], timeout=SBATCH_TIMEOUT_S)
    if not ran.ok:
        # An error: sbatch did not run to its end (it did not answer, or we were stopped).
        raise _refused(what, ran.why(), hint, answered=not ran.error)
    # --parsable prints `id` or `id;cluster`.
    return ran.stdout.strip().split(";", 1)[0]


def job_status(job_id: str, *, timeout: float = QUERY_TIMEOUT_S) -> tuple[str, str] | None:
    """squeue's state of one job (PENDING, RUNNING, COMPLETING...) and its reason (why it
    pends: Resources, Priority...; "None" when there is none), None once it left the queue."""
    hint = f"run this where the job was submitted; {CONTROLLER_HINT}"
    ran = _query(["squeue", "-h", "-o", "%T|%r", "-j", job_id], timeout=timeout, hint=hint)
    if not ran.ok:
        if not ran.error and "Invalid job id" in ran.stderr:
            return None
        raise _failed(ran, hint)
    state, _, reason = ran.stdout.strip().partition("|")
    return (state, reason) if state else None


def job_nodes(job_id: str, *, timeout: float = QUERY_TIMEOUT_S) -> set[str]:
    """The nodes job `job_id` holds now: one Slurm took out of it (a node that failed under a
    `--no-kill` job) is not among them; none once the job left the queue."""
    hint = f"run this on a node of the cluster; {CONTROLLER_HINT}"
    ran = _query(["squeue", "-h", "-o", "%N", "-j", job_id], timeout=timeout, hint=hint)
    if not ran.ok or not ran.stdout.strip():
        return set()
    names = ["scontrol", "show", "hostnames", ran.stdout.strip()]
    expanded = _query(names, timeout=timeout, hint=hint)
    return set(expanded.stdout.split()) if expanded.ok else set()


def job_state(job_id: str, *, timeout: float = QUERY_TIMEOUT_S) -> str | None:
    """squeue's state of one job, None once it left the queue."""
    status = job_status(job_id, timeout=timeout)
    return status[0] if status is not None else None


def cancel(*job_ids: str, timeout: float = QUERY_TIMEOUT_S) -> None:
    """End jobs of the user's (one scancel); one that already left the queue is not an error.
    Also in a command told to stop: ending its own job is the stop's clean-up."""
    hint = f"try `scancel {' '.join(job_ids)}` by hand; {CONTROLLER_HINT}"
    ran = _query(["scancel", *job_ids], timeout=timeout, hint=hint, cleanup=True)
    if not ran.ok and (ran.error or "Invalid job id" not in ran.stderr):
        raise _failed(ran, hint)
