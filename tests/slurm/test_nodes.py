"""`harbor-hpc doctor --nodes`: each node of a partition asked, in a job of its own, whether it
reads a zstd .sif, and every .sif made after compressed as all of them can read (issue 39)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harbor_hpc.core.cluster_name import slurm_cluster_name
from harbor_hpc.core.errors import InputError
from harbor_hpc.runtimes.apptainer import (
    apptainer_here,
    build_command,
    sif_compression,
    zstd_here,
)
from harbor_hpc.runtimes.apptainer_nodes import (
    Asked,
    NodeAnswer,
    answers_file,
    parse_answer,
    save_answers,
    zstd_verdict,
)
from harbor_hpc.slurm.cluster import parse_partition_nodes
from tests.conftest import MultiNode
from tests.support.cli import cli
from tests.support.images import TinyImage, squashfs_compression

SINFO = """\
c1|idle|debug*
c2|mix|debug*
c3|drain|debug*
c4|down*|debug*
c5|idle*|debug*
g1|alloc|gpu
"""


@pytest.fixture(autouse=True)
def home_of_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A HOME of the test's own: the answers it keeps are not the test user's."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    empty = tmp_path / "empty-config.toml"
    empty.write_text("")
    monkeypatch.setenv("HARBOR_HPC_CONFIG", str(empty))
    sif_compression.cache_clear()
    yield home
    sif_compression.cache_clear()


def test_a_partitions_nodes_that_take_jobs_are_asked_the_rest_named() -> None:
    nodes = parse_partition_nodes(SINFO, None)
    # c5 missed the controller's last ping (busy, as a CI machine's often is): still asked.
    assert (nodes.partition, nodes.asked, nodes.not_taking_jobs) == (
        "debug",
        ("c1", "c2", "c5"),
        ("c3", "c4"),
    )
    assert parse_partition_nodes(SINFO, "gpu").asked == ("g1",)


def test_an_unknown_partition_names_the_known_ones() -> None:
    with pytest.raises(InputError, match="partition 'nope' has no nodes") as raised:
        parse_partition_nodes(SINFO, "nope")
    assert raised.value.hint == "known: debug, gpu"


def test_a_nodes_answer_is_read_from_what_its_job_printed() -> None:
    yes = parse_answer("c1", "apptainer version 1.4.5\nharbor-hpc: read the zstd image\n")
    assert (yes.apptainer, yes.reads_zstd) == ("apptainer version 1.4.5", True)
    said = "FATAL:   while loading: corrupted image: unknown compression algorithm value 6"
    no = parse_answer("c2", f"apptainer version 1.3.6\n{said}\n")
    assert (no.reads_zstd, no.said) == (False, said)
    assert parse_answer("c3", "").said == "the job printed nothing"


@pytest.mark.apptainer
@pytest.mark.apptainer_only
def test_nodes_never_asked_get_gzip_and_doctor_says_how_to_ask(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    if zstd_here() is not None:
        pytest.skip(f"this node makes no zstd images: {zstd_here()}")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").symlink_to("/bin/true")  # a Slurm is here
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    assert zstd_verdict()[0] is None
    assert sif_compression().name == "gzip"
    assert "have not been asked" in sif_compression().why
    # A command that makes an image says so, once.
    with caplog.at_level(logging.WARNING):
        command = build_command("image.sif", "docker://x")
        build_command("other.sif", "docker://y")
    assert "--mksquashfs-args" not in command
    assert caplog.text.count("images are made with gzip: the compute nodes of ") == 1
    checks = json.loads(cli("doctor", "--json", check=False).stdout)
    compression = next(check for check in checks if check["check"] == "compression")
    assert compression["status"] == "warn" and "doctor --nodes" in compression["fix"]
    # Without Slurm, the images run where they are made: zstd, which this node reads.
    alone = tmp_path / "no-slurm"
    alone.mkdir()
    for tool in ("apptainer", "mksquashfs"):
        (alone / tool).symlink_to(str(shutil.which(tool)))
    monkeypatch.setenv("PATH", str(alone))
    sif_compression.cache_clear()
    assert sif_compression().name == "zstd" and "no Slurm here" in sif_compression().why


@pytest.mark.slurm
@pytest.mark.apptainer
def test_the_nodes_are_asked_and_images_follow_their_answers(
    tmp_path: Path, tiny_image: TinyImage, home_of_its_own: Path
) -> None:
    if zstd_here() is not None:
        pytest.skip(f"this node makes no zstd images: {zstd_here()}")
    partition = os.environ.get("HARBOR_HPC_TEST_SLURM_PARTITION", "debug")
    store = tmp_path / "store"
    asked = cli("doctor", "--nodes", "--partition", partition, "--cache-dir", str(store), "--json")
    report = json.loads(asked.stdout)
    assert report["answers"] and all(answer["reads_zstd"] for answer in report["answers"])
    assert report["compression"] == "zstd" and report["unanswered"] == []
    assert answers_file() == home_of_its_own / ".cache" / "harbor-hpc" / "nodes.json"
    assert json.loads(answers_file().read_text())  # kept for every later command
    assert _converted(tiny_image, tmp_path / "zstd") == "zstd"

    def asked_with(program: str, script: str) -> str:
        """What `doctor --nodes` prints where the site's setup line puts `program` (a shell
        `script`) first on the nodes' PATH."""
        first = tmp_path / f"first-{program}"
        first.mkdir()
        (first / program).write_text(script)
        (first / program).chmod(0o755)
        return cli(
            "doctor", "--nodes", "--partition", partition, "--cache-dir", str(store),
            "--setup", f"export PATH={first}:$PATH",
        ).stdout  # fmt: skip

    if not apptainer_here():
        # A node without Apptainer whose squashfuse_ll reads no zstd: an image's first use
        # there would fail, so gzip.
        said = asked_with("squashfuse_ll", "#!/bin/sh\necho 'no zstd support' >&2\nexit 1\n")
        assert "no Apptainer: unsquashfs version" in said
        assert "squashfuse_ll: no zstd support" in said
        assert "images from now on: gzip" in said
    # A node whose Apptainer is older than 1.4: it says so, and images are gzip from then on,
    # which every node reads.
    said = asked_with(
        "apptainer",
        "#!/bin/sh\n"
        '[ "$1" = --version ] && echo "apptainer version 1.3.6" && exit 0\n'
        'echo "FATAL:   while loading: corrupted image: unknown compression algorithm value 6"\n'
        "exit 255\n",
    )
    assert "apptainer version 1.3.6" in said
    assert "unknown compression algorithm value 6" in said
    assert "images from now on: gzip" in said
    assert _converted(tiny_image, tmp_path / "gzip") == "gzip"
    checks = json.loads(cli("doctor", "--json", check=False).stdout)
    compression = next(check for check in checks if check["check"] == "compression")
    assert compression["status"] == "ok" and "1.3.6" in compression["detail"]


