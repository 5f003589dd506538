"""A branching rollout on the sandbox API (issue 58): a scripted policy forks its sandbox at a
turn and continues each child differently; every child's reward is its own, trainable, and
its result says where it branched, so that a trainer can rebuild the tree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harbor_hpc.containers.branch import BRANCH
from harbor_hpc.containers.snapshot import PREFIX
from harbor_hpc.core.errors import InputError
from harbor_hpc.results.rollout import trial_rollout
from harbor_hpc.sandbox.pool import Branch, SandboxOptions, SandboxPool
from tests.support.sample_tasks import make_task

pytestmark = [pytest.mark.apptainer, pytest.mark.harbor]

# Each child's next turns after the fork (the task wants 42 in /tmp/answer).
CONTINUATIONS = {
    "right": "cat /tmp/partial > /tmp/answer",
    "wrong": "echo 41 > /tmp/answer",
    "kills its processes, then right": "kill -9 -1; cat /tmp/partial > /tmp/answer",
}


def test_a_branching_rollout_gives_each_branch_its_own_reward_and_says_the_tree(
    debian_sif: Path, tmp_path: Path
) -> None:
    task = make_task(tmp_path / "tasks", "answer", image=str(debian_sif))
    scratch = tmp_path / "scratch"
    options = SandboxOptions(trials_dir=tmp_path / "trials", scratch_dir=scratch)
    with SandboxPool(options) as pool:
        root = pool.open(task)
        root.exec("echo 42 > /tmp/partial")  # the shared prefix: two turns
        root.exec("apt-get --version >/dev/null")
        with pytest.raises(InputError, match=r"fork\(0\): at least 1"):
            root.fork(0)
        children = root.fork(len(CONTINUATIONS))
        for child, command in zip(children, CONTINUATIONS.values(), strict=True):
            assert child.exec(command).return_code in (0, 137)
        # The root goes on from its prefix; no child's write reaches it.
        assert root.exec("cat /tmp/answer 2>/dev/null || echo none").stdout == "none\n"
        (grandchild,) = children[1].fork(1, step=7)  # the wrong branch, forked again
        assert grandchild.exec("cat /tmp/answer").stdout == "41\n"
        grandchild.exec("cat /tmp/partial > /tmp/answer")
        results = [child.verify() for child in children]
        deeper = grandchild.verify()
        unfinished = root.verify()
    rewards = {
        name: (result.reward, result.trainable)
        for name, result in zip(CONTINUATIONS, results, strict=True)
    }
    assert rewards == {
        "right": (1.0, True),
        "wrong": (0.0, True),
        "kills its processes, then right": (1.0, True),
    }
    assert (deeper.reward, deeper.trainable) == (1.0, True)
    assert (unfinished.reward, unfinished.trainable, unfinished.branch) == (0.0, True, None)
    # The tree: each branch names its parent and the step it branched at.
    assert {result.branch for result in results} == {Branch(parent=root.id, step=2)}
    assert deeper.branch == Branch(parent=children[1].id, step=7)
    assert [result.sandbox for result in results] == [child.id for child in children]
    assert deeper.trial_dir is not None and results[1].trial_dir is not None
    said = json.loads((deeper.trial_dir / BRANCH).read_text())
    assert said == {"parent_trial": str(results[1].trial_dir), "step": 7}
    # The rollout line of the trial carries it too (and so its harbor-rl and nemo-gym lines).
    assert trial_rollout(deeper.trial_dir, task)["branch"] == said
    assert list(scratch.glob(f"{PREFIX}*")) == []  # the copies went with their sandboxes


def test_a_snapshot_is_restored_as_often_as_asked_until_released(
    debian_sif: Path, tmp_path: Path
) -> None:
    task = make_task(tmp_path / "tasks", "answer", image=str(debian_sif))
    scratch = tmp_path / "scratch"
    kwargs = {"snapshot_storage_mb": 4}
    options = SandboxOptions(scratch_dir=scratch, environment_kwargs=kwargs)
    with SandboxPool(options) as pool:
        root = pool.open(task)
        root.exec("echo 42 > /tmp/saved")
        saved = root.snapshot(step=5)
        root.exec("head -c 6000000 /dev/zero > /tmp/big")
        with pytest.raises(InputError, match="snapshot_storage_mb=4: remove snapshots"):
            root.snapshot()
        root.close()  # the snapshot outlives the sandbox it was taken of
        first = saved.restore()
        again = saved.restore(2)
        said = [
            box.exec("cat /tmp/saved; ls /tmp/big 2>&1 | wc -l").stdout for box in first + again
        ]
        for box in first + again:
            box.exec("cp /tmp/saved /tmp/answer")
        rewards = [box.verify() for box in first + again]
        saved.release()
        with pytest.raises(InputError, match="was released: take another"):
            saved.restore()
        left = list(scratch.glob(f"{PREFIX}*"))
    assert said == ["42\n1\n"] * 3  # `ls` of the missing file says so on one line
    assert {(r.reward, r.trainable, r.branch) for r in rewards} == {
        (1.0, True, Branch(parent=root.id, step=5))
    }
    assert left == []
