"""What this machine has for each role, probed for real: the checks behind `harbor-hpc doctor`.

Two roles need different parts. The cluster role (login and compute nodes) needs Apptainer that
can actually run an image for this user, and a reachable Slurm; the build role needs a Docker
Engine or Apptainer builds that work for this user (`build --builder apptainer`): either will
do. The probes live with the code they check (containers/probes.py, images/engine.py, the
slurm/probes.py, core/probe.py for the install) and are what that code itself relies on;
here they are only gathered by part and role. Every probe is bounded in time and turns any
failure into a `Check` that says what is wrong and how to fix it, so the doctor still answers on
a machine where every tool is missing.

`part_problem` is the short form the test suite uses (tests/conftest.py): None when a part
works here, else why not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harbor_hpc.core.config import Config, cache_dir
from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.core.probe import Finding, Status, harbor_finding, python_finding

if TYPE_CHECKING:  # each layer loads when its checks run (`doctor --help` stays quick)
    from harbor_hpc.runtimes.apptainer import Compression
    from harbor_hpc.runtimes.apptainer_nodes import Asked
    from harbor_hpc.slurm.cluster import SlurmPlacement

log = logging.getLogger(__name__)

__all__ = [
    "Check",
    "NodesReport",
    "Part",
    "Report",
    "Role",
    "Status",
    "ask_nodes",
    "part_problem",
    "run_doctor",
]


class Role(StrEnum):
    CLUSTER = "cluster"
    BUILD = "build"
    ALL = "all"


class Part(StrEnum):
    APPTAINER = "apptainer"
    SLURM = "slurm"
    DOCKER = "docker"
    APPTAINER_BUILD = "apptainer-build"
    CACHE = "cache"
    HARBOR = "harbor"
    PYTHON = "python"


# What a role cannot work without: each entry a choice of parts, any one of which will do; the
# other parts are reported but never fail the doctor.
REQUIRED_PARTS: dict[Role, tuple[tuple[Part, ...], ...]] = {
    Role.CLUSTER: ((Part.APPTAINER,), (Part.SLURM,)),
    Role.BUILD: ((Part.DOCKER, Part.APPTAINER_BUILD),),
    Role.ALL: ((Part.APPTAINER,), (Part.SLURM,), (Part.DOCKER, Part.APPTAINER_BUILD)),
}
# The parts a missing check fails (a check of any other part is a warning at worst).
_ESSENTIAL = {part for choice in REQUIRED_PARTS[Role.ALL] for part in choice}
# Which role looks at a part; the parts of `all` are shown for every role.
PART_ROLE: dict[Part, Role] = {
    Part.APPTAINER: Role.CLUSTER,
    Part.SLURM: Role.CLUSTER,
    Part.CACHE: Role.CLUSTER,
    Part.DOCKER: Role.BUILD,
    Part.APPTAINER_BUILD: Role.BUILD,
    Part.HARBOR: Role.ALL,
    Part.PYTHON: Role.ALL,
}
PART_TITLES: dict[Part, str] = {
    Part.APPTAINER: "Containers (Apptainer or enroot)",
    Part.SLURM: "Slurm",
    Part.DOCKER: "Docker",
    Part.APPTAINER_BUILD: "Apptainer builds",
    Part.CACHE: "SIF cache",
    Part.HARBOR: "Harbor",
    Part.PYTHON: "Python",
}


@dataclass(frozen=True)
class Check:
    """A `Finding` of one part."""

    part: Part
    name: str
    status: Status
    detail: str
    fix: str = ""

    @classmethod
    def of(cls, part: Part, finding: Finding) -> Check:
        return cls(part, finding.name, finding.status, finding.detail, finding.fix)

    @property
    def role(self) -> Role:
        return PART_ROLE[self.part]

    def as_dict(self) -> dict[str, str]:
        return {
            "role": str(self.role),
            "part": str(self.part),
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
        """The parts of each need of the role whose every choice has a check in the `missing`
        state."""
        broken = {check.part for check in self.checks if check.status is Status.MISSING}
        return [
            part
            for choice in REQUIRED_PARTS[self.role]
            if all(part in broken for part in choice)
            for part in choice
        ]

    @property
    def ok(self) -> bool:
        return not self.missing_parts

    def working_alternative(self, part: Part) -> Part | None:
        """Another part the role takes instead of `part` (Apptainer builds for Docker) that
        works here: then a check of `part` that is not ok needs no fix."""
        broken = {check.part for check in self.checks if check.status is Status.MISSING}
        for choice in REQUIRED_PARTS[self.role]:
            if part in choice:
                return next((p for p in choice if p != part and p not in broken), None)
        return None

    def to_json(self) -> list[dict[str, Any]]:
        """`harbor-hpc doctor --json`: one object per check."""
        return [check.as_dict() for check in self.checks]


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
        part
        for part, part_role in PART_ROLE.items()
        if role is Role.ALL or part_role in (role, Role.ALL)
    ]
    cache = resolve_cache_dir(cache_dir)
    with ThreadPoolExecutor(max_workers=len(wanted)) as pool:
        results = list(pool.map(lambda part: probe_part(part, cache), wanted))
    return Report(role, [check for checks in results for check in checks])


def part_problem(part: str) -> str | None:
    """None when `part` ("docker", "slurm", "apptainer", "apptainer-build") works here, else a
    short reason."""
    testable = sorted(_ESSENTIAL)
    if part not in testable:
        raise ValueError(f"unknown part {part!r}, expected one of {', '.join(testable)}")
    for check in probe_part(Part(part), resolve_cache_dir(None)):
        if check.status is Status.MISSING:
            return f"{check.name}: {check.detail}"
    return None


def probe_part(part: Part, cache_dir: Path) -> list[Check]:
    """The checks of one part; a probe that breaks becomes a check, never an exception."""
    # Each layer's probes load when a check runs (`doctor --help` stays quick).
    from harbor_hpc.containers import probes as apptainer
    from harbor_hpc.images.engine import engine_finding
    from harbor_hpc.slurm import probes as slurm

    probes: dict[Part, Callable[[], list[Finding]]] = {
        Part.APPTAINER: lambda: apptainer.findings(cache_dir),
        Part.SLURM: slurm.findings,
        Part.DOCKER: lambda: [engine_finding()],
        Part.APPTAINER_BUILD: lambda: apptainer.build_findings(cache_dir),
        Part.CACHE: lambda: [apptainer.store_finding(cache_dir), *apptainer.compression_findings()],
        Part.HARBOR: lambda: [harbor_finding()],
        Part.PYTHON: lambda: [python_finding()],
    }
    try:
        return [Check.of(part, finding) for finding in probes[part]()]
    except Exception as exc:  # the doctor reports; it must not crash on what it diagnoses
        log.debug("probe %s failed", part, exc_info=True)
        status = Status.MISSING if part in _ESSENTIAL else Status.WARN
        return [
            Check(part, "probe", status, f"the check itself failed: {type(exc).__name__}: {exc}")
        ]


# --- doctor --nodes: what every node of a partition reads -------------------------------------

ASK_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class NodesReport:
    """The nodes' answers, and the compression every .sif made from now on gets."""

    asked: Asked
    compression: Compression

    @property
    def ok(self) -> bool:
        """Every node of the partition answered (whatever it answered)."""
        return not self.asked.unanswered

    def to_json(self) -> dict[str, Any]:
        return {
            **self.asked.to_json(),
            "compression": self.compression.name,
            "why": self.compression.why,
        }


