"""The doctor against the real parts, and against a machine where none of them can be found."""

from __future__ import annotations

import getpass
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harbor_hpc.core.proc import run
from harbor_hpc.slurm import probes as slurm_probes
from harbor_hpc.slurm.cluster import parse_config, parse_partitions
from harbor_hpc.steps import doctor
from harbor_hpc.steps.doctor import Part, Role, Status
from tests.support.fake_slurm import RECORDED
from tests.support.users import other_user_command


def run_cli(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "harbor_hpc", "doctor", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=120,
        check=False,
    )


def bare_env(tmp_path: Path) -> dict[str, str]:
    """An environment with no tool on PATH, a Docker socket nobody listens on, no config."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    keep = {"HOME", "LANG", "LC_ALL", "TERM", "SSL_CERT_FILE"}
    env = {key: value for key, value in os.environ.items() if key in keep}
    env.update(
        PATH=str(empty),
        DOCKER_HOST=f"unix://{tmp_path / 'dead.sock'}",
        HARBOR_HPC_CACHE=str(tmp_path / "cache"),
        COLUMNS="400",  # one table row a line, so that phrases are not split across lines
    )
    return env


def by_part(checks: list[dict[str, str]]) -> dict[str, set[str]]:
    statuses: dict[str, set[str]] = {}
    for check in checks:
        statuses.setdefault(check["part"], set()).add(check["status"])
    return statuses


def test_no_tools_on_path_exits_nonzero_and_names_what_is_missing(tmp_path: Path) -> None:
    done = run_cli("--role", "all", env=bare_env(tmp_path), cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "Traceback" not in output
    for name in ("Apptainer", "Slurm", "Docker", "module load apptainer", "DOCKER_HOST"):
        assert name in output
    assert "not ready for every role" in output
    # Nothing padded to the terminal's width: pasted into an issue, no line drags blanks.
    assert [line for line in done.stdout.splitlines() if line != line.rstrip()] == []


def test_no_tools_json_lists_every_check(tmp_path: Path) -> None:
    done = run_cli("--json", env=bare_env(tmp_path), cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    statuses = by_part(json.loads(done.stdout))
    assert statuses["apptainer"] == {"missing"}
    assert statuses["slurm"] == {"missing"}
    assert "docker" not in statuses  # the cluster role does not look at the build machine
    assert statuses["harbor"] == {"ok"}
    assert "Containers (Apptainer or enroot), Slurm missing" in " ".join(done.stderr.split())


def test_broken_apptainer_install_is_missing_with_its_error(tmp_path: Path) -> None:
    broken = tmp_path / "apptainer"
    broken.write_text(
        "#!/bin/sh\necho 'error while loading shared libraries: libc.so.6' >&2\nexit 127\n"
    )
    broken.chmod(0o755)
    env = bare_env(tmp_path)
    env["HARBOR_HPC_APPTAINER"] = str(broken)
    done = run_cli("--json", env=env, cwd=tmp_path)
    assert done.returncode == 1
    version = next(check for check in json.loads(done.stdout) if check["check"] == "version")
    assert version["status"] == "missing" and "libc.so.6" in version["detail"]


def test_broken_config_is_reported_not_fatal(tmp_path: Path) -> None:
    env = bare_env(tmp_path)
    config = tmp_path / "harbor-hpc.toml"
    config.write_text("cache_dir = [\n")
    env["HARBOR_HPC_CONFIG"] = str(config)
    done = run_cli("--role", "build", "--json", env=env, cwd=tmp_path)
    assert done.returncode == 1
    assert "config ignored" in done.stderr and "Traceback" not in done.stderr
    assert by_part(json.loads(done.stdout))["docker"] == {"missing"}


def test_part_problem_names_the_missing_piece(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'dead.sock'}")
    assert "sbatch is not on PATH" in (doctor.part_problem("slurm") or "")
    assert "no socket there" in (doctor.part_problem("docker") or "")
    with pytest.raises(ValueError):
        doctor.part_problem("registry")


def test_cache_dir_that_cannot_be_a_folder_warns(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    check = doctor.probe_part(Part.CACHE, blocker / "sif")[0]  # then the compression's
    assert check.status is Status.WARN
    assert "not a folder" in check.detail and "--cache-dir" in check.fix


def test_cache_dir_to_be_created_is_fine(tmp_path: Path) -> None:
    check = doctor.probe_part(Part.CACHE, tmp_path / "a" / "b")[0]
    assert check.status is Status.OK and "will be created" in check.detail


def test_a_hung_tool_is_cut_short() -> None:
    ran = run(["sleep", "30"], timeout=0.2)
    assert not ran.ok and "did not answer within 0.2 s" in ran.why()


def test_a_tool_that_cannot_run_is_a_finding(tmp_path: Path) -> None:
    ran = run([str(tmp_path / "nothing-here")])
    assert not ran.ok and "cannot run" in ran.why()


@pytest.mark.parametrize(
    ("sinfo", "status"),
    [
        ("debug* up 1 idle\n", Status.OK),
        ("gpu up 4 idle~\ncpu up 2 drained\n", Status.OK),  # powered down: Slurm wakes them
        ("debug* up 1 unknown*\n", Status.MISSING),  # slurmd not responding
        ("a up 1 drained\nb down 2 idle\n", Status.MISSING),
        ("", Status.MISSING),
    ],
)
def test_partitions_need_a_node_that_can_run_jobs(sinfo: str, status: Status) -> None:
    assert slurm_probes.judge_partitions(parse_partitions(sinfo)).status is status


@pytest.mark.slurm
def test_slurm_here_is_reachable_with_partitions() -> None:
    checks = {check.name: check for check in slurm_probes.findings()}
    assert checks["controller"].status is Status.OK
    partition = os.environ.get("HARBOR_HPC_TEST_SLURM_PARTITION", "")
    assert partition in checks["partitions"].detail
    # The test clusters hold jobs to their memory, as production clusters do (.ci/cgroup.conf).
    assert checks["jobs' memory"].detail.startswith("held to their --mem (task/cgroup")
    # No accounting on this cluster: no limit on queued jobs (the limits stage has one).
    assert "no limit on your queued jobs known" in checks["job limits"].detail


def test_a_full_queue_is_a_warning_saying_what_frees_it() -> None:
    found = slurm_probes.judge_limits(100, 0)
    assert found.status is Status.WARN and "nothing of a run goes out now" in found.detail
    assert "squeue --me" in found.fix


def test_a_cluster_without_cgroups_leaves_memory_to_the_watchdog() -> None:
    """The recorded configuration of a Slurm without cgroup plugins."""
    config = parse_config((RECORDED / "scontrol-show-config.txt").read_text())
    found = slurm_probes.judge_memory(config)
    assert found.status is Status.OK and "the watchdog alone" in found.detail
    assert "task/none" in found.detail


@pytest.mark.slurm
def test_slurm_controller_down_says_to_start_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The real Slurm commands, pointed at a controller port where nothing listens.
    conf = tmp_path / "slurm.conf"
    conf.write_text(
        "ClusterName=nowhere\nSlurmctldHost=localhost\nSlurmctldPort=1\nMessageTimeout=2\n"
        "AuthType=auth/munge\nNodeName=localhost CPUs=1\nPartitionName=x Nodes=localhost\n"
    )
    monkeypatch.setenv("SLURM_CONF", str(conf))
    checks = {check.name: check for check in slurm_probes.findings()}
    assert checks["controller"].status is Status.MISSING
    assert "slurmctld" in checks["controller"].fix


@pytest.mark.docker
def test_docker_engine_answers(tmp_path: Path) -> None:
    [check] = doctor.probe_part(Part.DOCKER, tmp_path)
    assert check.status is Status.OK and "API" in check.detail


@pytest.mark.docker
@pytest.mark.slurm
@pytest.mark.apptainer
def test_doctor_here_is_ready_for_every_role(tmp_path: Path) -> None:
    env = dict(os.environ, HARBOR_HPC_CACHE=str(tmp_path / "cache"))
    env.pop("HARBOR_HPC_CONFIG", None)
    done = run_cli("--role", "all", "--json", env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    statuses = by_part(json.loads(done.stdout))
    for part in ("apptainer", "slurm", "docker"):
        assert "missing" not in statuses[part]
    report = doctor.run_doctor(Role.CLUSTER, tmp_path / "cache")
    assert report.ok and {check.part for check in report.checks} >= {"apptainer", "slurm"}


@pytest.mark.slurm
@pytest.mark.apptainer
@pytest.mark.other_user
def test_doctor_as_another_ordinary_user_is_ready_for_the_cluster() -> None:
    """Another cluster user, with none of the tester's setup (no docker group), from its HOME."""
    done = subprocess.run(
        other_user_command([sys.executable, "-m", "harbor_hpc", "doctor", "--json"]),
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    checks = json.loads(done.stdout)
    run = next(c for c in checks if c["part"] == "apptainer" and c["check"] == "run an image")
    assert run["status"] == "ok"


def dead_docker_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ, HARBOR_HPC_CACHE=str(tmp_path / "cache"), COLUMNS="400")
    env["DOCKER_HOST"] = f"unix://{tmp_path / 'dead.sock'}"
    env.pop("HARBOR_HPC_CONFIG", None)
    return env


