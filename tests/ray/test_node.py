"""What a Ray node of `ray up` reads of `ray start`'s output when Ray would not start there
(recorded lines of Ray 2.52), and how `ray up` gets to name the node."""

from __future__ import annotations

from pathlib import Path

from harbor_hpc.ray.node import failure_file, failure_rank, failures

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
