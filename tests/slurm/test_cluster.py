"""The Slurm layer without Slurm: parsers on recorded output, and every call bounded and named
when the commands (tests/support/fake_slurm/) fail, hang or are missing."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from harbor_hpc.core.errors import InputError
from harbor_hpc.ray.cluster import UpOptions, job_script
from harbor_hpc.slurm import cluster
from harbor_hpc.slurm.cluster import Executor, JobRequest, NodeLimits, SlurmError
from tests.support.fake_slurm import (
    RECORDED,
    SBATCH_BAD_PARTITION,
    SBATCH_UNREACHABLE,
    FakeSlurm,
)

# `squeue -h -r -o '%i|%T|%r'` on Slurm 22.05 as recorded: a held array `--array=0-3%2` (each
# element; without -r, or for elements not yet split off on other versions, the range itself),
# a job asking for 64 CPUs of 2-CPU nodes, one asking for 5 of 1 node, one running.
SQUEUE_REASONS = (
    "9|PENDING|PartitionConfig\n11|PENDING|PartitionNodeLimit\n8_0|PENDING|JobHeldUser\n"
    "8_1|PENDING|JobHeldUser\n8_2|PENDING|JobHeldUser\n8_3|PENDING|JobHeldUser\n"
    "10|RUNNING|None\n"
)


def test_array_ranges_expand() -> None:
    assert cluster.expand_array("12_[0-2,5%2]") == ["12_0", "12_1", "12_2", "12_5"]
    assert cluster.expand_array("12_3") == ["12_3"]
    assert cluster.expand_array("12") == ["12"]
    assert cluster.parse_squeue_reasons(SQUEUE_REASONS) == {
        "9": "PartitionConfig",
        "11": "PartitionNodeLimit",
        **{f"8_{i}": "JobHeldUser" for i in range(4)},
        "10": None,
    }
    ranged = cluster.parse_squeue_reasons("275_[0-5%2]|PENDING|Priority\n280|RUNNING|None\n")
    assert ranged == {**{f"275_{i}": "Priority" for i in range(6)}, "280": None}


def test_only_the_reasons_waiting_cannot_end_mean_never() -> None:
    never = ["PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints"]
    never += ["InvalidQOS", "QOSMaxCpuPerJobLimit", "AssocMaxWallDurationPerJobLimit"]
    assert all(cluster.never_starts(reason) for reason in never)
    waits = ("Priority", "Resources", "JobHeldUser", "ReqNodeNotAvail", "QOSMaxJobsPerUserLimit")
    assert not any(cluster.never_starts(reason) for reason in (*waits, "AssocMaxJobsLimit", None))


def test_what_sinfo_and_scontrol_say_is_read() -> None:
    assert cluster.parse_node_limits("2 21694\n") == NodeLimits(cpus=2, mem_mb=21694)
    # Several node kinds: the biggest by memory; "+" marks the smallest of a range.
    assert cluster.parse_node_limits("64 256000+\n128+ 512000\nN/A N/A\n") == NodeLimits(
        128, 512000
    )
    assert cluster.parse_node_limits("") is None
    # The GPU types of every node, as Slurm names them; untyped GPUs and other GRES have none.
    gres = "8 64000 gpu:a100:4(S:0-1),gpu:h100_80gb:2\n16 128000 gpu:2,shard:8\n2 900 (null)\n"
    assert cluster.parse_node_limits(gres) == NodeLimits(
        16, 128000, frozenset({"a100", "h100_80gb"})
    )
    config = cluster.parse_config((RECORDED / "scontrol-show-config.txt").read_text())
    assert cluster.parse_max_array_size(config) == 10001
    assert cluster.parse_max_array_size({}) == cluster.DEFAULT_MAX_ARRAY_SIZE
    assert config["ProctrackType"] == "proctrack/linuxproc"


def test_ping_and_partitions_are_read() -> None:
    up = cluster.parse_ping("Slurmctld(primary) at vm is UP\n")
    assert up == ["Slurmctld(primary) at vm is UP"]
    down = "Slurmctld(primary) at a is DOWN\nSlurmctld(backup) at b is UP\n"
    assert cluster.Ping(cluster.parse_ping(down), down, "").up  # a backup answers
    assert not cluster.Ping(cluster.parse_ping("Slurmctld(primary) at a is DOWN"), "", "").up
    partitions = cluster.parse_partitions("debug* up 1 idle\ngpu up 4 idle~\ncpu down 2 idle\n")
    assert partitions.usable == ["debug*", "gpu"]
    assert partitions.summary == "cpu (down), debug* (idle), gpu (idle~)"
    assert cluster.parse_partitions("debug* up 1 unknown*\n").usable == []


def test_queued_jobs_asks_squeue_once(fake_slurm: FakeSlurm) -> None:
    fake_slurm.answer("squeue", "275_[2-3]|PENDING|Priority\n275_1|RUNNING|None\n")
    assert cluster.queued_jobs(["275", "280"]) == {"275_1", "275_2", "275_3"}
    assert fake_slurm.calls("squeue") == [["-h", "-r", "-o", "%i|%T|%r", "-j", "275,280"]]
    assert cluster.queued_jobs([]) == set()
    assert len(fake_slurm.calls("squeue")) == 1  # nothing to ask: no call


def test_a_purged_lone_job_is_gone_and_a_failure_is_named(fake_slurm: FakeSlurm) -> None:
    fake_slurm.answer(
        "squeue", stderr="slurm_load_jobs error: Invalid job id specified\n", returncode=1
    )
    assert cluster.queued_jobs(["999999"]) == set()
    fake_slurm.answer(
        "squeue",
        stderr="slurm_load_jobs error: Unable to contact slurm controller (connect failure)\n",
        returncode=1,
    )
    with pytest.raises(SlurmError) as failed:
        cluster.queued_jobs(["275"])
    assert failed.value.message == (
        "`squeue -h -r -o %i|%T|%r -j 275` failed: "
        "slurm_load_jobs error: Unable to contact slurm controller (connect failure)"
    )
    assert failed.value.hint and "scontrol ping" in failed.value.hint


def test_a_hung_command_is_cut_short(fake_slurm: FakeSlurm) -> None:
    fake_slurm.answer("squeue", hang_s=30)
    fake_slurm.answer("sinfo", hang_s=30)
    started = time.monotonic()
    with pytest.raises(SlurmError, match=r"squeue.* did not answer within 0\.5 s"):
        cluster.queued_jobs(["275"], timeout=0.5)
    with pytest.raises(SlurmError, match=r"sinfo.* did not answer within 0\.5 s"):
        cluster.partition_limits("debug", timeout=0.5)
    assert time.monotonic() - started < 5


def test_a_hung_sbatch_under_submitit_is_cut_short(
    fake_slurm: FakeSlurm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The bound rests on overriding submitit's private `_make_submission_command`: if submitit
    # renamed it, the override would silently do nothing and sbatch would hang here.
    import submitit

    assert hasattr(submitit.SlurmExecutor, "_make_submission_command"), (
        "submitit no longer has SlurmExecutor._make_submission_command: "
        "harbor_hpc/slurm/cluster.py's BoundedSlurmExecutor no longer bounds sbatch"
    )
    monkeypatch.setattr(cluster, "SBATCH_TIMEOUT_S", 0.5)
    fake_slurm.answer("sbatch", hang_s=30)
    request = JobRequest("harbor-hpc-test", time_min=2, mem_mb=200, cpus=1)
    pool = cluster.executor(tmp_path / "jobs", Executor.SLURM, request)
    started = time.monotonic()
    with pytest.raises(SlurmError) as hung:
        cluster.submit_array(pool, str, [1], what="the test array", hint="try again")
    assert time.monotonic() - started < 10
    assert hung.value.message == (
        "Slurm refused the test array: sbatch did not answer within 0.5 s"
    )
    assert hung.value.exit_code == 1


def test_a_missing_command_says_where_to_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SlurmError, match="squeue is not on PATH"):
        cluster.queued_jobs(["275"])
    with pytest.raises(SlurmError, match="scontrol is not on PATH"):
        cluster.max_array_size()
    assert cluster.missing_commands() == list(cluster.COMMANDS)
    assert cluster.choose_executor("auto") is Executor.LOCAL
    with pytest.raises(SlurmError, match="--executor slurm, but sbatch is not on PATH"):
        cluster.choose_executor("slurm")


def test_the_executor_is_chosen_by_name(fake_slurm: FakeSlurm) -> None:
    assert cluster.choose_executor("auto") is Executor.SLURM  # sbatch is on PATH
    assert cluster.choose_executor("local") is Executor.LOCAL
    with pytest.raises(InputError, match="--executor 'pbs' is not one of auto, slurm, local"):
        cluster.choose_executor("pbs")


def test_limits_and_array_size_come_from_the_cluster(fake_slurm: FakeSlurm) -> None:
    fake_slurm.answer("sinfo", "2 21694\n")
    fake_slurm.answer("scontrol", (RECORDED / "scontrol-show-config.txt").read_text())
    assert cluster.partition_limits("debug") == NodeLimits(2, 21694)
    assert fake_slurm.calls("sinfo") == [["-h", "-o", "%c", "%m", "%G", "-p", "debug"]]
    assert cluster.max_array_size() == 10001


def test_a_script_slurm_refuses_is_bad_input_unless_the_controller_is_unreachable(
    fake_slurm: FakeSlurm, tmp_path: Path
) -> None:
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH --partition=nosuch\ntrue\n")
    fake_slurm.answer(
        "sbatch", stderr=SBATCH_BAD_PARTITION.format(partition="nosuch"), returncode=1
    )
    with pytest.raises(SlurmError) as refused:
        cluster.submit_script(script, what="the job", hint="check --partition")
    assert refused.value.message == (
        "Slurm refused the job: sbatch: error: Batch job submission failed: "
        "Invalid partition name specified"
    )
    assert refused.value.exit_code == 2
    fake_slurm.answer("sbatch", stderr=SBATCH_UNREACHABLE, returncode=1)
    with pytest.raises(SlurmError) as unreachable:
        cluster.submit_script(script, what="the job", hint="check --partition")
    assert unreachable.value.exit_code == 1
    fake_slurm.answer("sbatch", "4242\n")
    assert cluster.submit_script(script, what="the job", hint="check --partition") == "4242"


def test_one_placement_places_an_array_and_a_batch_script_alike(
    fake_slurm: FakeSlurm, tmp_path: Path
) -> None:
    """`SlurmPlacement` is what every step takes: submitit's arrays (submit, convert, build)
    and our own batch scripts (ray up) ask Slurm for the same."""
    placement = cluster.SlurmPlacement(
        partition="debug",
        account="lab",
        qos="high",
        time_min=7,
        sbatch_args=("--constraint=a100", "exclusive"),
    )
    fake_slurm.answer("sbatch", "Submitted batch job 4242\n")
    request = cluster.unit_request("harbor-hpc-test", placement, cpus=2, mem_mb=100)
    pool = cluster.executor(tmp_path / "%j", Executor.SLURM, request)
    cluster.submit_array(pool, print, ["x"], what="the test job", hint="none")
    [[script]] = fake_slurm.calls("sbatch")
    array = Path(script).read_text().splitlines()
    expected = [
        "#SBATCH --partition=debug",
        "#SBATCH --account=lab",
        "#SBATCH --qos=high",
        "#SBATCH --constraint=a100",
        "#SBATCH --exclusive",
    ]
    assert placement.script_lines() == expected
    assert set(expected) | {"#SBATCH --time=7"} <= set(array)
    assert cluster.unit_request("x", cluster.SlurmPlacement(), cpus=1, mem_mb=1).time_min == 60
    with pytest.raises(InputError, match="--sbatch-arg '=' is empty"):
        cluster.SlurmPlacement(sbatch_args=("=",)).sbatch()


def commands(script: str) -> list[str]:
    """The lines of a batch script that run: not its #SBATCH lines, comments or blank lines."""
    return [line for line in script.splitlines() if line.strip() and not line.startswith("#")]