@pytest.mark.apptainer
@pytest.mark.apptainer_only
def test_build_role_is_ready_without_docker_where_apptainer_builds_work(tmp_path: Path) -> None:
    done = run_cli("--role", "build", "--json", env=dead_docker_env(tmp_path), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    checks = json.loads(done.stdout)
    assert by_part(checks)["docker"] == {"missing"}
    build = {check["check"]: check for check in checks if check["part"] == "apptainer-build"}
    assert list(build) == ["fakeroot build", "fakeroot ids", "overlay", "scratch space"]
    assert build["fakeroot build"]["status"] == "ok", build["fakeroot build"]
    assert "subuid range" in build["fakeroot build"]["detail"]
    assert "GiB free" in build["scratch space"]["detail"]


# What Apptainer says where the user has no subuid range and no root-mapped fallback works.
NO_FAKEROOT = "FATAL:   could not use fakeroot: no mapping entry found in /etc/subuid for {user}"


@pytest.mark.apptainer
@pytest.mark.apptainer_only
def test_build_role_says_what_to_ask_the_admins_for_when_fakeroot_builds_fail(
    tmp_path: Path,
) -> None:
    real = shutil.which("apptainer") or "apptainer"
    refusing = tmp_path / "apptainer"
    refusing.write_text(
        '#!/bin/sh\nfor arg in "$@"; do\n  if [ "$arg" = --fakeroot ]; then\n'
        f"    echo '{NO_FAKEROOT.format(user=getpass.getuser())}' >&2; exit 255\n  fi\ndone\n"
        f'exec {real} "$@"\n'
    )
    refusing.chmod(0o755)
    env = dead_docker_env(tmp_path)
    env["HARBOR_HPC_APPTAINER"] = str(refusing)
    done = run_cli("--role", "build", "--json", env=env, cwd=tmp_path)
    assert done.returncode == 1
    assert "(Docker or Apptainer builds): Docker, Apptainer builds missing" in " ".join(
        done.stderr.split()
    )
    [build] = [c for c in json.loads(done.stdout) if c["check"] == "fakeroot build"]
    assert build["status"] == "missing" and "no mapping entry" in build["detail"]
    assert "/etc/subuid" in build["fix"] and "--builder docker" in build["fix"]


def test_the_checklist_fits_80_columns_and_every_check_not_ok_has_a_fix(tmp_path: Path) -> None:
    env = {**bare_env(tmp_path), "COLUMNS": "80"}
    checks = json.loads(run_cli("--role", "all", "--json", env=env, cwd=tmp_path).stdout)
    assert [c["check"] for c in checks if c["status"] != "ok" and not c["fix"]] == []
    shown = run_cli("--role", "all", env=env, cwd=tmp_path).stdout
    assert all(len(line.rstrip()) <= 80 for line in shown.splitlines())
    not_ok = sum(c["status"] != "ok" for c in checks)
    assert not_ok > 3 and shown.count("fix: ") == not_ok
    # Words are not cut: every word of every detail that fits a line is on the page whole (the
    # test's own paths are longer than a line; figures such as free space change between runs).
    words = {
        word
        for c in checks
        for word in c["detail"].split()
        if len(word) < 40 and not any(ch.isdigit() for ch in word)
    }
    assert all(word in shown for word in words)
