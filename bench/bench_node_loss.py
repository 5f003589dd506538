"""A node lost under a busy fleet, again and again: does the loss stay on that node?

On the three-node cluster .ci/provision.sh makes (each node a namespace of this machine), each
round starts a Ray cluster over the three nodes (`harbor-hpc ray up`), 24 environments on it
(8 a node) that all run a command keeping a processor busy, again and again (the box loaded,
by our own fleet), then crashes node n2 and lets the fleet run on: exactly n2's 8 environments
must end (`EnvironmentHostUnavailable` naming n2), every other one must go on running commands.
Then the cluster comes down and n2 comes back, for the next round. The scenario is the CI test
`tests/ray/test_multinode.py::test_a_node_lost_under_a_busy_fleet_ends_only_its_own_environments`.

Prints each round (how many on the live nodes ended, the fewest commands one of them ran after
the crash, how many on the lost node ended) and how many rounds held.

Usage: uv run --extra ray python bench/bench_node_loss.py [--rounds 10] [--run-after 25]
(as an ordinary user, with /var/lib/harbor-hpc-ci/env.sh sourced)
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

from tests.conftest import MultiNode
from tests.ray.test_multinode import (
    ADDRESS,
    lose_a_node_under_a_busy_fleet,
    only_the_lost_nodes_environments_ended,
    ray_up,
)
from tests.support.cli import cli
from tests.support.images import build_debian_sif
from tests.support.multinode import multinode_work


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--run-after", type=float, default=25, help="seconds after the crash")
    args = parser.parse_args()
    env, work = multinode_work("bench-node-loss-")
    nodes_tmp = Path(os.environ.get("HARBOR_HPC_TEST_MULTI_NODE_TMP", "/var/tmp/harbor-hpc-nodes"))
    cluster = MultiNode(Path(env["SLURM_CONF"]), work, {node: nodes_tmp / node for node in ADDRESS})
    held = 0
    try:
        sif = build_debian_sif(work / "debian.sif", os.environ, background=False)
        for number in range(1, args.rounds + 1):
            cluster_dir = work / f"ray-{number}"
            began = time.monotonic()
            ray_up(cluster, cluster_dir)
            try:
                results = lose_a_node_under_a_busy_fleet(
                    cluster, sif, cluster_dir, run_after_s=args.run_after
                )
            finally:
                cli("ray", "down", "--cluster-dir", str(cluster_dir), env=env, check=False)
                cluster.restore()
            wrong = only_the_lost_nodes_environments_ended(results)
            held += not wrong
            live = [r for r in results if r["node"] != ADDRESS["n2"]]
            lost = [r for r in results if r["node"] == ADDRESS["n2"]]
            print(
                f"round {number:2}: {'held' if not wrong else 'FAILED'}; live nodes' "
                f"environments ended {sum(bool(r['error']) for r in live)}/{len(live)}, "
                f"fewest commands after the crash {min(r['after'] for r in live)}; "
                f"lost node's ended {sum(bool(r['error']) for r in lost)}/{len(lost)}; "
                f"round {time.monotonic() - began:.0f} s",
                flush=True,
            )
            for line in wrong:
                print(f"          {line}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{held}/{args.rounds} rounds held: only the lost node's environments ended")


if __name__ == "__main__":
    main()