@pytest.mark.multinode
@pytest.mark.slurm
@pytest.mark.apptainer
def test_each_node_of_a_partition_answers_from_a_job_of_its_own(
    multinode: MultiNode, home_of_its_own: Path
) -> None:
    if zstd_here() is not None:
        pytest.skip(f"this node makes no zstd images: {zstd_here()}")
    store = multinode.work / "store"  # every node reads the probe image there
    env = {**multinode.env, "HOME": str(home_of_its_own)}
    report = json.loads(
        cli("doctor", "--nodes", "--cache-dir", str(store), "--json", env=env).stdout
    )
    assert report["partition"] == "multi"  # the default partition, unnamed
    answers = {answer["node"]: answer["reads_zstd"] for answer in report["answers"]}
    assert answers == {"n1": True, "n2": True, "n3": True}, report
    assert report["compression"] == "zstd"


def _converted(tiny_image: TinyImage, store: Path) -> str:
    """How a .sif converted now, in a process of its own as every command is, is compressed."""
    made = subprocess.run(
        [
            sys.executable, "-c",
            "import sys; from pathlib import Path; from harbor_hpc.containers.store import "
            "ensure_sif; print(ensure_sif(sys.argv[1], Path(sys.argv[2]), nohttps=True))",
            tiny_image.open_ref, str(store),
        ],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return squashfs_compression(Path(made.stdout.strip().splitlines()[-1]))


@pytest.mark.slurm
def test_another_clusters_answers_are_not_this_ones(home_of_its_own: Path) -> None:
    """A second cluster's nodes (another SLURM_CONF, a home both share) answered for it
    alone: doctor and the images of this cluster went by them."""
    reads = (NodeAnswer("c1", "apptainer version 1.4.5", True),)
    save_answers(Asked("another-cluster", "debug", time.time(), reads))
    verdict, why = zstd_verdict()
    assert verdict is None and f"compute nodes of {slurm_cluster_name()} have not" in why
    save_answers(Asked(slurm_cluster_name(), "debug", time.time(), reads))
    assert zstd_verdict() == (True, f"1 node of {slurm_cluster_name()}/debug read zstd images "
                              "(asked 0 min ago)")  # fmt: skip