def test_every_script_of_ours_runs_the_sites_setup_lines_first(
    fake_slurm: FakeSlurm, tmp_path: Path
) -> None:
    """The templates of slurm/: an array's element (submit, build, convert) runs the site's
    lines, as written, before submitit's command; `ray up`'s job before its own."""
    placement = cluster.SlurmPlacement(setup=('site_module() { echo "$1"; }', "site_module x"))
    fake_slurm.answer("sbatch", "Submitted batch job 4242\n")
    request = cluster.unit_request("harbor-hpc-test", placement, cpus=1, mem_mb=100)
    pool = cluster.executor(tmp_path / "%j", Executor.SLURM, request)
    cluster.submit_array(pool, print, ["x"], what="the test job", hint="none")
    [[script]] = fake_slurm.calls("sbatch")
    array = commands(Path(script).read_text())
    assert array[:3] == [*placement.setup, "export SUBMITIT_EXECUTOR=slurm"]
    ray_job = job_script(tmp_path, UpOptions(nodes=1, placement=placement))
    assert ray_job.startswith("#!/bin/bash\n")
    assert commands(ray_job)[:3] == [*placement.setup, "set -euo pipefail"]


# `scontrol show assoc_mgr users=hpcuser flags=assoc` of Slurm 22.05 with MaxSubmitJobs=20 on
# the user's association and 15 of the user's jobs queued (trimmed to the lines that matter).
ASSOC_MGR = """Current Association Manager state

Association Records

ClusterName=harbor-hpc-limits Account=root UserName= Partition= Priority=0 ID=1
    GrpJobs=N(8) GrpJobsAccrue=N(7)
    GrpSubmitJobs=N(15) GrpWall=N(0.00)
    MaxJobs= MaxJobsAccrue= MaxSubmitJobs= MaxWallPJ=
ClusterName=harbor-hpc-limits Account=ci UserName= Partition= Priority=0 ID=3
    GrpJobs=N(8) GrpJobsAccrue=N(7)
    GrpSubmitJobs=N(15) GrpWall=N(0.00)
    MaxJobs= MaxJobsAccrue= MaxSubmitJobs= MaxWallPJ=
ClusterName=harbor-hpc-limits Account=ci UserName=hpcuser(1001) Partition= Priority=0 ID=5
    GrpJobs=N(8) GrpJobsAccrue=N(7)
    GrpSubmitJobs=N(15) GrpWall=N(0.00)
    MaxJobs= MaxJobsAccrue= MaxSubmitJobs=20(15) MaxWallPJ=
"""


