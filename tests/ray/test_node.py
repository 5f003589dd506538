"""What a Ray node of `ray up` reads of `ray start`'s output when Ray would not start there
(recorded lines of Ray 2.52), how `ray up` gets to name the node, and how a node reads the
cluster's address."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import pytest

from harbor_hpc.ray.node import (
    NoAddress,
    failure_file,
    failure_rank,
    failures,
    wait_for_address,
)

PANIC = (
    "2026-11-26 18:14:51,304\tPANIC scripts.py:886 -- `--labels=a!b=c` is not a valid string "
    "of key-value pairs, detailed error: Invalid label key name `a!b`."
)
UNFORMATTED = "Error: `{}` is not a valid string of key-value pairs, detailed error: {}"
TIMED_OUT = (
    "Exception: The current node timed out during startup. This could happen because some of "
    "the raylet failed to startup or the GCS has become overloaded."
)


def test_the_line_that_says_why_wins_over_chatter() -> None:
    assert failure_rank(PANIC) > failure_rank(UNFORMATTED) > failure_rank("Failed to get node")
    assert failure_rank(TIMED_OUT) == failure_rank(UNFORMATTED) == 2
    assert failure_rank("Local node IP: 10.77.0.12") == 0
    assert failure_rank('  File "ray/_private/node.py", line 441, in __init__') == 0


def test_up_reads_what_each_node_of_its_job_said(tmp_path: Path) -> None:
    failure_file(tmp_path, "42", "n2-1").write_text("node n2: ray start ended ...\n")
    failure_file(tmp_path, "42", "n1-0").write_text("node n1: ray start ended ...\n")
    failure_file(tmp_path, "41", "n3-2").write_text("an earlier job's\n")
    assert failures(tmp_path, "42") == [
        "node n1: ray start ended ...",
        "node n2: ray start ended ...",
    ]


def test_an_address_file_seen_before_ray_wrote_it_is_waited_for(tmp_path: Path) -> None:
    # Ray opens its address file, then writes it: a node that read it in between joined the
    # address "" (a CI run: `ValueError: Invalid address format:`).
    path = tmp_path / "ray_current_cluster"
    path.touch()
    writer = threading.Timer(1.0, path.write_text, args=("10.0.0.1:6379",))
    writer.start()
    try:
        assert wait_for_address(path, None) == "10.0.0.1:6379"
    finally:
        writer.join()


def test_a_ray_that_ended_without_an_address_is_said(tmp_path: Path) -> None:
    ended = subprocess.Popen(["sh", "-c", "exit 3"])
    ended.wait()
    (tmp_path / "empty").touch()
    for path in (tmp_path / "empty", tmp_path / "absent"):
        with pytest.raises(NoAddress, match="exit code 3 before it had an address"):
            wait_for_address(path, ended)