def ask_nodes(
    placement: SlurmPlacement,
    cache_dir: Path | None = None,
    *,
    timeout: float = ASK_TIMEOUT_S,
    say: Callable[[str], None] = lambda _line: None,
) -> NodesReport:
    """Ask every node of the placement's partition (else the default one) whether it reads a
    zstd .sif, one small job each (slurm/nodes.py); keep the answers for the compression of
    every .sif made after (runtimes/apptainer_nodes.py). Without Apptainer here (enroot's
    clusters) the test image is made as `convert` makes images without it."""
    from harbor_hpc.containers.probes import probe_image
    from harbor_hpc.runtimes.apptainer import (
        SQUASHFS_COMPRESSION,
        Compression,
        local_apptainer,
        sif_compression,
        zstd_here,
    )
    from harbor_hpc.runtimes.apptainer_nodes import save_answers
    from harbor_hpc.slurm.nodes import ask_nodes as ask

    cannot = zstd_here()
    if cannot is not None:
        raise HarborHpcError(
            f"{cannot}: every .sif made here is gzip, whatever the nodes read",
            hint="load Apptainer 1.4 or newer here (`module load apptainer`), then ask again",
        )
    store = resolve_cache_dir(cache_dir)
    zstd = Compression(SQUASHFS_COMPRESSION, "asking the nodes")
    with probe_image(local_apptainer(), store, zstd) as image:
        if not image.is_relative_to(store):
            raise HarborHpcError(
                f"{store}: cannot keep the test image there, where the nodes would read it",
                hint="name a store every node reaches and you may write (--cache-dir)",
            )
        asked = ask(placement, image, store / ".doctor" / "nodes", timeout=timeout, say=say)
    save_answers(asked)
    sif_compression.cache_clear()
    return NodesReport(asked, sif_compression())