def test_the_room_under_the_users_limit_on_queued_jobs_is_read_from_assoc_mgr() -> None:
    assert cluster.parse_submit_room(ASSOC_MGR, "hpcuser") == 5
    # An account's limit counts every user's jobs under it: the least room wins.
    grp = ASSOC_MGR.replace("GrpSubmitJobs=N(15)", "GrpSubmitJobs=17(15)", 1)  # root's
    assert cluster.parse_submit_room(grp, "hpcuser") == 2
    # Another user's association is not this user's limit; over the limit is no room.
    assert cluster.parse_submit_room(ASSOC_MGR, "hpcuser2") is None
    assert cluster.parse_submit_room(ASSOC_MGR.replace("20(15)", "10(15)"), "hpcuser") == 0
    # A cluster without accounting keeps no associations: no limit known.
    none = "Current Association Manager state\n\nNo associations currently cached in Slurm.\n"
    assert cluster.parse_submit_room(none, "hpcuser") is None


def test_a_job_queued_from_inside_a_job_gets_none_of_its_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in [n for n in os.environ if n.startswith(("SLURM_", "SUBMITIT_"))]:
        monkeypatch.delenv(name)
    assert cluster.outside_job() == []  # a login node: sbatch as the user set it up
    monkeypatch.setenv("SLURM_JOB_ID", "12")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    monkeypatch.setenv("SLURM_CONF", "/etc/slurm-limits/slurm.conf")  # the cluster: kept
    monkeypatch.setenv("SBATCH_ACCOUNT", "lab")  # the user's own setting: kept
    hidden = cluster.outside_job()
    assert hidden[0] == "env" and sorted(hidden[2::2]) == [
        "SLURM_ARRAY_TASK_ID",
        "SLURM_JOB_ID",
        "SUBMITIT_EXECUTOR",
    ]
